"""`ExpiringMap` (serve_app/serving/expiring_map.py), the router's store of outstanding predictions and
choices: entries go a TTL after they were (last) set, removed entries never come back, one call looks
at a bounded number of records, and the queue stays proportional to the live entries however many
are set and removed. The per-decision cost is measured by loadtest/bench_router_expiry.py."""

from __future__ import annotations

import asyncio

from serve_app.serving.expiring_map import ExpiringMap
from serve_app.serving.prefix_router import EXPIRE_PER_DECISION, PrefixAwareRouter
from tests.router.fakes import Clock, FakeReplica, make_router


def test_entries_expire_a_ttl_after_their_last_set():
    m: ExpiringMap[str, int] = ExpiringMap(ttl_s=10.0)
    m.set("a", 1, now=0.0)
    m.set("b", 2, now=5.0)
    m.set("a", 3, now=8.0)  # set again: a new deadline
    assert m.expire(now=10.5) == 0
    assert m.expire(now=15.5) == 1 and "b" not in m and m["a"] == 3
    assert m.pop("a") == 3 and m.pop("a", "gone") == "gone"
    assert m.expire(now=100.0) == 0 and len(m) == 0


def test_one_call_looks_at_a_bounded_number_of_records():
    m: ExpiringMap[int, None] = ExpiringMap(ttl_s=1.0)
    for i in range(1000):
        m.set(i, None, now=0.0)
    assert m.expire(now=5.0, max_records=300) == 300
    assert len(m) == 700
    while m.expire(now=5.0, max_records=300):
        pass
    assert len(m) == 0


def test_the_queue_stays_proportional_to_live_entries():
    """A million requests matched (popped) soon after being set: the queue is compacted, not grown."""
    m: ExpiringMap[int, None] = ExpiringMap(ttl_s=1e9)
    for i in range(1_000_000):
        m.set(i, None, now=float(i))
        if i >= 10:
            m.pop(i - 10)
    assert len(m) == 10
    assert len(m._queue) <= 2 * len(m) + 1025


def test_a_clock_step_backwards_keeps_expiry_ordered():
    m: ExpiringMap[str, int] = ExpiringMap(ttl_s=10.0)
    m.set("late", 1, now=100.0)
    m.set("early", 2, now=50.0)  # the clock went back: expires no sooner than "late"
    assert m.expire(now=105.0) == 0
    assert m.expire(now=111.0) == 2


def test_the_router_forgets_unreported_predictions_without_scanning():
    """Predictions whose report never comes leave once their TTL passed, a bounded share per decision,
    while fresh ones stay."""

    async def main():
        clock = Clock(1_000.0)
        router = make_router(PrefixAwareRouter, clock, [FakeReplica("r0")], confirmed_ttl_s=100.0)
        for i in range(2 * EXPIRE_PER_DECISION):
            router.predictions.set(f"old-{i}", (1, "exact", clock.now), clock.now)
        clock.now += 50.0
        router.predictions.set("fresh", (1, "exact", clock.now), clock.now)
        clock.now += 60.0
        router._expire_predictions(clock.now)
        assert len(router.predictions) == EXPIRE_PER_DECISION + 1
        router._expire_predictions(clock.now)
        return list(router.predictions)

    assert asyncio.run(main()) == ["fresh"]
