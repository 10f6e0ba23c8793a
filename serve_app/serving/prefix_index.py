"""The router's index of what each replica's prefix cache holds, rebuilt from the replicas' published
updates (`serve_app.engine.kv_events`: snapshots and sequence-numbered store/remove deltas).

Per replica it keeps the epoch (a new engine → a new view), the last applied sequence number and
the set of cached block keys. `apply` is idempotent (Serve hands routers the same dict until the
next broadcast) and tolerates lost or reordered updates: an update older than what was applied is
ignored; one whose deltas start after the last applied seq (a gap: broadcasts were missed) makes
the view unsynced, and it stays empty until the next snapshot, so the router never counts blocks it
cannot vouch for. Replicas that publish no `kv_epoch` (a backend without cache events) have no view.

Free of Ray and torch; one instance per router, used from the router's event loop only.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from serve_app.block_hash import leading_run


@dataclass
class ReplicaCacheView:
    epoch: str
    seq: int = -1
    synced: bool = False
    keys: set[int] = field(default_factory=set)


class PrefixIndex:
    def __init__(self) -> None:
        self.views: dict[str, ReplicaCacheView] = {}
        self.num_resyncs = 0  # gaps and new epochs seen (a replica restarted or updates were lost)

    def apply(self, replica_id: str, stats: Mapping[str, Any] | None) -> str:
        """Fold one published update in; returns what happened: "none" (no cache events published),
        "stale" (nothing newer), "snapshot", "delta", "gap" (now unsynced) or "waiting" (unsynced,
        no snapshot yet)."""
        if not stats or "kv_epoch" not in stats:
            return "none"
        epoch, seq = str(stats["kv_epoch"]), int(stats["kv_seq"])
        view = self.views.get(replica_id)
        if view is None or view.epoch != epoch:
            if view is not None:
                self.num_resyncs += 1
            view = self.views[replica_id] = ReplicaCacheView(epoch)
        if "kv_snapshot" in stats:
            if view.synced and seq <= view.seq:
                return "stale"
            view.keys, view.seq, view.synced = set(stats["kv_snapshot"]), seq, True
            return "snapshot"
        if not view.synced:
            return "waiting"
        if seq <= view.seq:
            return "stale"
        if view.seq < int(stats["kv_from_seq"]):
            view.keys.clear()
            view.synced = False
            self.num_resyncs += 1
            return "gap"
        for event_seq, stored, key in stats["kv_events"]:
            if event_seq <= view.seq:
                continue
            if stored:
                view.keys.add(key)
            else:
                view.keys.discard(key)
        view.seq = seq
        return "delta"

    def tracks(self, replica_id: str) -> bool:
        """True when the replica publishes cache events (synced or waiting for a snapshot)."""
        return replica_id in self.views

    def is_synced(self, replica_id: str) -> bool:
        view = self.views.get(replica_id)
        return view is not None and view.synced

    def num_cached_blocks(self, replica_id: str, keys: Sequence[int]) -> int:
        """Leading blocks of `keys` (a prompt's block keys, first block first) the replica holds."""
        view = self.views.get(replica_id)
        if view is None or not view.synced:
            return 0
        return leading_run(keys, view.keys)

    def remove(self, replica_id: str) -> None:
        self.views.pop(replica_id, None)
