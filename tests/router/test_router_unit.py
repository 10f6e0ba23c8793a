"""KVCacheAwareRouter / RoundRobinRouter on fake replicas (no Ray cluster): ranking, staleness
fallback, in-flight accounting (no herding between two samples), Serve's routing loop, metrics."""

from __future__ import annotations

import asyncio

import pytest

from serve_app.serving.app import request_router_config
from serve_app.serving.config import ServeConfig
from serve_app.serving.router import KVCacheAwareRouter, RoundRobinRouter
from serve_app.serving.routing_config import ROUTER_CLASSES, KVRouterSettings
from serve_app.types import GenerateRequest, SamplingParams
from tests.router.fakes import BLOCK_SIZE, Clock, FakeReplica, gen_request, make_router, pending, route


def run(coro):
    return asyncio.run(coro)


def names(ranks) -> list[str]:
    assert all(len(rank) == 1 for rank in ranks), "one replica per rank: Serve keeps our order"
    return [rank[0].replica_id.unique_id for rank in ranks]


def test_settings_validation():
    with pytest.raises(ValueError, match="^bogus: not a KVCacheAwareRouter option"):
        KVRouterSettings.from_kwargs({"bogus": 1})
    with pytest.raises(ValueError, match="^tie_tolerance"):
        KVRouterSettings(tie_tolerance=-0.1)
    with pytest.raises(ValueError, match="^block_size"):
        KVRouterSettings(block_size=0)
    assert KVRouterSettings(stats_period_s=0.2).max_stats_age_s == 2.0  # auto: max(2 s, 10 periods)
    assert KVRouterSettings(stats_period_s=1.0).max_stats_age_s == 10.0
    assert KVRouterSettings(max_stats_age_s=0.7).max_stats_age_s == 0.7


# ---- ranking -----------------------------------------------------------------------------------------
def test_ranks_by_published_kv_usage():
    async def main():
        clock = Clock()
        a, b, c = FakeReplica("a"), FakeReplica("b"), FakeReplica("c")
        a.publish(used=70, total=100, at=clock.now - 0.2)
        b.publish(used=20, total=100, at=clock.now - 0.2)
        c.publish(used=45, total=100, at=clock.now - 0.2)
        router = make_router(KVCacheAwareRouter, clock, [a, b, c], seed=0)
        assert names(await router.choose_replicas([a, b, c], None)) == ["b", "c", "a"]
        assert router.num_decisions == {"kv": 1}
        # occupancy is a fraction: a bigger cache with more used blocks can still be emptier
        a.publish(used=150, total=1000, at=clock.now)
        assert names(await router.choose_replicas([a, b, c], None)) == ["a", "b", "c"]

    run(main())


def test_ties_go_to_the_shorter_waiting_queue():
    async def main():
        clock = Clock()
        a, b = FakeReplica("a"), FakeReplica("b")
        # 1 % apart (within tie_tolerance 0.02): the waiting queue decides, not the tiny usage difference
        a.publish(used=50, total=100, waiting=3, at=clock.now)
        b.publish(used=51, total=100, waiting=0, at=clock.now)
        router = make_router(KVCacheAwareRouter, clock, [a, b], waiting_weight=0.0, seed=0)
        assert names(await router.choose_replicas([a, b], None)) == ["b", "a"]
        # outside the tolerance occupancy wins whatever the queues
        b.publish(used=60, total=100, waiting=0, at=clock.now)
        assert names(await router.choose_replicas([a, b], None)) == ["a", "b"]

    run(main())


