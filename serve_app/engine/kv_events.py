"""What a replica's prefix cache holds, published to routers incrementally.

`KVEventLog` (engine side, written by the `BlockManager` on the engine thread): every block that
enters the prefix cache is a *stored* event, every block that leaves it (evicted for reuse, cache
reset) a *removed* event, each with the next sequence number. It also keeps the set of keys cached
now, for full snapshots, and the cached prompt tokens of recently finished requests (so routers can
compare their prediction with what the engine found).

An engine in a process of its own sends its log's changes to the replica (`KVEventCursor` there,
`KVEventLog.replay` here), where a mirror log feeds the publisher.

`KVCachePublisher` (replica side, called at each `record_routing_stats` poll) turns the log into a
compact update, a plain dict merged into the routing stats:

    kv_epoch        str   changes when the engine (and so its cache) is new: routers drop their view
    kv_seq          int   sequence number of the newest event
    kv_from_seq     int   `kv_events` hold every event with from_seq < seq <= kv_seq
    kv_events       list  (seq, stored 1 / removed 0, block key), oldest first
    kv_snapshot     list  every cached block key at `kv_seq` (only in some updates, see below)
    kv_block_size   int   tokens per block (routers hash prompts with it)
    cached_tokens   list  (request id, cached prompt tokens, prompt tokens) of recently finished requests

Serve's controller polls the replica and broadcasts only the newest dict, so a router can miss an
update: the deltas therefore cover the last `window_polls` polls, not just the latest. A router
whose last applied seq is older than `kv_from_seq` has a gap (or sees a new epoch) and waits for the
next snapshot, which is sent every `snapshot_every_polls` polls, whenever the delta would be
larger than the snapshot, and always while the cache holds at most `small_snapshot_keys` blocks
(8 KiB of keys: cheaper than a router waiting for a resync). A GPU replica with 100k cached blocks thus sends its full set only
periodically, and otherwise just what changed.

Block keys are the first 8 bytes of the SHA-256 block hash (`serve_app.block_hash.block_key`): a
64-bit key is plenty to route by (a collision would mis-route, never serve wrong KV: the engine
looks blocks up by the full hash).
"""

from __future__ import annotations

import threading
import uuid
from collections import deque
from collections.abc import Iterable
from typing import Any

from serve_app.block_hash import BlockHash, block_key


class KVEventLog:
    """Thread-safe log of prefix-cache changes with sequence numbers (see module docstring)."""

    def __init__(self, max_events: int = 1 << 16, max_finished: int = 1024) -> None:
        self.epoch = uuid.uuid4().hex[:16]
        self._lock = threading.Lock()
        self._events: deque[tuple[int, int, int]] = deque(maxlen=max_events)
        self._keys: set[int] = set()
        self._seq = 0
        self._finished: deque[tuple[int, str, int, int]] = deque(maxlen=max_finished)
        self._num_finished = 0

    def stored(self, block_hash: BlockHash) -> None:
        self._add(1, block_key(block_hash))

    def removed(self, block_hash: BlockHash) -> None:
        self._add(0, block_key(block_hash))

    def _add(self, stored: int, key: int) -> None:
        with self._lock:
            self._seq += 1
            self._events.append((self._seq, stored, key))
            if stored:
                self._keys.add(key)
            else:
                self._keys.discard(key)

    def request_finished(self, request_id: str, num_cached_tokens: int, num_prompt_tokens: int) -> None:
        with self._lock:
            self._num_finished += 1
            self._finished.append((self._num_finished, request_id, num_cached_tokens, num_prompt_tokens))

    def replay(self, events: Iterable[tuple[int, int]], snapshot: Iterable[int] | None,
               finished: Iterable[tuple[str, int, int]]) -> None:
        """Mirror another log (an engine in a process of its own): `events` are its (stored, key)
        changes in order; `snapshot`, when not None, every key it holds now (its events were dropped):
        the difference becomes events here. `finished` are `request_finished` arguments."""
        if snapshot is not None:
            keys = set(snapshot)
            with self._lock:
                now = set(self._keys)
            events = [(0, k) for k in sorted(now - keys)] + [(1, k) for k in sorted(keys - now)]
        for stored, key in events:
            self._add(stored, key)
        for request_id, num_cached_tokens, num_prompt_tokens in finished:
            self.request_finished(request_id, num_cached_tokens, num_prompt_tokens)

    @property
    def seq(self) -> int:
        return self._seq

    def events_since(self, seq: int) -> list[tuple[int, int, int]] | None:
        """Events after `seq`, oldest first; None when some of them were already dropped."""
        with self._lock:
            if seq >= self._seq:
                return []
            if not self._events or self._events[0][0] > seq + 1:
                return None
            return [e for e in self._events if e[0] > seq]

    def snapshot(self) -> tuple[int, list[int]]:
        """(seq, every cached key) at one instant."""
        with self._lock:
            return self._seq, sorted(self._keys)

    @property
    def num_keys(self) -> int:
        return len(self._keys)

    def finished_since(self, count: int) -> tuple[int, list[tuple[str, int, int]]]:
        """(finished count now, [(request id, cached tokens, prompt tokens)] of the requests finished
        after the `count`-th)."""
        with self._lock:
            return self._num_finished, [(rid, c, p) for n, rid, c, p in self._finished if n > count]


