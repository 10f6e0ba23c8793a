"""PrefixAwareRouter on constructed states (fake replicas publishing real cache events, no Ray
cluster): cache hits, hot-prefix spill, the no-room constraint, evictions, lost deltas and resync,
prefixes routed since the last sample, the `user` tie-break, ledger expiry, predicted vs actual."""

from __future__ import annotations

import asyncio

import pytest

from serve_app.block_hash import prefix_block_hashes, prompt_block_keys
from serve_app.engine.kv_events import KVCachePublisher, KVEventLog
from serve_app.serving.pending_prefixes import PendingPrefixes
from serve_app.serving.prefix_router import PrefixAwareRouter
from serve_app.serving.router import KVCacheAwareRouter
from serve_app.types import GenerateRequest, SamplingParams
from tests.router.fakes import BLOCK_SIZE, Clock, FakeReplica, make_router, pending, route

PREFIX = list(range(1000, 1064))  # 4 full blocks
COST = {"step_fixed_s": 0.01, "prefill_s_per_token": 0.001, "decode_s_per_token": 0.002}


def run(coro):
    return asyncio.run(coro)


class Engine:
    """A replica's cache as its engine would publish it (real event log + publisher)."""

    def __init__(self, replica: FakeReplica, window_polls: int = 4, snapshot_every: int = 1000) -> None:
        self.replica = replica
        self.log = KVEventLog()
        self.publisher = KVCachePublisher(self.log, BLOCK_SIZE, window_polls, snapshot_every, small_snapshot_keys=0)

    def cache(self, token_ids: list[int], salt: bytes | None = None) -> None:
        for h in prefix_block_hashes(token_ids, BLOCK_SIZE, salt):
            self.log.stored(h)

    def evict(self, token_ids: list[int]) -> None:
        for h in prefix_block_hashes(token_ids, BLOCK_SIZE):
            self.log.removed(h)

    def publish(self, clock: Clock, *, used: int = 0, total: int = 100, unread: int = 0, running: int = 0,
                waiting: int = 0, deliver: bool = True) -> dict:
        update = self.publisher.next_update()
        if deliver:
            self.replica.publish(used=used, total=total, waiting=waiting, running=running, unread=unread, at=clock.now)
            self.replica.routing_stats.update(update, **COST)
        return update


def ask(request_id: str, question: int, prefix: list[int] = PREFIX, user: str | None = None, salt: str | None = None,
        max_tokens: int = 8) -> GenerateRequest:
    ids = tuple(prefix + [question] * 8)
    return GenerateRequest(request_id, prompt=list(ids), prompt_token_ids=ids, user=user, cache_salt=salt,
                           sampling_params=SamplingParams(max_tokens=max_tokens, temperature=0.0))


def setup(clock: Clock, **kwargs):
    a, b = FakeReplica("a"), FakeReplica("b")
    ea, eb = Engine(a), Engine(b)
    router = make_router(PrefixAwareRouter, clock, [a, b], seed=0, block_size=BLOCK_SIZE, **kwargs)
    return router, a, b, ea, eb


def test_a_cached_prefix_attracts_its_group_and_predicts_the_hit():
    async def main():
        clock = Clock()
        router, a, b, ea, eb = setup(clock)
        eb.cache(PREFIX)
        ea.publish(clock)
        eb.publish(clock)
        chosen = await route(router, [a, b], pending(ask("q1", 1)))
        assert chosen is b and router.num_decisions == {"cache_hit": 1}
        assert router.predictions["q1"][:2] == (64, "exact")  # 4 blocks of the 72-token prompt
        # the engine reports what it found: the error is recorded (and exported)
        eb.log.request_finished("q1", 64, 72)
        eb.publish(clock)
        await router.choose_replicas([a, b], None)
        assert router.matched_predictions == {"q1": (64, 64, 72)} and "q1" not in router.predictions
        registry = router.metrics.registry
        assert registry.get_sample_value("llm_router_cached_tokens_abs_error_count", {"model": "unknown", "source": "exact", "target_replica": "b"}) == 1
        assert registry.get_sample_value("llm_router_decisions_total", {"model": "unknown", "reason": "cache_hit", "target_replica": "b"}) == 1

    run(main())