def test_waiting_queue_counts_as_demand_when_weighted():
    async def main():
        clock = Clock()
        a, b = FakeReplica("a"), FakeReplica("b")
        a.publish(used=40, total=100, waiting=6, at=clock.now)  # emptier cache, but 6 requests queued
        b.publish(used=55, total=100, waiting=0, at=clock.now)
        router = make_router(KVCacheAwareRouter, clock, [a, b], seed=0, block_size=BLOCK_SIZE)
        # teach the router the mean request size: 4 blocks (one routed request)
        chosen = await route(router, [a, b], pending(gen_request("warm", 32, 32)))
        router.on_request_completed(chosen.replica_id, "warm")
        assert router._mean_request_blocks == 4 and not router.ledger.entries
        # a: (40 + 6 × 4) / 100 = 0.64 > b: 0.55
        assert names(await router.choose_replicas([a, b], None)) == ["b", "a"]
        unweighted = make_router(KVCacheAwareRouter, clock, [a, b], seed=0, waiting_weight=0.0)
        assert names(await unweighted.choose_replicas([a, b], None)) == ["a", "b"]

    run(main())


def test_own_requests_the_sample_reports_waiting_count_with_their_size():
    """W3's first run: a long prompt routed to `b` sat in b's waiting queue (no room) when the next
    sample came; counted as an average request, b looked emptier than `a` and drew the next long one
    too. The waiting ones are this router's newest requests there: they count with their own size."""

    async def main():
        clock = Clock()
        a, b = FakeReplica("a"), FakeReplica("b")
        a.publish(used=40, total=96, at=clock.now)  # ten short requests running
        b.publish(used=32, total=96, at=clock.now)  # one long request running
        router = make_router(KVCacheAwareRouter, clock, [a, b], seed=0, block_size=BLOCK_SIZE, sample_lag_s=0.5)
        for i in range(6):  # the router has sized a few short requests (4 blocks each)
            done = await route(router, [a, b], pending(gen_request(f"s{i}", 48, 16)))
            router.on_request_completed(done.replica_id, f"s{i}")
        clock.now += 1.0
        a.publish(used=40, total=96, at=clock.now)
        b.publish(used=32, total=96, at=clock.now)
        long1 = await route(router, [a, b], pending(gen_request("long1", 384, 128)))  # 32 blocks
        assert long1.name == "b"
        # a new sample, 2 s later: long1 has not been admitted (b's cache is short of room), it waits
        clock.now += 2.0
        a.publish(used=40, total=96, at=clock.now)
        b.publish(used=32, total=96, waiting=1, at=clock.now)
        view = router._view(b, clock.now)
        assert view.pending_blocks == 0 and view.waiting_blocks == 32
        assert view.occupancy == pytest.approx(64 / 96)
        assert (await route(router, [a, b], pending(gen_request("long2", 384, 128)))).name == "a"
        # a waiting request the router did not send (another ingress's) counts as the mean size
        b.publish(used=32, total=96, waiting=2, at=clock.now)
        assert router._view(b, clock.now).waiting_blocks == pytest.approx(32 + router._mean_request_blocks)

    run(main())


# ---- staleness ---------------------------------------------------------------------------------------
def test_missing_or_stale_stats_fall_back_to_least_in_flight():
    async def main():
        clock = Clock()
        a, b = FakeReplica("a"), FakeReplica("b")
        b.publish(used=10, total=100, at=clock.now)  # b looks empty, a has no sample yet
        router = make_router(KVCacheAwareRouter, clock, [a, b], seed=0, max_stats_age_s=2.0)
        # the router's own in-flight counts decide: b has 2 of its requests, a none
        for i in range(2):
            pr = pending(gen_request(f"b{i}", 16, 16))
            await router.choose_replicas([a, b], pr)
            router.on_request_routed(pr, b.replica_id, None)
        assert names(await router.choose_replicas([a, b], None)) == ["a", "b"]
        assert router.num_decisions["fallback"] == 3
        # both fresh: occupancy again (a is fuller than b even counting b's 2 requests)
        a.publish(used=80, total=100, at=clock.now)
        assert names(await router.choose_replicas([a, b], None)) == ["b", "a"]
        # a's sample ages past max_stats_age_s → fallback, a has no requests in flight → a first
        clock.now += 2.5
        b.publish(used=12, total=100, at=clock.now)
        assert names(await router.choose_replicas([a, b], None)) == ["a", "b"]
        assert router.last_ranking[0].stats_age_s == pytest.approx(2.5)
        # an empty dict (Serve's value before its first poll) is "no sample"
        a.routing_stats = {}
        assert names(await router.choose_replicas([a, b], None)) == ["a", "b"]

    run(main())


