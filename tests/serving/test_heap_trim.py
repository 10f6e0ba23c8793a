"""IdleHeapTrimmer: trims only when idle, after serving, at most once per interval."""

from __future__ import annotations

from serve_app.serving.heap_trim import IdleHeapTrimmer


def test_trims_only_when_idle_after_serving_and_not_too_often():
    now = [0.0]
    calls: list[int] = []
    trimmer = IdleHeapTrimmer(min_interval_s=10.0, clock=lambda: now[0], trim=lambda pad: calls.append(pad) or 1)
    now[0] = 20.0
    assert not trimmer.maybe_trim(0)  # nothing served yet
    trimmer.served()
    assert not trimmer.maybe_trim(3)  # requests in flight
    assert trimmer.maybe_trim(0) and calls == [0]
    trimmer.served()
    now[0] = 25.0
    assert not trimmer.maybe_trim(0)  # within the interval
    now[0] = 31.0
    assert trimmer.maybe_trim(0) and trimmer.num_trims == 2


def test_the_real_allocator_call_is_found_on_this_platform():
    trimmer = IdleHeapTrimmer(min_interval_s=0.0)
    trimmer.served()
    assert trimmer.maybe_trim(0)  # glibc (Linux CI): malloc_trim ran