def test_hot_prefix_spills_when_the_warm_replica_queue_costs_more_than_reading_it_again():
    async def main():
        clock = Clock()
        router, a, b, ea, eb = setup(clock)
        ea.cache(PREFIX)
        # a little queued on the warm replica: staying there is still faster
        ea.publish(clock, unread=40)
        eb.publish(clock)
        assert (await route(router, [a, b], pending(ask("q1", 1)))) is a
        # saturated: 400 prompt tokens queued on `a` cost more than `b` reading 72 tokens cold
        ea.publish(clock, unread=400, running=8)
        eb.publish(clock)
        assert (await route(router, [a, b], pending(ask("q2", 2)))) is b
        assert router.num_decisions["spill"] == 1
        ttft = {c.view.replica_id: c.ttft_s for c in router.last_candidates}
        assert ttft["b"] < ttft["a"]
        # the next request of the group now finds the prefix on both; the cheaper one wins
        assert router.recent.matched_blocks("b", router._request_keys(ask("q3", 3))) == 4

    run(main())


def test_no_room_constraint_beats_a_cache_hit_but_not_when_nobody_has_room():
    async def main():
        clock = Clock()
        router, a, b, ea, eb = setup(clock)
        ea.cache(PREFIX)
        ea.publish(clock, used=99)  # the hit would need blocks a does not have: preemption
        eb.publish(clock, used=10)
        big = ask("q1", 1, max_tokens=160)  # 72 + 160 tokens ≈ 15 blocks, 11 of them new on `a`
        assert (await route(router, [a, b], pending(big))) is b
        candidates = {c.view.replica_id: c for c in router.last_candidates}
        assert not candidates["a"].has_room and candidates["b"].has_room and candidates["a"].ttft_s < candidates["b"].ttft_s
        ea.publish(clock, used=99)
        eb.publish(clock, used=99)  # nobody has room: the cost decides
        assert (await route(router, [a, b], pending(ask("q2", 2, max_tokens=160)))) is a

    run(main())


def test_after_an_eviction_the_prefix_stops_attracting():
    async def main():
        clock = Clock()
        router, a, b, ea, eb = setup(clock)
        ea.cache(PREFIX)
        ea.publish(clock, used=30)
        eb.publish(clock, used=10)
        assert (await route(router, [a, b], pending(ask("q1", 1)))) is a
        router.on_request_completed(a.replica_id, "q1")
        ea.evict(PREFIX)
        clock.now += 5  # later samples: the routed-since entry is covered by them
        ea.publish(clock, used=30)
        eb.publish(clock, used=10)
        ranks = await router.choose_replicas([a, b], pending(ask("q2", 2)))
        assert router.index.num_cached_blocks("a", router._request_keys(ask("x", 0))) == 0
        assert router.last_candidates[0].cached_tokens == 0 and router.num_decisions["load"] == 1
        assert {r[0].replica_id.unique_id for r in ranks} == {"a", "b"}

    run(main())


def test_lost_deltas_resync_from_the_next_snapshot():
    async def main():
        clock = Clock()
        router, a, b, ea, eb = setup(clock)
        ea.publisher = KVCachePublisher(ea.log, BLOCK_SIZE, window_polls=1, snapshot_every_polls=3, small_snapshot_keys=0)
        ea.publish(clock)  # snapshot (empty)
        eb.publish(clock)
        await router.choose_replicas([a, b], None)
        ea.cache(PREFIX)
        ea.publish(clock, deliver=False)  # this broadcast never reached the router
        ea.cache(PREFIX + list(range(64)))
        ea.publish(clock)  # its delta starts after what the router has: a gap
        await router.choose_replicas([a, b], None)
        keys = router._request_keys(ask("x", 0))
        assert not router.index.views["a"].synced and router.index.num_cached_blocks("a", keys) == 0
        assert router.index.num_resyncs == 1
        ea.publish(clock)  # the periodic snapshot
        await router.choose_replicas([a, b], None)
        assert router.index.views["a"].synced and router.index.num_cached_blocks("a", keys) == 4
        # an out-of-order (older) broadcast changes nothing
        a.routing_stats = {**a.routing_stats, "kv_seq": 1, "kv_from_seq": 0, "kv_events": [], "kv_snapshot": []}
        await router.choose_replicas([a, b], None)
        assert router.index.num_cached_blocks("a", keys) == 4

    run(main())