def test_samples_without_timestamp_age_from_when_the_router_saw_them():
    async def main():
        clock = Clock()
        a, b = FakeReplica("a"), FakeReplica("b")
        a.publish(used=90, total=100, at=None)
        b.publish(used=10, total=100, at=None)
        router = make_router(KVCacheAwareRouter, clock, [a, b], seed=0, max_stats_age_s=2.0)
        assert names(await router.choose_replicas([a, b], None)) == ["b", "a"]
        clock.now += 3.0  # nothing new arrived: both samples are stale now
        pr = pending(gen_request("x", 16, 16))
        await router.choose_replicas([a, b], pr)
        router.on_request_routed(pr, b.replica_id, None)
        assert router.last_ranking and router.num_decisions["fallback"] == 1
        assert names(await router.choose_replicas([a, b], None)) == ["a", "b"]  # least in flight
        a.publish(used=90, total=100, waiting=1, at=None)  # a changed dict = a new sample
        b.publish(used=11, total=100, at=None)
        assert names(await router.choose_replicas([a, b], None)) == ["b", "a"]

    run(main())


# ---- in-flight accounting: no herding between samples --------------------------------------------------
def _skewed_pair(clock: Clock) -> tuple[FakeReplica, FakeReplica]:
    a, b = FakeReplica("a"), FakeReplica("b")
    a.publish(used=160, total=400, at=clock.now - 0.3)  # 240 free blocks
    b.publish(used=280, total=400, at=clock.now - 0.3)  # 120 free blocks
    return a, b


def test_20_requests_between_two_samples_spread_in_proportion_to_free_capacity():
    """20 requests of 18 blocks = 360 blocks = all the free room (240 + 120): a share in proportion to
    free capacity is 2:1 (13.3 : 6.7). Without in-flight accounting every one goes to `a`. (KV alone:
    the prefill term, tested below, would also weigh the prompts routed since the sample.)"""

    async def main():
        clock = Clock()
        a, b = _skewed_pair(clock)
        router = make_router(KVCacheAwareRouter, clock, [a, b], seed=0, block_size=BLOCK_SIZE, prefill_weight=0.0)
        counts = {"a": 0, "b": 0}
        for i in range(20):
            clock.now += 0.01  # 20 requests in 0.2 s, no new sample
            chosen = await route(router, [a, b], pending(gen_request(f"r{i}", 144, 144)))  # 9 + 9 blocks
            counts[chosen.name] += 1
        assert counts["a"] + counts["b"] == 20
        assert abs(counts["a"] - 20 * 240 / 360) <= 1.5, counts
        views = {v.replica_id: v for v in router.last_ranking}
        # predicted occupancy ends level (within one request) and no replica is predicted over-full
        assert abs(views["a"].occupancy - views["b"].occupancy) <= 18 / 400 + 1e-9
        assert views["a"].pending_blocks == 18 * counts["a"] and views["a"].pending_requests == counts["a"]

        # the same decisions without accounting (a router that forgets what it sent) herd onto `a`
        herd = {"a": 0, "b": 0}
        for i in range(20):
            forgetful = make_router(KVCacheAwareRouter, clock, [a, b], seed=i, block_size=BLOCK_SIZE, prefill_weight=0.0)
            herd[(await route(forgetful, [a, b], pending(gen_request(f"h{i}", 144, 144)))).name] += 1
        assert herd == {"a": 20, "b": 0}

        # default weights (prompts also count as prefill backlog, equally on both): still spread, still
        # more to the emptier replica
        default = make_router(KVCacheAwareRouter, clock, [a, b], seed=0, block_size=BLOCK_SIZE)
        spread = {"a": 0, "b": 0}
        for i in range(20):
            clock.now += 0.01
            spread[(await route(default, [a, b], pending(gen_request(f"d{i}", 144, 144)))).name] += 1
        assert 10 < spread["a"] < 16, spread

    run(main())


