"""Prompt prefixes a replica has accepted but not yet computed, published with its routing stats.

A replica's cache events show a prompt's blocks only once its prefill ran. Between a router sending
a request and that moment, every *other* router (one per ingress replica) would see the prefix
nowhere, and could send the next request of the same group to another replica. So each replica
publishes, under `kv_pending`, the block keys (`serve_app.block_hash.prompt_block_keys`) of the
prompts it holds that have not produced their first token yet: a request queued behind them will
find those blocks cached. Keys leave when the request's first token (or its end) comes back.

At most `max_keys` keys are published (the newest requests' first): the set is a hint for routers,
and a replica with that much queued prefill is not where a router sends more anyway.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence


class PendingPrefixes:
    """request id → its prompt's block keys, until `done(request id)`; one event loop, no lock."""

    def __init__(self, block_size: int, max_keys: int = 8192) -> None:
        self.block_size = block_size
        self.max_keys = max_keys
        self._keys: dict[str, tuple[int, ...]] = {}
        self._counts: Counter[int] = Counter()

    def add(self, request_id: str, keys: Sequence[int]) -> None:
        if request_id in self._keys or not keys:
            return
        self._keys[request_id] = tuple(keys)
        self._counts.update(keys)

    def done(self, request_id: str) -> None:
        keys = self._keys.pop(request_id, None)
        if keys is None:
            return
        self._counts.subtract(keys)
        for key in keys:
            if self._counts[key] <= 0:
                del self._counts[key]

    def __len__(self) -> int:
        return len(self._keys)

    def published(self) -> list[int]:
        """Distinct pending keys, those of the most recently added requests first when capped."""
        if len(self._counts) <= self.max_keys:
            return list(self._counts)
        out: dict[int, None] = {}
        for keys in reversed(self._keys.values()):
            for key in keys:
                out[key] = None
            if len(out) >= self.max_keys:
                break
        return list(out)[: self.max_keys]
