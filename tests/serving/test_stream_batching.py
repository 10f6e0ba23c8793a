"""Stream batching (serve_app/serving/stream_batching.py): the latency bound and the driver.

The bound: batching adds at most the interval to any token's latency (so to inter-token latency),
the first delta and the finish go at once. Checked on the policy with a simulated clock over random
arrival patterns, and on the async driver with bounded waits (a stalled engine does not hold a
pending delta back).
"""

from __future__ import annotations

import asyncio
import contextlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from serve_app.serving.stream_batching import StreamBatcher, batch_stream
from serve_app.types import FinishReason, RequestMetrics, RequestOutput


def out(token: int, finished: bool = False) -> RequestOutput:
    return RequestOutput("r", f"<{token}>", (token,), finished, FinishReason.LENGTH if finished else None, 5,
                         RequestMetrics(arrival_time=0.0))


def simulate(interval_s: float, gaps: list[float]) -> tuple[dict[int, float], dict[int, float], int]:
    """Drive the policy as `batch_stream` does: time moves to the next arrival or the next deadline."""
    batcher = StreamBatcher(interval_s)
    arrivals: dict[int, float] = {}
    sent: dict[int, float] = {}
    num_items = 0
    now, i = 0.0, 0
    while i < len(gaps) or batcher.pending:
        next_arrival = now + gaps[i] if i < len(gaps) else float("inf")
        deadline = batcher.deadline()
        if deadline is not None and deadline < next_arrival:  # a delta arriving at the deadline joins the item
            now = max(now, deadline)
            chunk = batcher.take(now)
            num_items += 1
            for token in chunk.token_ids:
                sent[token] = now
            continue
        now = next_arrival
        arrivals[i] = now
        batcher.add(out(i, finished=i == len(gaps) - 1))
        i += 1
    return arrivals, sent, num_items


@settings(max_examples=300, deadline=None)
@given(interval_s=st.sampled_from([0.01, 0.05, 0.2]),
       gaps=st.lists(st.floats(min_value=0.0, max_value=0.3, allow_nan=False), min_size=1, max_size=60))
def test_batching_adds_at_most_the_interval_to_any_token(interval_s, gaps):
    arrivals, sent, num_items = simulate(interval_s, gaps)
    assert sent.keys() == arrivals.keys()  # every token is sent, once
    for token, arrived in arrivals.items():
        assert arrived <= sent[token] <= arrived + interval_s + 1e-12
    assert sent[0] == arrivals[0]  # the first token at once (TTFT untouched)
    assert sent[len(gaps) - 1] == arrivals[len(gaps) - 1]  # the finish at once
    # items are at least `interval_s` apart, except the first, the finish and the one right after the first
    assert num_items <= 3 + (arrivals[len(gaps) - 1] - arrivals[0]) / interval_s


def test_fast_deltas_merge_into_one_item_per_interval():
    step, interval = 2**-7, 2**-4  # ~8 ms engine steps, ~62 ms batches (exact in binary: no rounding drift)
    arrivals, sent, num_items = simulate(interval, [step] * 100)
    assert num_items == 2 + 99 // 8  # the first, then 8 deltas per item, the finish with the rest
    assert max(sent[t] - arrivals[t] for t in arrivals) <= interval


def run(coro):
    return asyncio.run(coro)


def test_a_stalled_engine_does_not_hold_a_pending_delta_back():
    async def main():
        got_first, release = asyncio.Event(), asyncio.Event()
        closed = []

        async def backend():
            try:
                yield out(0)
                await got_first.wait()
                yield out(1)  # pending: no further delta until `release`
                await release.wait()
                yield out(2, finished=True)
            finally:
                closed.append(True)

        stream = batch_stream(backend(), 0.05)
        first = await stream.__anext__()
        got_first.set()
        second = await asyncio.wait_for(stream.__anext__(), timeout=30)  # flushed by the timer, engine still stalled
        assert not release.is_set()
        release.set()
        rest = [c async for c in stream]
        return first, second, rest, closed

    first, second, rest, closed = run(main())
    assert (first.token_ids, second.token_ids) == ((0,), (1,))
    assert [c.token_ids for c in rest] == [(2,)] and rest[-1].finished and rest[-1].finish_reason == "length"
    assert closed == [True]


def test_errors_surface_and_leaving_early_closes_the_backend():
    async def bad():
        raise ValueError("prompt: must not be empty")
        yield  # pragma: no cover

    async def first_error():
        return [c async for c in batch_stream(bad(), 0.05)]

    with pytest.raises(ValueError, match="^prompt:"):
        run(first_error())

    closed = []

    async def endless():
        try:
            i = 0
            while True:
                await asyncio.sleep(0.001)
                i += 1
                yield out(i)
        finally:
            closed.append(True)

    async def leave_early():
        stream = batch_stream(endless(), 0.05)
        async with contextlib.aclosing(stream):
            await stream.__anext__()
            await stream.__anext__()

    run(leave_early())
    assert closed == [True]  # the backend stream is closed: the request is aborted