def test_concurrent_choices_see_each_other_before_serve_confirms():
    """Serve calls on_request_routed only after the replica accepted (a round trip later): choices
    made in the meantime must already count, or a burst herds."""

    async def main():
        clock = Clock()
        a, b = FakeReplica("a"), FakeReplica("b")
        a.publish(used=0, total=100, at=clock.now)
        b.publish(used=0, total=100, at=clock.now)
        router = make_router(KVCacheAwareRouter, clock, [a, b], seed=0, block_size=BLOCK_SIZE)
        firsts = []
        for i in range(10):  # ten decisions, none confirmed yet
            ranks = await router.choose_replicas([a, b], pending(gen_request(f"c{i}", 64, 16)))
            firsts.append(ranks[0][0].name)
        assert firsts.count("a") == 5 and firsts.count("b") == 5

    run(main())


def test_a_new_sample_replaces_the_requests_it_includes():
    async def main():
        clock = Clock()
        t0 = clock.now
        a, b = FakeReplica("a"), FakeReplica("b")
        a.publish(used=0, total=200, at=t0)
        b.publish(used=100, total=200, at=t0)
        router = make_router(KVCacheAwareRouter, clock, [a, b], seed=0, block_size=BLOCK_SIZE, sample_lag_s=0.1)

        def a_view():
            return router._view(a, clock.now)

        for i in range(4):  # routed at t0 + 0.01 ... t0 + 0.04, 10 blocks each
            clock.now = t0 + 0.01 * (i + 1)
            assert (await route(router, [a, b], pending(gen_request(f"r{i}", 64, 96)))).name == "a"
        assert a_view().pending_blocks == 40 and a_view().occupancy == pytest.approx(40 / 200)
        # a sample taken at t0 + 0.125 may miss what was routed in the 0.1 s before it (transit,
        # admission): the requests routed at +0.03 and +0.04 still count on top of it
        clock.now = t0 + 0.2
        a.publish(used=20, total=200, at=t0 + 0.125)
        assert (a_view().pending_blocks, a_view().pending_requests) == (20, 2)
        assert a_view().occupancy == pytest.approx((20 + 20) / 200)
        # a sample 1 s later includes all four: only the sample counts, the requests stay in flight
        clock.now = t0 + 1.2
        a.publish(used=48, total=200, at=t0 + 1.0)
        assert a_view().pending_blocks == 0 and a_view().num_in_flight == 4
        assert a_view().occupancy == pytest.approx(48 / 200)
        # a request routed after that sample counts again
        clock.now = t0 + 1.3
        await route(router, [a, b], pending(gen_request("r4", 64, 96)))
        assert a_view().pending_blocks == 10

    run(main())


def test_requests_in_flight_count_at_their_final_size():
    """Three long generations admitted long ago hold their prompts' blocks (72 of 96) in the sample but
    will grow to 96: the replica is full, whatever the sample says. `b` holds more blocks now (80),
    but its ten short requests will not grow past them, so the next long request goes to `b`."""

    async def main():
        clock = Clock()
        a, b = FakeReplica("a"), FakeReplica("b")
        a.publish(used=0, total=96, at=clock.now)
        b.publish(used=0, total=96, at=clock.now)
        router = make_router(KVCacheAwareRouter, clock, [a, b], seed=0, block_size=BLOCK_SIZE, prefill_weight=0.0)
        for i in range(3):  # 384 + 128 tokens = 32 blocks each, at the end
            router.ledger.confirm(f"long{i}", "a", 32, clock.now)
        for i in range(10):  # 48 + 16 tokens = 4 blocks each
            router.ledger.confirm(f"short{i}", "b", 4, clock.now)
        clock.now += 5.0  # long past the sample lag: every one is in the new samples
        a.publish(used=72, total=96, running=3, at=clock.now)
        b.publish(used=80, total=96, running=10, at=clock.now)
        chosen = await route(router, [a, b], pending(gen_request("long3", 384, 128)))
        views = {v.replica_id: v for v in router.last_ranking}
        assert views["a"].occupancy == pytest.approx(96 / 96) and views["b"].occupancy == pytest.approx(80 / 96)
        assert chosen.name == "b"

    run(main())


