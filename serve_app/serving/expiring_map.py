"""`ExpiringMap`: a dict whose entries expire a fixed time after they were set, at amortized O(1)
cost per operation.

The router keeps per-request state (its predicted cached tokens, its pending choice) until a report
or a callback removes it; the entries nobody removes (a lost report, a cancelled routing) must
still go. Scanning the whole map for them on every routing decision costs O(n) per decision, which
a flood of requests turns into milliseconds for everyone. Here every `set` also appends
(deadline, key) to a queue in time order; `expire(now)` pops from its front only the entries that are
due, skipping those already removed or set again since (lazy deletion), and the queue is rebuilt from
the live entries whenever stale records outnumber them, so its length stays O(live entries).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from typing import Generic, TypeVar

K = TypeVar("K")
V = TypeVar("V")


class ExpiringMap(Generic[K, V]):
    def __init__(self, ttl_s: float) -> None:
        self.ttl_s = ttl_s
        self._values: dict[K, tuple[V, float]] = {}  # key → (value, deadline)
        self._queue: deque[tuple[float, K]] = deque()  # (deadline, key), deadlines nondecreasing

    def set(self, key: K, value: V, now: float) -> None:
        deadline = now + self.ttl_s
        if self._queue and deadline < self._queue[-1][0]:
            deadline = self._queue[-1][0]  # a clock step backwards: keep the queue ordered
        self._values[key] = (value, deadline)
        self._queue.append((deadline, key))
        self._maybe_compact()

    def pop(self, key: K, default: V | None = None) -> V | None:
        item = self._values.pop(key, None)
        if item is None:
            return default
        self._maybe_compact()
        return item[0]

    def expire(self, now: float, max_records: int | None = None) -> int:
        """Drop entries whose deadline passed, looking at no more than `max_records` queue records
        (None: all that are due), so one call's cost stays bounded when many fall due together; the
        rest go in later calls. Returns how many entries were dropped."""
        dropped = 0
        budget = max_records if max_records is not None else len(self._queue)
        while self._queue and self._queue[0][0] < now and budget > 0:
            budget -= 1
            deadline, key = self._queue.popleft()
            item = self._values.get(key)
            if item is not None and item[1] == deadline:  # the live entry, not a stale record of it
                del self._values[key]
                dropped += 1
        return dropped

    def _maybe_compact(self) -> None:
        if len(self._queue) > 2 * len(self._values) + 1024:
            self._queue = deque(sorted(((deadline, key) for key, (_, deadline) in self._values.items()), key=lambda item: item[0]))

    def __getitem__(self, key: K) -> V:
        return self._values[key][0]

    def get(self, key: K, default: V | None = None) -> V | None:
        item = self._values.get(key)
        return default if item is None else item[0]

    def __contains__(self, key: object) -> bool:
        return key in self._values

    def __len__(self) -> int:
        return len(self._values)

    def __iter__(self) -> Iterator[K]:
        return iter(self._values)
