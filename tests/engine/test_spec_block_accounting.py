"""Block accounting with speculative decoding under random traffic (property-based): rejected
proposals' slots are rolled back exactly, also across aborts mid-step and preemptions, and only
accepted tokens reach the prefix cache. A fake model runner: no tensors."""

from __future__ import annotations

import random

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from serve_app.block_hash import extend_block_hashes
from serve_app.engine.block_manager import BlockManager, cdiv
from serve_app.engine.config import SchedulerConfig
from serve_app.engine.outputs import ModelRunnerOutput
from serve_app.engine.request import Request
from serve_app.engine.scheduler import Scheduler
from serve_app.engine.spec_decode.acceptance import accept
from serve_app.engine.spec_decode.config import SpeculativeConfig
from serve_app.engine.spec_decode.proposer import Proposal
from serve_app.engine.spec_decode.speculator import Speculator
from serve_app.engine.step_cost import StepCostFit
from serve_app.types import SamplingParams

BLOCK = 4


class RepeatProposer:
    """Proposes the last token again, k times (the fake model samples 7 or 8)."""

    full_length = True

    def propose(self, candidates):
        return {c.request_id: Proposal((c.token_ids[-1],) * c.max_k) for c in candidates}

    def forget(self, request_id):
        pass


def fake_run(scheduler_output, rng: random.Random) -> ModelRunnerOutput:
    ids, first, extra = [], [], []
    for s in scheduler_output.scheduled:
        if s.sample:
            sampled = [rng.choice((7, 8)) for _ in range(1 + len(s.spec_token_ids))]
            tokens = accept(sampled, s.spec_token_ids)
            ids.append(s.request_id)
            first.append(tokens[0])
            extra.append(tokens[1:])
    return ModelRunnerOutput(tuple(ids), tuple(first), extra_token_ids=tuple(extra))


def make_scheduler(num_blocks: int, budget: int, max_seqs: int, k: int, prefix: bool):
    bm = BlockManager(num_blocks, BLOCK, enable_prefix_caching=prefix)
    config = SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget)
    speculator = Speculator(SpeculativeConfig(method="ngram", max_k=4, k=k), StepCostFit(), RepeatProposer())
    return Scheduler(config, bm, max_model_len=num_blocks * BLOCK, speculator=speculator), bm


def check_exact(scheduler: Scheduler, bm: BlockManager) -> None:
    """Every running request holds exactly the blocks of its computed tokens, and every hashed block
    in its table holds tokens it really has (no rejected proposal was ever cached)."""
    bm.check_integrity()
    for request in scheduler.running:
        table = bm.block_table(request.request_id)
        assert len(table) == cdiv(request.num_computed_tokens, BLOCK)
        assert request.num_computed_tokens <= request.num_tokens
        truth = []
        extend_block_hashes(truth, request.all_token_ids, BLOCK, request.num_tokens // BLOCK)
        for i, block_id in enumerate(table):
            block_hash = bm.blocks[block_id].block_hash
            assert block_hash is None or (i < len(truth) and block_hash == truth[i])


ops = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.integers(1, 30), st.integers(1, 16), st.integers(0, 3)),
        st.tuples(st.just("step"), st.integers(1, 4), st.just(0), st.just(0)),
        st.tuples(st.just("abort"), st.integers(0, 40), st.just(0), st.just(0)),
        st.tuples(st.just("abort_in_flight"), st.integers(0, 40), st.just(0), st.just(0)),
    ),
    min_size=1,
    max_size=60,
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=ops, num_blocks=st.integers(8, 40), budget=st.integers(4, 64), max_seqs=st.integers(1, 8),
       k=st.integers(0, 4), prefix=st.booleans(), seed=st.integers(0, 1000))
def test_speculation_keeps_block_accounting_exact(ops, num_blocks, budget, max_seqs, k, prefix, seed):
    rng = random.Random(seed)
    scheduler, bm = make_scheduler(num_blocks, budget, max_seqs, k, prefix)
    added = 0
    for kind, a, b, family in ops:
        if kind == "add":
            prompt = [family * 100 + i % 5 for i in range(min(a, scheduler.max_model_len - 1))]
            scheduler.add_request(Request(f"r{added}", prompt, SamplingParams(max_tokens=b, ignore_eos=True), None, 0.0))
            added += 1
        elif kind == "step":
            for _ in range(a):
                out = scheduler.schedule()
                if not out.is_empty:
                    scheduler.update_from_output(out, fake_run(out, rng))
                check_exact(scheduler, bm)
        elif kind == "abort_in_flight":  # aborted after scheduling, before the step's results arrive
            out = scheduler.schedule()
            scheduler.finish_requests([f"r{a}"])
            if not out.is_empty:
                scheduler.update_from_output(out, fake_run(out, rng))
            check_exact(scheduler, bm)
        else:
            scheduler.finish_requests([f"r{a}"])
        check_exact(scheduler, bm)
    for _ in range(10_000):
        if not scheduler.has_unfinished_requests():
            break
        out = scheduler.schedule()
        if not out.is_empty:
            scheduler.update_from_output(out, fake_run(out, rng))
        check_exact(scheduler, bm)
    assert not scheduler.has_unfinished_requests()
    assert bm.num_used_blocks == 0


def test_rejected_slots_are_released_and_accepted_tokens_cached():
    scheduler, bm = make_scheduler(num_blocks=16, budget=64, max_seqs=2, k=4, prefix=True)
    scheduler.add_request(Request("a", [7, 7, 7], SamplingParams(max_tokens=20, ignore_eos=True), None, 0.0))
    out = scheduler.schedule()  # prefill: 3 tokens
    scheduler.update_from_output(out, ModelRunnerOutput(("a",), (7,)))
    out = scheduler.schedule()  # decode of token 4 with 4 proposals: positions 3..7 → 2 blocks
    (sched,) = out.scheduled
    assert sched.spec_token_ids == (7, 7, 7, 7) and len(bm.block_table("a")) == 2
    assert sched.spec_generator_keys == (None,) * 4
    # the model accepts one proposal and samples 8 where the second proposal said 7
    scheduler.update_from_output(out, ModelRunnerOutput(("a",), (7,), extra_token_ids=((8,),)))
    request = scheduler.requests["a"]
    assert request.output_token_ids == [7, 7, 8]
    assert request.num_computed_tokens == 5  # 3 prompt + the verified 7 and the accepted 7
    assert len(bm.block_table("a")) == 2  # positions 0..4: the second block holds position 4
    assert bm.blocks[bm.block_table("a")[0]].block_hash is not None  # [7, 7, 7, 7] is full and real
    assert bm.blocks[bm.block_table("a")[1]].block_hash is None
    out = scheduler.schedule()
    assert out.scheduled[0].start_pos == 5 and out.scheduled[0].token_ids[0] == 8
    scheduler.update_from_output(out, ModelRunnerOutput(("a",), (8,), extra_token_ids=((),)))  # every proposal rejected
    assert request.num_computed_tokens == 6 and len(bm.block_table("a")) == 2
    check_exact(scheduler, bm)
    stats = scheduler.make_stats(0, 0.0, 0.0, out)  # counters add up until stats are taken
    assert (stats.spec_num_seqs, stats.spec_num_proposed, stats.spec_num_accepted) == (2, 8, 1)