def test_ledger_follows_serve_hooks():
    async def main():
        clock = Clock()
        a, b = FakeReplica("a"), FakeReplica("b")
        a.publish(used=0, total=100, at=clock.now)
        b.publish(used=50, total=100, at=clock.now)
        router = make_router(KVCacheAwareRouter, clock, [a, b], seed=0, block_size=BLOCK_SIZE, reservation_ttl_s=5.0)
        ledger = router.ledger

        # chosen, then rejected by the replica: Serve fires only on_request_completed
        pr = pending(gen_request("rej", 32, 32))
        await router.choose_replicas([a, b], pr)
        assert ledger.num_in_flight("a") == 1
        router.on_request_completed(a.replica_id, "rej")
        assert ledger.num_in_flight("a") == 0 and not ledger.entries

        # chosen `a`, but Serve sent it to `b` (a was full): the entry moves
        pr = pending(gen_request("moved", 32, 32))
        await router.choose_replicas([a, b], pr)
        router.on_request_routed(pr, b.replica_id, None)
        assert ledger.num_in_flight("a") == 0 and ledger.num_in_flight("b") == 1
        # a late completion callback for another replica does not drop it; the right one does
        router.on_request_completed(a.replica_id, "moved")
        assert ledger.num_in_flight("b") == 1
        router.on_request_completed(b.replica_id, "moved")
        assert not ledger.entries

        # the caller gave up while the request was being routed: no hook fires, the next decision drops it
        pr = pending(gen_request("cancelled", 32, 32))
        await router.choose_replicas([a, b], pr)
        pr.future.cancel()
        await router.choose_replicas([a, b], None)
        assert not ledger.entries

        # a choice Serve never followed up expires after reservation_ttl_s
        await router.choose_replicas([a, b], pending(gen_request("lost", 32, 32)))
        clock.now += 6.0
        a.publish(used=0, total=100, at=clock.now)
        b.publish(used=50, total=100, at=clock.now)
        await router.choose_replicas([a, b], None)
        assert not ledger.entries

        # calls that are not generations (model_info, check_health) count in flight but hold no blocks
        pr = pending(None, internal_id="info", method="model_info")
        await route(router, [a, b], pr)
        assert ledger.entries["info"].blocks == 0 and ledger.since("a", None) == (0, 1, 0)

        # a replica that goes away takes its entries with it
        router.update_replicas([b])
        assert ledger.num_in_flight("a") == 0 and "a" not in ledger.by_replica

    run(main())


def test_choose_replicas_never_awaits():
    """`choose_replicas` completes on its first step: it never waits on I/O or locks."""

    async def main():
        clock = Clock()
        replicas = [FakeReplica(f"r{i}") for i in range(4)]
        for i, r in enumerate(replicas):
            r.publish(used=10 * i, total=100, at=clock.now)
        router = make_router(KVCacheAwareRouter, clock, replicas, seed=0)
        coro = router.choose_replicas(replicas, pending(gen_request("x", 16, 16)))
        with pytest.raises(StopIteration) as done:
            coro.send(None)
        assert names(done.value.value) == ["r0", "r1", "r2", "r3"]
        assert all(r.num_probes <= 1 for r in replicas)  # only Serve's own probe of new replicas

    run(main())


# ---- inside Serve's routing loop ----------------------------------------------------------------------
def test_serve_routing_loop_takes_our_order_and_skips_full_replicas():
    async def main():
        clock = Clock()
        a, b, c = FakeReplica("a", max_ongoing_requests=4), FakeReplica("b", max_ongoing_requests=4), FakeReplica("c")
        a.publish(used=10, total=100, at=clock.now)
        b.publish(used=30, total=100, at=clock.now)
        c.publish(used=60, total=100, at=clock.now)
        router = make_router(KVCacheAwareRouter, clock, [a, b, c], seed=0)
        pr = pending(gen_request("x", 32, 32))
        chosen = await asyncio.wait_for(router._choose_replica_for_request(pr), 5)
        assert chosen is a
        a.queue_len = 4  # a is at max_ongoing_requests: Serve's probe skips it, our second choice wins
        pr = pending(gen_request("y", 32, 32))
        chosen = await asyncio.wait_for(router._choose_replica_for_request(pr), 5)
        assert chosen is b
        # both reservations are in the ledger (x on a, y on b) before Serve confirms either
        assert set(router.ledger.entries) == {"x", "y"}

    run(main())