def test_a_burst_between_two_samples_keeps_each_group_together_and_spreads_groups():
    async def main():
        clock = Clock()
        router, a, b, ea, eb = setup(clock)
        ea.publish(clock)
        eb.publish(clock)
        groups = [list(range(2000 + 100 * g, 2064 + 100 * g)) for g in range(4)]
        where: dict[int, set[str]] = {g: set() for g in range(4)}
        for i in range(16):  # no sample arrives in between: only the router's own history tells
            g = i % 4
            chosen = await route(router, [a, b], pending(ask(f"q{i}", i, prefix=groups[g])))
            where[g].add(chosen.replica_id.unique_id)
        assert all(len(replicas) == 1 for replicas in where.values()), where
        assert {r for rs in where.values() for r in rs} == {"a", "b"}  # groups are spread over both

    run(main())


def test_user_breaks_ties_and_salt_separates_tenants():
    async def main():
        clock = Clock()
        router, a, b, ea, eb = setup(clock)
        ea.publish(clock)
        eb.publish(clock)
        first = await route(router, [a, b], pending(ask("u1", 1, prefix=[5] * 8, user="alice")))
        router.on_request_completed(first.replica_id, "u1")
        for i in range(5):  # idle replicas, nothing cached: only the session key tells them apart
            chosen = await route(router, [a, b], pending(ask(f"u{i + 2}", i + 2, prefix=[6 + i] * 8, user="alice")))
            router.on_request_completed(chosen.replica_id, f"u{i + 2}")
            assert chosen is first
        # a prefix cached under one tenant's salt is not a hit for another tenant
        eb.cache(PREFIX + [9] * 8, salt=b"tenant-a")
        ea.publish(clock)
        eb.publish(clock)
        await router.choose_replicas([a, b], pending(ask("t1", 9, salt="tenant-a")))
        assert {c.view.replica_id: c.cached_tokens for c in router.last_candidates}["b"] == 64
        await router.choose_replicas([a, b], pending(ask("t2", 9, salt="tenant-b")))
        assert max(c.cached_tokens for c in router.last_candidates) == 0

    run(main())


def test_confirmed_ledger_entries_expire_when_their_completion_is_lost():
    async def main():
        for cls in (KVCacheAwareRouter, PrefixAwareRouter):
            clock = Clock()
            a, b = FakeReplica("a"), FakeReplica("b")
            a.publish(used=0, total=100, at=clock.now)
            b.publish(used=0, total=100, at=clock.now)
            router = make_router(cls, clock, [a, b], seed=0, block_size=BLOCK_SIZE, confirmed_ttl_s=30.0)
            chosen = await route(router, [a, b], pending(ask("lost", 1)))
            assert router.ledger.entries["lost"].confirmed
            clock.now += 29
            await router.choose_replicas([a, b], None)
            assert router.ledger.num_in_flight(chosen.replica_id.unique_id) == 1  # still within its lifetime
            clock.now += 2  # never completed (a lost callback): it must not hold the replica forever
            await router.choose_replicas([a, b], None)
            assert not router.ledger.entries

    run(main())


def two_routers(clock: Clock):
    """Two idle replicas that have published a sample, and two routers over them (one per ingress replica)."""
    a, b = FakeReplica("a"), FakeReplica("b")
    ea, eb = Engine(a), Engine(b)
    ea.publish(clock)
    eb.publish(clock)
    routers = [make_router(PrefixAwareRouter, clock, [a, b], seed=s, block_size=BLOCK_SIZE) for s in (1, 2)]
    return routers, a, b, ea, eb


