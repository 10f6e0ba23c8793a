"""Polling helper shared by the tests that wait on Ray, Serve and Prometheus."""

from __future__ import annotations

import time


def wait_for(predicate, timeout_s: float, interval_s: float = 0.2, message: str = "condition"):
    """Poll `predicate` until it returns a truthy value (returned) or fail after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < deadline:
        last = predicate()
        if last:
            return last
        time.sleep(interval_s)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {message} (last: {last!r})")