def test_calls_sharing_an_internal_request_id_are_all_routed():
    """Handle calls made while serving one HTTP request share Serve's internal request id (n > 1,
    prompt batches): every one of them must get a replica (FIFO fallback), none may hang."""

    async def main():
        clock = Clock()
        a, b = FakeReplica("a"), FakeReplica("b")
        a.publish(used=0, total=100, at=clock.now)
        b.publish(used=10, total=100, at=clock.now)
        for cls in (KVCacheAwareRouter, RoundRobinRouter):
            router = make_router(cls, clock, [a, b], **({"seed": 0} if cls is KVCacheAwareRouter else {}))
            calls = [pending(gen_request(f"choice-{j}", 32, 16), internal_id="same-http-request") for j in range(3)]
            chosen = await asyncio.wait_for(asyncio.gather(*(router._choose_replica_for_request(pr) for pr in calls)), 10)
            assert len(chosen) == 3 and all(r in (a, b) for r in chosen), cls.__name__

    run(main())


# ---- metrics ------------------------------------------------------------------------------------------
def test_routed_counts_and_stats_age_are_exported():
    async def main():
        clock = Clock()
        a, b = FakeReplica("a"), FakeReplica("b")
        a.publish(used=0, total=100, at=clock.now - 0.4)
        b.publish(used=90, total=100, at=clock.now - 1.5)
        router = make_router(KVCacheAwareRouter, clock, [a, b], seed=0, model_name="m")
        for i in range(3):
            await route(router, [a, b], pending(gen_request(f"r{i}", 16, 16)))
        registry = router.metrics.registry

        def value(name, replica):
            return registry.get_sample_value(name, {"model": "m", "target_replica": replica})

        assert value("llm_router_routed_requests_total", "a") == 3
        assert value("llm_router_routed_requests_total", "b") == 0  # exists from the start
        assert value("llm_router_stats_age_seconds", "a") == pytest.approx(0.4)
        assert router.num_routed == {"a": 3}

    run(main())


# ---- round robin ---------------------------------------------------------------------------------------
def test_round_robin_rotates_and_passes_a_full_turn_on():
    async def main():
        clock = Clock()
        replicas = [FakeReplica("c"), FakeReplica("a"), FakeReplica("b")]
        router = make_router(RoundRobinRouter, clock, replicas, model_name="m")
        firsts = [names(await router.choose_replicas(replicas, None))[0] for _ in range(6)]
        assert firsts == ["a", "b", "c", "a", "b", "c"]
        assert names(await router.choose_replicas(replicas, None)) == ["a", "b", "c"]
        # 7 turns taken: the next one is b's; b is full (max_ongoing_requests), so c gets it
        replicas[2].queue_len = replicas[2].max_ongoing_requests
        chosen = await asyncio.wait_for(router._choose_replica_for_request(pending(gen_request("x", 8, 8))), 5)
        assert chosen.name == "c"
        router.on_request_routed(pending(gen_request("z", 8, 8)), chosen.replica_id, None)
        assert router.metrics.registry.get_sample_value("llm_router_routed_requests_total",
                                                        {"model": "m", "target_replica": "c"}) == 1

    run(main())