def test_two_routers_sharing_the_samples_do_not_herd():
    async def main():
        clock = Clock()
        routers, a, b, ea, eb = two_routers(clock)
        counts = {"a": 0, "b": 0}
        for i in range(20):  # distinct prompts, alternating routers, no new sample in between
            chosen = await route(routers[i % 2], [a, b], pending(ask(f"d{i}", i, prefix=list(range(3000 + 64 * i, 3064 + 64 * i)))))
            counts[chosen.replica_id.unique_id] += 1
        assert min(counts.values()) >= 8, counts
        # nothing published yet about a new prefix: both routers still send its group to one replica
        for prefix in (list(range(9000, 9064)), list(range(9500, 9564)), list(range(9900, 9964))):
            chosen = {(await route(routers[i % 2], [a, b], pending(ask(f"g{prefix[0]}-{i}", i, prefix=prefix)))).name
                      for i in range(4)}
            assert len(chosen) == 1, (prefix[0], chosen)

    run(main())


def test_a_replica_without_a_cost_fit_is_assumed_to_cost_what_the_others_measured():
    async def main():
        clock = Clock()
        router, a, b, ea, eb = setup(clock)
        ea.cache(PREFIX)
        ea.publish(clock, running=2)
        eb.publish(clock)
        # `a` measured a slow machine (10 ms a prompt token); `b` has no fit yet: it is as slow, so the
        # cached prefix on `a` still wins (with the defaults, 1 ms a token, `b` would look 10x faster)
        a.routing_stats.update(step_fixed_s=0.5, prefill_s_per_token=0.01, decode_s_per_token=0.05)
        for key in ("step_fixed_s", "prefill_s_per_token", "decode_s_per_token"):
            b.routing_stats.pop(key)
        assert (await route(router, [a, b], pending(ask("q1", 1)))) is a
        ttft = {c.view.replica_id: c.ttft_s for c in router.last_candidates}
        assert ttft["b"] == pytest.approx(72 * 0.01 + 0.5) and ttft["a"] == pytest.approx(8 * 0.01 + 0.5 + 2 * 0.05)

    run(main())


def test_stale_load_samples_still_route_by_cache_contents():
    async def main():
        clock = Clock()
        router, a, b, ea, eb = setup(clock)
        eb.cache(PREFIX)
        ea.publish(clock)
        eb.publish(clock)
        clock.now += 30  # the controller's broadcasts lag (a loaded machine): every sample is stale
        for i in range(4):
            assert (await route(router, [a, b], pending(ask(f"s{i}", i)))) is b
        assert router.num_decisions == {"cache_hit": 4}
        kv = make_router(KVCacheAwareRouter, clock, [a, b], seed=0, block_size=BLOCK_SIZE)
        await kv.choose_replicas([a, b], pending(ask("k", 0)))
        assert kv.num_decisions == {"fallback": 1}  # the occupancy router falls back to least in-flight

    run(main())


def test_a_prefix_another_router_sent_follows_its_group_before_it_is_cached():
    """Replica `a` took a request of a new prefix group from another router (another ingress replica):
    its sample shows the prompt queued (unread) and its block keys pending, nothing cached yet. This
    router sends the next request of the group there; without the pending keys, the queued prompt
    would make `a` look busy and split the group."""
    async def main():
        clock = Clock()
        keys = prompt_block_keys(ask("first", 0).prompt_token_ids, BLOCK_SIZE)
        for published_pending, expected in ((keys, "a"), ((), "b")):
            router, a, b, ea, eb = setup(clock)
            ea.publish(clock, unread=72, running=1)
            eb.publish(clock)
            a.routing_stats["kv_pending"] = list(published_pending)
            chosen = await route(router, [a, b], pending(ask("second", 1)))
            assert chosen.name == expected, (published_pending, chosen.name)
        assert router.num_decisions == {"load": 1}

    run(main())