class KVEventCursor:
    """Reads a log's changes in order, to mirror them in another process's log (`KVEventLog.replay`)."""

    def __init__(self, log: KVEventLog) -> None:
        self.log = log
        self._seq = 0
        self._finished = 0

    def take(self) -> tuple[list[tuple[int, int]], list[int] | None, list[tuple[str, int, int]]]:
        """What changed since the previous call: ((stored, key) events, None, finished requests), or
        ([], every key now, finished requests) when some events were dropped before this call."""
        self._finished, finished = self.log.finished_since(self._finished)
        events = self.log.events_since(self._seq)
        if events is None:
            self._seq, keys = self.log.snapshot()
            return [], keys, finished
        if events:
            self._seq = events[-1][0]
        return [(stored, key) for _, stored, key in events], None, finished


class KVCachePublisher:
    """Builds the routing-stats update at each poll (see module docstring); not thread-safe (one
    caller: the replica's event loop)."""

    def __init__(self, log: KVEventLog, block_size: int, window_polls: int = 25, snapshot_every_polls: int = 10,
                 small_snapshot_keys: int = 1024) -> None:
        if window_polls < 1 or snapshot_every_polls < 1:
            raise ValueError("window_polls, snapshot_every_polls: must be >= 1")
        self.log = log
        self.block_size = block_size
        self.snapshot_every_polls = snapshot_every_polls
        self.small_snapshot_keys = small_snapshot_keys  # a cache this small is always sent whole (no resync wait)
        # (event seq, finished count) after each of the last polls; an update covers what changed since the oldest
        self._marks: deque[tuple[int, int]] = deque([(0, 0)], maxlen=window_polls)
        self._num_polls = 0

    def next_update(self) -> dict[str, Any]:
        from_seq, from_finished = self._marks[0]
        events = self.log.events_since(from_seq)
        num_finished, finished = self.log.finished_since(from_finished)
        update: dict[str, Any] = {"kv_epoch": self.log.epoch, "kv_block_size": self.block_size,
                                  "cached_tokens": finished}
        snapshot_due = self._num_polls % self.snapshot_every_polls == 0
        if events is None or snapshot_due or len(events) > self.log.num_keys or self.log.num_keys <= self.small_snapshot_keys:
            seq, keys = self.log.snapshot()
            update.update(kv_seq=seq, kv_from_seq=seq, kv_events=[], kv_snapshot=keys)
        else:
            seq = events[-1][0] if events else from_seq
            update.update(kv_seq=seq, kv_from_seq=from_seq, kv_events=events)
        self._marks.append((seq, num_finished))
        self._num_polls += 1
        return update
