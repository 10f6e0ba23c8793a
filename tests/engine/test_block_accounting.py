"""Block accounting under random traffic (property-based), with a fake model runner: no tensors."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from serve_app.engine.block_manager import BlockManager
from serve_app.engine.config import SchedulerConfig
from serve_app.engine.outputs import ModelRunnerOutput
from serve_app.engine.request import Request
from serve_app.engine.scheduler import Scheduler
from serve_app.types import SamplingParams

BLOCK = 4


def fake_run(scheduler_output) -> ModelRunnerOutput:
    """Samples token 7 for every request that reached its last token."""
    sampled = [s.request_id for s in scheduler_output.scheduled if s.sample]
    return ModelRunnerOutput(tuple(sampled), tuple(7 for _ in sampled))


def make_scheduler(num_blocks: int, budget: int, max_seqs: int, batching: str = "continuous", prefix: bool = True, chunked: bool = True,
                   ratio: float = 0.0, max_waiting_steps: int = 20):
    bm = BlockManager(num_blocks, BLOCK, enable_prefix_caching=prefix)
    config = SchedulerConfig(batching=batching, max_num_seqs=max_seqs, max_num_batched_tokens=budget, batch_timeout_s=0.0,
                             enable_chunked_prefill=chunked, waiting_served_ratio=ratio, max_waiting_steps=max_waiting_steps)
    # as EngineCore does: without chunked prefill a whole sequence must fit one step's budget
    max_model_len = num_blocks * BLOCK if chunked else min(num_blocks * BLOCK, budget)
    return Scheduler(config, bm, max_model_len=max_model_len), bm


def step(scheduler: Scheduler):
    out = scheduler.schedule()
    if not out.is_empty:
        scheduler.update_from_output(out, fake_run(out))
    return out


ops = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.integers(1, 30), st.integers(1, 12), st.integers(0, 3)),
        st.tuples(st.just("step"), st.integers(1, 4), st.just(0), st.just(0)),
        st.tuples(st.just("abort"), st.integers(0, 40), st.just(0), st.just(0)),
    ),
    min_size=1,
    max_size=60,
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    ops=ops,
    num_blocks=st.integers(8, 40),
    budget=st.integers(4, 64),
    max_seqs=st.integers(1, 8),
    batching=st.sampled_from(["continuous", "dynamic", "static"]),
    prefix=st.booleans(),
    chunked=st.booleans(),
    hold=st.sampled_from([(0.0, 20), (0.5, 3), (2.0, 0), (1.0, 6)]),
)
def test_random_traffic_keeps_integrity(ops, num_blocks, budget, max_seqs, batching, prefix, chunked, hold):
    hold = hold if batching == "continuous" else (0.0, 20)
    scheduler, bm = make_scheduler(num_blocks, budget, max_seqs, batching, prefix, chunked, *hold)
    added = 0
    for kind, a, b, family in ops:
        if kind == "add":
            # prompts from a few families share prefixes, so the prefix cache gets hits
            prompt = [family * 100 + i for i in range(min(a, scheduler.max_model_len - 1))]
            scheduler.add_request(Request(f"r{added}", prompt, SamplingParams(max_tokens=b, ignore_eos=True), None, 0.0))
            added += 1
        elif kind == "step":
            for _ in range(a):
                step(scheduler)
                bm.check_integrity()
                assert scheduler.num_pending_prompt_tokens >= 0
        else:
            scheduler.finish_requests([f"r{a}"])
        bm.check_integrity()
    for _ in range(10_000):  # drain: everything finishes, nothing leaks
        if not scheduler.has_unfinished_requests():
            break
        step(scheduler)
        bm.check_integrity()
    assert not scheduler.has_unfinished_requests()
    assert bm.num_used_blocks == 0
    assert bm.num_free_blocks == num_blocks


def test_shared_prefix_hits_cache_and_reduces_computed_tokens():
    scheduler, bm = make_scheduler(num_blocks=32, budget=256, max_seqs=4)
    shared = list(range(1000, 1012))  # three full blocks
    scheduler.add_request(Request("a", shared + [1, 2], SamplingParams(max_tokens=5), None, 0.0))
    first = step(scheduler)
    assert first.num_batched_tokens == 14
    scheduler.add_request(Request("b", shared + [3, 4, 5], SamplingParams(max_tokens=2), None, 0.0))
    second = step(scheduler)
    b = next(s for s in second.scheduled if s.request_id == "b")
    assert b.start_pos == 12 and b.num_tokens == 3  # the shared 12 tokens came from the cache
    assert bm.block_table("a")[:3] == bm.block_table("b")[:3]
    assert all(bm.blocks[i].ref_count == 2 for i in bm.block_table("a")[:3])
    bm.check_integrity()
    while scheduler.has_unfinished_requests():
        step(scheduler)
    # freed but still cached: a third request hits without any running owner
    scheduler.add_request(Request("c", shared + [9], SamplingParams(max_tokens=1), None, 0.0))
    third = step(scheduler)
    assert third.scheduled[0].start_pos == 12
    bm.check_integrity()


def test_cached_blocks_are_evicted_only_when_needed():
    scheduler, bm = make_scheduler(num_blocks=4, budget=64, max_seqs=2)
    scheduler.add_request(Request("a", list(range(8)) + [99], SamplingParams(max_tokens=1), None, 0.0))
    step(scheduler)
    assert bm.num_used_blocks == 0 and len(bm._cached) == 2
    # a request needing all 4 blocks evicts the cached ones
    scheduler.add_request(Request("b", list(range(500, 515)), SamplingParams(max_tokens=1), None, 0.0))
    step(scheduler)
    assert len(bm._cached) == 3  # b's own three full blocks (its last block holds the sampled position)
    bm.check_integrity()


def test_pending_prompt_tokens_follow_chunked_prefill_and_preemption():
    """Routing stats publish the prompt tokens still to be read: whole waiting prompts, the rest of a
    part-read one, nothing for a decoding request, and a preempted request's whole recompute."""
    scheduler, bm = make_scheduler(num_blocks=6, budget=8, max_seqs=4, prefix=False)
    scheduler.add_request(Request("long", list(range(10)), SamplingParams(max_tokens=6, ignore_eos=True), None, 0.0))
    scheduler.add_request(Request("short", list(range(100, 105)), SamplingParams(max_tokens=6, ignore_eos=True), None, 1.0))
    assert scheduler.num_pending_prompt_tokens == 15
    out = scheduler.schedule()  # 8 of long's 10 prompt tokens: unread until the model has run them
    assert out.num_batched_tokens == 8 and scheduler.num_pending_prompt_tokens == 15
    scheduler.update_from_output(out, fake_run(out))
    assert scheduler.num_pending_prompt_tokens == 2 + 5
    out = scheduler.schedule()  # long's last 2 and short's 5 (both sample)
    assert out.num_batched_tokens == 7 and scheduler.num_pending_prompt_tokens == 7
    scheduler.update_from_output(out, fake_run(out))
    assert scheduler.num_pending_prompt_tokens == 0
    out = scheduler.schedule()  # two decodes in flight: no prompt work
    assert out.num_batched_tokens == 2 and scheduler.num_pending_prompt_tokens == 0
    scheduler.update_from_output(out, fake_run(out))
    preempted_seen = False
    while scheduler.has_unfinished_requests():
        out = step(scheduler)
        if out.preempted_ids:  # 6 blocks of 4 cannot hold both to the end: the newest is recomputed
            victim = scheduler.requests[out.preempted_ids[0]]
            assert scheduler.num_pending_prompt_tokens == victim.num_tokens - 1
            preempted_seen = True
    assert preempted_seen and scheduler.num_pending_prompt_tokens == 0