def test_pending_prefixes_publish_until_the_first_token_and_cap_newest_first():
    pending_prefixes = PendingPrefixes(BLOCK_SIZE, max_keys=6)
    pending_prefixes.add("r1", [1, 2, 3])
    pending_prefixes.add("r2", [1, 2, 4])  # the same first blocks: counted once
    assert sorted(pending_prefixes.published()) == [1, 2, 3, 4]
    pending_prefixes.done("r1")
    assert sorted(pending_prefixes.published()) == [1, 2, 4]  # r2 still holds 1 and 2
    pending_prefixes.add("r3", [10, 11, 12, 13, 14])
    assert pending_prefixes.published() == [10, 11, 12, 13, 14, 1]  # capped: newest request's keys first
    for rid in ("r2", "r3", "r3", "unknown"):
        pending_prefixes.done(rid)
    assert pending_prefixes.published() == [] and len(pending_prefixes) == 0


def test_recomputing_a_prefix_held_elsewhere_counts_against_the_cold_replica():
    """`a` holds the prefix and has 100 prompt tokens queued: `b` would give this request its first
    token sooner (72 tokens cold vs 108), but would spend 64 tokens recomputing what `a` holds. With
    the default weight the group stays on `a`; with weight 0 (TTFT alone) it goes to `b`."""
    async def main():
        for weight, expected in ((None, "a"), (0.0, "b")):
            clock = Clock()
            router, a, b, ea, eb = setup(clock, **({} if weight is None else {"recompute_weight": weight}))
            ea.cache(PREFIX)
            ea.publish(clock, unread=100)
            eb.publish(clock)
            assert (await route(router, [a, b], pending(ask("q", 1)))).name == expected, weight
            ttft = {c.view.replica_id: c.ttft_s for c in router.last_candidates}
            assert ttft["b"] < ttft["a"]

    run(main())


def test_two_routers_seeing_different_cost_fits_still_send_a_new_prefix_to_one_replica():
    """Router 2 decides from a sample taken at another moment than router 1's: the replica router 1
    chose now publishes a 30% slower step-cost fit and, as far as router 2 knows, holds nothing of the
    prompt. A cold request is a tie within `cold_tie_ratio`, so router 2 follows the same affinity
    and the group (or a chat's next turn) stays together; a prompt queued ahead is not a tie."""
    async def main():
        clock = Clock()
        (first, second), a, b, ea, eb = two_routers(clock)
        chosen_by_first = set()
        for g in range(8):
            prefix = list(range(20_000 + 64 * g, 20_064 + 64 * g))
            clock.now += 2  # fresh samples, equal fits: each group starts on idle replicas
            ea.publish(clock)
            eb.publish(clock)
            chosen = await route(first, [a, b], pending(ask(f"t{g}-1", 1, prefix=prefix)))
            chosen_by_first.add(chosen.name)
            chosen.routing_stats.update(prefill_s_per_token=1.3 * COST["prefill_s_per_token"],
                                        step_fixed_s=1.3 * COST["step_fixed_s"])
            assert (await route(second, [a, b], pending(ask(f"t{g}-2", 2, prefix=prefix)))) is chosen, g
            assert second.num_decisions["cache_hit"] == 0  # cold for router 2: the tie band decided
        assert chosen_by_first == {"a", "b"}  # affinity, not the fits, placed the groups
        # a prompt queued ahead on the affinity replica is a real cost: the cold request goes elsewhere
        prefix = list(range(30_000, 30_064))
        favoured = (await route(make_router(PrefixAwareRouter, clock, [a, b], seed=3, block_size=BLOCK_SIZE), [a, b],
                                pending(ask("probe", 1, prefix=prefix))))
        other = b if favoured is a else a
        (ea if favoured is a else eb).publish(clock, unread=400, running=8)
        (eb if favoured is a else ea).publish(clock)
        assert (await route(second, [a, b], pending(ask("queued", 1, prefix=prefix)))) is other

    run(main())
