"""Cache events from the block manager, published incrementally, rebuild the exact cached-block set
in a router's index, also when updates are lost, duplicated or arrive out of order."""

from __future__ import annotations

import random

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from serve_app.block_hash import block_key, prefix_block_hashes
from serve_app.engine.block_manager import BlockManager
from serve_app.engine.config import SchedulerConfig
from serve_app.engine.kv_events import KVCachePublisher, KVEventCursor, KVEventLog
from serve_app.engine.request import Request
from serve_app.engine.scheduler import Scheduler
from serve_app.serving.prefix_index import PrefixIndex
from serve_app.types import SamplingParams
from tests.engine.test_block_accounting import BLOCK, fake_run


def cached_keys(bm: BlockManager) -> set[int]:
    return {block_key(h) for h in bm._cached}


def make(num_blocks: int):
    log = KVEventLog(max_events=64)
    bm = BlockManager(num_blocks, BLOCK, events=log)
    config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=32, batch_timeout_s=0.0)
    return Scheduler(config, bm, max_model_len=num_blocks * BLOCK), bm, log


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000), num_blocks=st.integers(8, 32), drop=st.floats(0, 0.6),
       window=st.integers(1, 4), snapshot_every=st.integers(2, 6))
def test_index_follows_the_cache_under_lost_and_reordered_updates(seed, num_blocks, drop, window, snapshot_every):
    rng = random.Random(seed)
    scheduler, bm, log = make(num_blocks)
    publisher = KVCachePublisher(log, BLOCK, window_polls=window, snapshot_every_polls=snapshot_every, small_snapshot_keys=0)
    index = PrefixIndex()
    prefixes = [[rng.randrange(50) for _ in range(rng.randint(4, 20))] for _ in range(4)]
    history = []
    for i in range(60):
        if rng.random() < 0.4:
            prompt = rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randint(1, 6))]
            scheduler.add_request(Request(f"r{i}", prompt, SamplingParams(max_tokens=rng.randint(1, 6)), None, 0.0))
        out = scheduler.schedule()
        if not out.is_empty:
            scheduler.update_from_output(out, fake_run(out))
        update = publisher.next_update()
        history.append(update)
        if rng.random() >= drop:  # the broadcast reached this router
            index.apply("r", update)
        if rng.random() < 0.1 and len(history) > 2:  # an old broadcast arrives late
            assert index.apply("r", history[-3]) in ("stale", "waiting", "snapshot", "gap", "delta")
        view = index.views.get("r")
        if view is not None and view.synced and view.seq == log.seq:
            assert view.keys == cached_keys(bm)  # a synced, current view is exactly the cache
        bm.check_integrity()
    for _ in range(snapshot_every + 1):  # no more loss: the view converges within one snapshot period
        index.apply("r", publisher.next_update())
    assert index.views["r"].synced
    assert index.views["r"].keys == cached_keys(bm)


def test_eviction_is_published_and_a_gap_waits_for_a_snapshot():
    scheduler, bm, log = make(6)
    publisher = KVCachePublisher(log, BLOCK, window_polls=1, snapshot_every_polls=100, small_snapshot_keys=0)
    index = PrefixIndex()
    assert index.apply("r", publisher.next_update()) == "snapshot"  # the first update is a snapshot
    prompt = list(range(1, 13))  # 3 full blocks
    scheduler.add_request(Request("a", prompt, SamplingParams(max_tokens=1), None, 0.0))
    while scheduler.has_unfinished_requests():
        out = scheduler.schedule()
        scheduler.update_from_output(out, fake_run(out))
    assert index.apply("r", publisher.next_update()) == "delta"
    keys = [block_key(h) for h in prefix_block_hashes(prompt, BLOCK)]
    assert index.num_cached_blocks("r", keys) == 3
    # another prompt needs every block: the cached ones are evicted, and the router hears of it
    scheduler.add_request(Request("b", list(range(100, 123)), SamplingParams(max_tokens=1), None, 0.0))
    out = scheduler.schedule()
    scheduler.update_from_output(out, fake_run(out))
    assert index.apply("r", publisher.next_update()) in ("delta", "snapshot")  # a snapshot when smaller
    assert index.num_cached_blocks("r", keys) == 0
    assert index.views["r"].keys == cached_keys(bm)
    # a lost update (window of one poll): the next delta starts after the router's seq → resync
    bm.reset_prefix_cache()
    publisher.next_update()  # not delivered
    scheduler.add_request(Request("c", prompt, SamplingParams(max_tokens=1), None, 0.0))
    while scheduler.has_unfinished_requests():
        out = scheduler.schedule()
        scheduler.update_from_output(out, fake_run(out))
    assert index.apply("r", publisher.next_update()) == "gap"
    assert index.num_cached_blocks("r", keys) == 0  # nothing it cannot vouch for
    publisher.snapshot_every_polls = 1
    assert index.apply("r", publisher.next_update()) == "snapshot"
    assert index.num_cached_blocks("r", keys) == 3
    # a restarted engine has a new epoch: the old view is dropped
    other = KVCachePublisher(KVEventLog(), BLOCK)
    assert index.apply("r", other.next_update()) == "snapshot"
    assert index.num_cached_blocks("r", keys) == 0 and index.num_resyncs == 2