# ---- configuration ------------------------------------------------------------------------------------
def test_router_selection_by_config():
    model = "models/whatever"
    kv = request_router_config(ServeConfig(model=model, router="kv_aware", router_kwargs={"waiting_weight": 0.5}))
    assert kv.request_router_class == ROUTER_CLASSES["kv_aware"]
    # the settings are complete and validated with the config: the router rebuilds the same object from them
    assert KVRouterSettings.from_kwargs(kv.request_router_kwargs) == KVRouterSettings(
        model_name="whatever", block_size=16, stats_period_s=0.5, confirmed_ttl_s=660.0, waiting_weight=0.5)
    # the default: the prefix-aware router, with the engine's step budget
    prefix = request_router_config(ServeConfig(model=model))
    assert prefix.request_router_class == ROUTER_CLASSES["prefix_aware"]
    assert prefix.request_router_kwargs["step_token_budget"] == 2048
    assert kv.request_routing_stats_period_s == 0.5
    rr = request_router_config(ServeConfig(model=model, router="round_robin"))
    assert rr.request_router_class == ROUTER_CLASSES["round_robin"] and rr.request_router_kwargs == {"model_name": "whatever"}
    pow2 = request_router_config(ServeConfig(model=model, router="pow2", request_routing_stats_period_s=0.2))
    assert pow2.request_router_class == ROUTER_CLASSES["pow2"] and pow2.request_router_kwargs == {}
    assert pow2.get_request_router_class().__name__ == "PowerOfTwoChoicesRequestRouter"
    # an import path overrides `router`; our KV router still gets its kwargs
    custom = request_router_config(ServeConfig(model=model, router="pow2",
                                               request_router_class="serve_app.serving.router.KVCacheAwareRouter"))
    assert custom.request_router_kwargs["model_name"] == "whatever"
    assert custom.get_request_router_class() is KVCacheAwareRouter
    for bad in ({"router": "random"}, {"router": "pow2", "router_kwargs": {"tie_tolerance": 0.1}},
                {"router_kwargs": {"nope": 1}}, {"router_kwargs": {"output_weight": -1}}, {"max_replicas_per_node": -1}):
        with pytest.raises(ValueError):
            ServeConfig(model=model, **bad)
    settings = KVRouterSettings.from_kwargs(kv.request_router_kwargs)  # what initialize_state builds
    assert settings.block_size == 16 and settings.waiting_weight == 0.5 and settings.max_stats_age_s == 5.0
    with pytest.raises(ValueError):
        GenerateRequest("r", prompt="x", sampling_params=SamplingParams(max_tokens=0))


def test_prefill_backlog_steers_requests_away_from_a_replica_reading_a_long_prompt():
    """Equal KV room, but `a` still has a 384-token prompt to read: a short request sent there waits for
    that prefill. The default weights send it to `b`; KV alone (prefill_weight 0) prefers `a`, whose
    cache is a little emptier. Prompts routed since the sample count too."""

    async def main():
        clock = Clock()
        a, b = FakeReplica("a"), FakeReplica("b")
        a.publish(used=28, total=96, running=1, unread=384, at=clock.now)
        b.publish(used=32, total=96, running=8, at=clock.now)
        router = make_router(KVCacheAwareRouter, clock, [a, b], seed=0, block_size=BLOCK_SIZE)
        assert (await route(router, [a, b], pending(gen_request("s0", 48, 16)))).name == "b"
        view = {v.replica_id: v for v in router.last_ranking}
        assert view["a"].prefill_backlog == 384 and view["b"].prefill_backlog == 0  # at the decision
        assert router._view(b, clock.now).prefill_backlog == 48  # s0, sent since the sample
        assert view["a"].score == pytest.approx(28 / 96 + 384 / (96 * BLOCK_SIZE))
        kv_only = make_router(KVCacheAwareRouter, clock, [a, b], seed=0, block_size=BLOCK_SIZE, prefill_weight=0.0)
        assert (await route(kv_only, [a, b], pending(gen_request("s1", 48, 16)))).name == "a"
        # once `a` has read it (a new sample), `a` is the emptier one again
        clock.now += 0.5
        a.publish(used=28, total=96, running=1, at=clock.now)
        b.publish(used=32, total=96, running=8, at=clock.now)
        assert (await route(router, [a, b], pending(gen_request("s2", 48, 16)))).name == "a"

    run(main())
