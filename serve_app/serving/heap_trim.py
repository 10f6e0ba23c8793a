"""Return the C allocator's free heap pages to the OS while a replica is idle.

A CPU replica allocates and frees tensors of many sizes every step; glibc keeps the freed pages of
its heaps, so the resident set size drifts with the traffic's shapes (tens of MB up and down between
two idle moments) although nothing is held. `IdleHeapTrimmer.maybe_trim` calls glibc's
`malloc_trim(0)` when no request is in flight, some were served since the last trim, and at least
`min_interval_s` have passed: it costs a few milliseconds, only when there is nothing to delay.
Where the C library is not glibc it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import time
from collections.abc import Callable


def _glibc_malloc_trim() -> Callable[[int], int] | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc.malloc_trim
    except (OSError, AttributeError):
        return None


class IdleHeapTrimmer:
    def __init__(self, min_interval_s: float = 5.0, clock: Callable[[], float] = time.monotonic,
                 trim: Callable[[int], int] | None = None) -> None:
        self.min_interval_s = min_interval_s
        self._clock = clock
        self._trim = trim if trim is not None else _glibc_malloc_trim()
        self._last = clock()
        self._served_since = False
        self.num_trims = 0

    def served(self) -> None:
        """A request finished."""
        self._served_since = True

    def maybe_trim(self, num_in_flight: int) -> bool:
        """Trim if idle, something was served since the last trim and the interval has passed."""
        now = self._clock()
        if self._trim is None or num_in_flight or not self._served_since or now - self._last < self.min_interval_s:
            return False
        self._trim(0)
        self._last, self._served_since = now, False
        self.num_trims += 1
        return True