def test_finished_requests_report_their_cached_tokens_once_per_window():
    log = KVEventLog()
    publisher = KVCachePublisher(log, BLOCK, window_polls=2, small_snapshot_keys=0)
    log.request_finished("x", 32, 40)
    assert publisher.next_update()["cached_tokens"] == [("x", 32, 40)]
    assert publisher.next_update()["cached_tokens"] == [("x", 32, 40)]  # still in the window
    assert publisher.next_update()["cached_tokens"] == []


def test_salted_prompts_never_share_blocks():
    scheduler, bm, log = make(16)
    prompt = list(range(1, 14))
    for rid, salt in (("a", b"tenant-a"), ("b", b"tenant-b")):
        req = Request(rid, prompt, SamplingParams(max_tokens=1), None, 0.0, cache_salt=salt)
        scheduler.add_request(req)
        while scheduler.has_unfinished_requests():
            out = scheduler.schedule()
            scheduler.update_from_output(out, fake_run(out))
        assert req.num_cached_tokens == 0
    assert cached_keys(bm) == {block_key(h) for s in (b"tenant-a", b"tenant-b") for h in prefix_block_hashes(prompt, BLOCK, s)}


def test_a_small_cache_is_always_published_whole():
    log = KVEventLog()
    publisher = KVCachePublisher(log, BLOCK, small_snapshot_keys=8)
    for n in range(1, 12):
        log.stored(bytes([n]) * 32)
        update = publisher.next_update()
        # up to 8 cached blocks every update is a full snapshot (a router that just joined needs no resync)
        assert ("kv_snapshot" in update) == (n <= 8 or (n - 1) % 10 == 0), n


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000), num_blocks=st.integers(8, 32), take_every=st.integers(1, 80))
def test_a_mirror_fed_by_a_cursor_holds_the_source_logs_keys(seed, num_blocks, take_every):
    """An engine in a process of its own: its log's changes, taken at any pace (so the source's 64-event
    ring overflows between some takes), rebuild the same cached set and finished requests in a mirror log
    in the parent, and the parent's publisher (polled after every take) keeps a router's index equal to the cache."""
    rng = random.Random(seed)
    scheduler, bm, log = make(num_blocks)
    cursor, mirror, index = KVEventCursor(log), KVEventLog(), PrefixIndex()
    publisher = KVCachePublisher(mirror, BLOCK, small_snapshot_keys=0)
    finished: list[tuple[str, int, int]] = []
    shared = [rng.randrange(1, 50) for _ in range(3 * BLOCK)]
    for i in range(40):
        prompt = shared[: rng.randrange(BLOCK, 3 * BLOCK)] + [rng.randrange(1, 50) for _ in range(rng.randrange(0, 2 * BLOCK))]
        scheduler.add_request(Request(f"r{i}", prompt, SamplingParams(max_tokens=rng.randrange(1, 8)), None, 0.0))
        log.request_finished(f"r{i}", i, len(prompt))
        for _ in range(rng.randrange(1, 6)):
            out = scheduler.schedule()
            if not out.is_empty:
                scheduler.update_from_output(out, fake_run(out))
            if rng.randrange(take_every) == 0:
                events, snapshot, done = cursor.take()
                mirror.replay(events, snapshot, done)
                finished += done
                assert set(mirror.snapshot()[1]) == cached_keys(bm)
                index.apply("r", publisher.next_update())
    mirror.replay(*cursor.take())
    index.apply("r", publisher.next_update())
    assert set(mirror.snapshot()[1]) == cached_keys(bm)
    assert mirror.finished_since(0)[1] == log.finished_since(0)[1]
    assert index.views["r"].synced and set(index.views["r"].keys) == cached_keys(bm)
