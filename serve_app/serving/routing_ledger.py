"""The in-flight ledger: the requests one router sent (or is about to send) to each replica, until
they complete.

The routers' occupancy and backlog estimates (`routing_policy`) add to each replica's last published
sample what this ledger knows and the sample cannot show yet: the requests routed there since, and
the final size of those still running. An entry's life:
- reserved when the router makes its choice, so that concurrent routing decisions see it;
- confirmed when Serve reports the request routed, and moved if Serve sent it elsewhere (the chosen
  replica was full);
- dropped when Serve reports it completed on that replica (finished, failed or rejected), or when
  its replica leaves;
- expired: an unconfirmed choice whose routing was cancelled or that Serve never followed up (after
  `reservation_ttl_s`), and a confirmed request whose completion callback was lost (after
  `confirmed_ttl_s`: no request outlives the request timeout), so that a lost callback cannot make
  a replica look full forever.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any


@dataclass
class LedgerEntry:
    request_id: str
    replica_id: str
    blocks: int
    routed_at: float  # router wall clock
    prompt_tokens: int = 0
    confirmed: bool = False  # Serve reported it routed (accepted by the replica)
    pending: Any = None  # the PendingRequest of an unconfirmed choice (to notice cancellation)
    # when its prompt is predicted to have been read (routed_at + predicted TTFT, for routers that
    # predict it): from then on its prompt tokens no longer count as queued there
    prefill_done_at: float = math.inf


@dataclass
class InFlightLedger:
    """Requests this router sent (or is about to send) to each replica (module docstring: their life)."""

    entries: dict[str, LedgerEntry] = field(default_factory=dict)
    by_replica: dict[str, dict[str, LedgerEntry]] = field(default_factory=dict)

    def _place(self, entry: LedgerEntry) -> None:
        self.entries[entry.request_id] = entry
        self.by_replica.setdefault(entry.replica_id, {})[entry.request_id] = entry

    def _unplace(self, entry: LedgerEntry) -> None:
        self.entries.pop(entry.request_id, None)
        on_replica = self.by_replica.get(entry.replica_id)
        if on_replica is not None:
            on_replica.pop(entry.request_id, None)

    def reserve(self, request_id: str, replica_id: str, blocks: int, now: float, pending: Any = None,
                prompt_tokens: int = 0, prefill_done_at: float = math.inf) -> None:
        old = self.entries.get(request_id)
        if old is not None:
            if old.confirmed:  # already routed: a duplicate choice changes nothing
                return
            self._unplace(old)
        self._place(LedgerEntry(request_id, replica_id, blocks, now, prompt_tokens, pending=pending,
                                prefill_done_at=prefill_done_at))

    def confirm(self, request_id: str, replica_id: str, blocks: int, now: float, prompt_tokens: int = 0) -> LedgerEntry:
        entry = self.entries.get(request_id)
        if entry is not None and entry.replica_id != replica_id:
            self._unplace(entry)
            entry = LedgerEntry(request_id, replica_id, entry.blocks, now, entry.prompt_tokens,
                                prefill_done_at=now + (entry.prefill_done_at - entry.routed_at))
            self._place(entry)
        elif entry is None:
            entry = LedgerEntry(request_id, replica_id, blocks, now, prompt_tokens)
            self._place(entry)
        entry.confirmed = True
        entry.pending = None
        return entry

    def complete(self, request_id: str, replica_id: str) -> bool:
        """Drop the request if it is on `replica_id` (a late callback for an earlier attempt on another
        replica leaves the current attempt alone)."""
        entry = self.entries.get(request_id)
        if entry is None or entry.replica_id != replica_id:
            return False
        self._unplace(entry)
        return True

    def expire(self, now: float, ttl_s: float, confirmed_ttl_s: float = math.inf) -> int:
        """Drop unconfirmed choices whose routing was cancelled or that Serve never followed up, and
        confirmed requests older than `confirmed_ttl_s` (their completion callback was lost: no
        request outlives the request timeout)."""
        def is_stale(e: LedgerEntry) -> bool:
            if e.confirmed:
                return now - e.routed_at > confirmed_ttl_s
            return now - e.routed_at > ttl_s or _cancelled(e.pending)

        stale = [e for e in self.entries.values() if is_stale(e)]
        for e in stale:
            self._unplace(e)
        return len(stale)

    def remove_replica(self, replica_id: str) -> None:
        for entry in list(self.by_replica.pop(replica_id, {}).values()):
            self.entries.pop(entry.request_id, None)

    def num_in_flight(self, replica_id: str) -> int:
        return len(self.by_replica.get(replica_id, ()))

    def newest_before(self, replica_id: str, t: float, n: int) -> tuple[int, int]:
        """(blocks, requests) of the newest `n` requests routed to the replica at or before time `t`."""
        if n <= 0:
            return 0, 0
        older = sorted((e for e in self.by_replica.get(replica_id, {}).values() if e.routed_at <= t),
                       key=lambda e: e.routed_at, reverse=True)[:n]
        return sum(e.blocks for e in older), len(older)

    def since(self, replica_id: str, t: float | None, now: float | None = None) -> tuple[int, int, int]:
        """(blocks, requests, prompt tokens) routed to the replica after time `t` (None: all in flight);
        with `now`, prompt tokens only of the requests whose prompt is not yet predicted read."""
        blocks = count = prompt_tokens = 0
        for entry in self.by_replica.get(replica_id, {}).values():
            if t is None or entry.routed_at > t:
                blocks += entry.blocks
                count += 1
                if now is None or now < entry.prefill_done_at:
                    prompt_tokens += entry.prompt_tokens
        return blocks, count, prompt_tokens


def _cancelled(pending: Any) -> bool:
    future = getattr(pending, "future", None)
    return future is not None and future.cancelled()