def test_preempts_newest_first_and_resumes():
    scheduler, bm = make_scheduler(num_blocks=6, budget=64, max_seqs=4, prefix=False)
    for i in range(3):
        scheduler.add_request(Request(f"r{i}", list(range(7)), SamplingParams(max_tokens=10, ignore_eos=True), None, float(i)))
    preempted = []
    while scheduler.has_unfinished_requests():
        out = step(scheduler)
        preempted += out.preempted_ids
        bm.check_integrity()
    assert preempted and preempted[0] == "r2"
    assert bm.num_used_blocks == 0


def test_static_waits_for_a_full_batch_then_runs_it_to_completion():
    clock = [0.0]
    bm = BlockManager(64, BLOCK)
    config = SchedulerConfig(batching="static", max_num_seqs=4, batch_size=2, batch_timeout_s=5.0)
    scheduler = Scheduler(config, bm, 256, clock=lambda: clock[0])
    scheduler.add_request(Request("a", [1, 2, 3], SamplingParams(max_tokens=3), None, 0.0))
    assert scheduler.schedule().is_empty  # one of two: keep waiting
    assert scheduler.next_wakeup_s() == 5.0
    scheduler.add_request(Request("b", [4, 5, 6], SamplingParams(max_tokens=3), None, 0.0))
    scheduler.add_request(Request("c", [7, 8, 9], SamplingParams(max_tokens=3), None, 0.0))
    batches = []
    while {"a", "b"} & scheduler.requests.keys():
        out = scheduler.schedule()
        batches.append({s.request_id for s in out.scheduled})
        scheduler.update_from_output(out, fake_run(out))
    assert all(b == {"a", "b"} for b in batches)  # c never joined the running batch
    assert scheduler.schedule().is_empty  # c alone waits for a full batch ...
    clock[0] += 5.0
    assert [s.request_id for s in scheduler.schedule().scheduled] == ["c"]  # ... until its timeout


