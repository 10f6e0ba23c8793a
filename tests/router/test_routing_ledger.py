"""The in-flight ledger (routing_ledger) on its own: reservations, confirmations, moves, completions,
expiry, and the per-replica sums the occupancy estimate reads."""

from __future__ import annotations

import asyncio
import math
from types import SimpleNamespace

from serve_app.serving.routing_ledger import InFlightLedger


def test_a_reservation_is_confirmed_in_place_or_moved_to_where_serve_sent_it():
    ledger = InFlightLedger()
    ledger.reserve("r1", "a", blocks=4, now=10.0, prompt_tokens=30, prefill_done_at=10.5)
    ledger.reserve("r2", "a", blocks=2, now=10.0)
    assert ledger.num_in_flight("a") == 2 and ledger.since("a", None) == (6, 2, 30)

    stay = ledger.confirm("r2", "a", blocks=99, now=11.0)
    assert stay.confirmed and stay.blocks == 2 and stay.routed_at == 10.0  # the reservation's estimate and time
    moved = ledger.confirm("r1", "b", blocks=99, now=12.0)
    assert (moved.replica_id, moved.blocks, moved.routed_at, moved.prefill_done_at) == ("b", 4, 12.0, 12.5)
    assert ledger.num_in_flight("a") == 1 and ledger.num_in_flight("b") == 1

    ledger.reserve("r1", "a", blocks=8, now=13.0)  # a second choice for a routed request changes nothing
    assert ledger.entries["r1"].replica_id == "b"
    unseen = ledger.confirm("r3", "a", blocks=5, now=14.0, prompt_tokens=9)  # routed without a reservation
    assert unseen.confirmed and ledger.since("a", None) == (7, 2, 9)


def test_only_a_completion_on_the_requests_replica_drops_it():
    ledger = InFlightLedger()
    ledger.confirm("r", "b", blocks=3, now=0.0)
    assert not ledger.complete("r", "a")  # a late callback of an earlier attempt elsewhere
    assert ledger.complete("r", "b") and not ledger.entries and not ledger.complete("r", "b")


def test_expiry_drops_stale_and_cancelled_choices_and_confirmed_requests_whose_completion_was_lost():
    async def main():
        cancelled = SimpleNamespace(future=asyncio.get_running_loop().create_future())
        ledger = InFlightLedger()
        ledger.reserve("fresh", "a", 1, now=95.0)
        ledger.reserve("stale", "a", 1, now=80.0)
        ledger.reserve("cancelled", "a", 1, now=99.0, pending=cancelled)
        ledger.confirm("routed", "a", 1, now=50.0)
        ledger.confirm("lost", "a", 1, now=0.0)
        assert ledger.expire(now=100.0, ttl_s=10.0) == 1  # "stale"; a cancellation not noticed yet
        cancelled.future.cancel()
        assert ledger.expire(now=100.0, ttl_s=10.0, confirmed_ttl_s=60.0) == 2  # "cancelled", "lost"
        assert set(ledger.entries) == {"fresh", "routed"} == set(ledger.by_replica["a"])

    asyncio.run(main())


def test_sums_since_a_sample_and_the_newest_requests_before_it():
    ledger = InFlightLedger()
    for i, (at, blocks, prompt) in enumerate([(1.0, 2, 10), (2.0, 3, 20), (3.0, 5, 40), (4.0, 7, 80)]):
        ledger.confirm(f"r{i}", "a", blocks, now=at, prompt_tokens=prompt)
    ledger.entries["r3"].prefill_done_at = 4.5
    assert ledger.since("a", 2.0) == (12, 2, 120)
    assert ledger.since("a", 2.0, now=5.0) == (12, 2, 40)  # r3's prompt is predicted read by then
    assert ledger.since("b", None) == (0, 0, 0)
    assert ledger.newest_before("a", 3.0, 2) == (8, 2)  # r2 and r1, the newest at or before 3.0
    assert ledger.newest_before("a", 3.0, 9) == (10, 3) and ledger.newest_before("a", 3.0, 0) == (0, 0)
    assert ledger.entries["r0"].prefill_done_at == math.inf


def test_a_replica_that_leaves_takes_its_entries():
    ledger = InFlightLedger()
    ledger.confirm("x", "a", 1, now=0.0)
    ledger.reserve("y", "b", 1, now=0.0)
    ledger.remove_replica("a")
    assert set(ledger.entries) == {"y"} and "a" not in ledger.by_replica and ledger.num_in_flight("a") == 0