def running_ids(out) -> set[str]:
    return {s.request_id for s in out.scheduled}


def test_waiting_requests_join_running_ones_in_groups():
    """With waiting_served_ratio 0.5, a lone newcomer waits while 4 requests decode; a second one makes
    2 >= 0.5 x 4, and both join in the same step."""
    scheduler, bm = make_scheduler(num_blocks=64, budget=256, max_seqs=8, ratio=0.5, max_waiting_steps=50)
    for rid in "abcd":
        scheduler.add_request(Request(rid, [ord(rid)] * 5, SamplingParams(max_tokens=20, ignore_eos=True), None, 0.0))
    assert running_ids(step(scheduler)) == set("abcd")  # nothing was running: admitted at once
    scheduler.add_request(Request("e", [9] * 5, SamplingParams(max_tokens=3, ignore_eos=True), None, 0.0))
    for _ in range(3):
        assert running_ids(step(scheduler)) == set("abcd")
    scheduler.add_request(Request("f", [8] * 5, SamplingParams(max_tokens=3, ignore_eos=True), None, 0.0))
    assert running_ids(step(scheduler)) == set("abcdef")
    while scheduler.has_unfinished_requests():
        step(scheduler)
    bm.check_integrity()
    assert bm.num_used_blocks == 0


def test_a_held_request_joins_after_max_waiting_steps():
    scheduler, _ = make_scheduler(num_blocks=64, budget=256, max_seqs=8, ratio=1.0, max_waiting_steps=4)
    for rid in "abc":
        scheduler.add_request(Request(rid, [ord(rid)] * 5, SamplingParams(max_tokens=20, ignore_eos=True), None, 0.0))
    step(scheduler)
    scheduler.add_request(Request("e", [9] * 5, SamplingParams(max_tokens=3, ignore_eos=True), None, 0.0))
    held = 0
    while "e" not in running_ids(step(scheduler)):
        held += 1
    assert held == 4


def test_holding_is_off_by_default_and_only_for_continuous_batching():
    scheduler, _ = make_scheduler(num_blocks=64, budget=256, max_seqs=8)
    scheduler.add_request(Request("a", [1] * 5, SamplingParams(max_tokens=20, ignore_eos=True), None, 0.0))
    step(scheduler)
    scheduler.add_request(Request("b", [2] * 5, SamplingParams(max_tokens=3, ignore_eos=True), None, 0.0))
    assert running_ids(step(scheduler)) == {"a", "b"}
    with pytest.raises(ValueError, match="waiting_served_ratio: applies to continuous batching only"):
        SchedulerConfig(batching="dynamic", waiting_served_ratio=1.0)
    with pytest.raises(ValueError, match="max_waiting_steps"):
        SchedulerConfig(waiting_served_ratio=1.0, max_waiting_steps=-1)


def test_requests_arriving_together_with_a_new_shared_prefix_compute_it_once():
    """`b` and `c` share `a`'s new 3-block prefix and arrive with it: they wait one step, then read it
    from the cache; `d` (nothing shared) is not held back."""
    scheduler, bm = make_scheduler(num_blocks=32, budget=256, max_seqs=4)
    shared = list(range(1000, 1012))  # three full blocks
    for rid, tail in (("a", [1, 2]), ("b", [3, 4, 5]), ("d", None), ("c", [6])):
        prompt = list(range(2000, 2010)) if tail is None else shared + tail
        scheduler.add_request(Request(rid, prompt, SamplingParams(max_tokens=3), None, 0.0))
    first = step(scheduler)
    assert [s.request_id for s in first.scheduled] == ["a", "d"]
    assert scheduler.num_pending_prompt_tokens == 15 + 13  # b and c still wait, in their order
    assert [r.request_id for r in scheduler.waiting] == ["b", "c"]
    second = step(scheduler)
    started = {s.request_id: (s.start_pos, s.num_tokens) for s in second.scheduled if s.request_id in "bc"}
    assert started == {"b": (12, 3), "c": (12, 1)}
    while scheduler.has_unfinished_requests():
        step(scheduler)
    bm.check_integrity()


def test_without_continuous_batching_nobody_is_held_back_for_a_shared_prefix():
    scheduler, _ = make_scheduler(num_blocks=32, budget=256, max_seqs=4, batching="dynamic")
    shared = list(range(1000, 1012))
    for rid in ("a", "b"):
        scheduler.add_request(Request(rid, shared + [ord(rid)], SamplingParams(max_tokens=2), None, 0.0))
    assert [s.request_id for s in step(scheduler).scheduled] == ["a", "b"]
