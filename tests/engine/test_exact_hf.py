"""Token-exact greedy fp32 agreement with HF transformers under every scheduling condition."""

from __future__ import annotations

import pytest

from serve_app.engine import LLM, SamplingParams
from serve_app.engine.llm import merge_outputs
from serve_app.types import GenerateRequest
from tests.engine.conftest import MAX_TOKENS
from tests.recording_logger import RecordingLogger

pytestmark = pytest.mark.heavy  # the real model against HF transformers' greedy output: make test, not make test-fast

GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)


def run(model_dir, prompts, **kwargs):
    stats = RecordingLogger()
    llm = LLM(model_dir, dtype="float32", stat_loggers=[stats], **kwargs)
    outs = llm.generate(prompts, GREEDY)
    llm.engine.core.block_manager.check_integrity()
    assert llm.engine.core.block_manager.num_used_blocks == 0
    return [list(o.token_ids) for o in outs], stats


def test_all_together(model_dir, prompt_ids, hf_reference):
    tokens, stats = run(model_dir, prompt_ids)
    assert tokens == hf_reference
    assert max(s.num_scheduled_seqs for s in stats.steps) == len(prompt_ids)


def test_without_prefix_cache(model_dir, prompt_ids, hf_reference):
    tokens, stats = run(model_dir, prompt_ids, enable_prefix_caching=False)
    assert tokens == hf_reference
    assert sum(s.prefix_cache_hits for s in stats.steps) == 0


def test_prefix_cache_hits_shared_system_prompt(model_dir, prompt_ids, hf_reference):
    # every chat prompt starts with the same system message: later requests reuse its blocks
    tokens, stats = run(model_dir, prompt_ids, max_num_seqs=1)
    assert tokens == hf_reference
    hits = sum(s.prefix_cache_hits for s in stats.steps)
    assert hits >= 16 * (len(prompt_ids) - 1)
    computed_prompt = sum(s.num_prefill_tokens for s in stats.steps)
    assert computed_prompt == sum(len(p) for p in prompt_ids) - hits


def test_staggered_arrivals(model_dir, prompt_ids, hf_reference):
    llm = LLM(model_dir, dtype="float32")
    engine = llm.engine
    results = {}
    pending = list(enumerate(prompt_ids))
    step = 0
    while pending or engine.has_unfinished_requests():
        if pending and step % 3 == 0:  # a new request every third step, joining a running batch
            i, p = pending.pop(0)
            engine.add_request(GenerateRequest(str(i), prompt=p, sampling_params=GREEDY))
        for out in engine.step():
            results[out.request_id] = merge_outputs(results[out.request_id], out) if out.request_id in results else out
        step += 1
    assert [list(results[str(i)].token_ids) for i in range(len(prompt_ids))] == hf_reference


def test_preemption_by_recompute(model_dir, prompt_ids, hf_reference):
    # 10 blocks of 16 tokens cannot hold 8 requests of 40-100 tokens at once (even admitted a step
    # apart, as requests sharing the chat template's first blocks are)
    tokens, stats = run(model_dir, prompt_ids, num_blocks=10, block_size=16)
    assert sum(s.num_preempted for s in stats.steps) > 0
    assert sum(m.num_preemptions for _, m in stats.finished) > 0
    assert tokens == hf_reference


def test_chunked_prefill(model_dir, prompt_ids, hf_reference):
    tokens, stats = run(model_dir, prompt_ids, max_num_batched_tokens=24, enable_prefix_caching=False)
    assert tokens == hf_reference
    chunks_per_request = {}
    for s in stats.steps:
        for rid, _, reads_prompt in s.batch:
            chunks_per_request[rid] = chunks_per_request.get(rid, 0) + reads_prompt
    assert max(chunks_per_request.values()) >= 3  # a long prompt was split across steps
    assert any(s.num_prefill_tokens and s.num_decode_tokens for s in stats.steps)  # mixed with decodes
    assert max(s.num_tokens for s in stats.steps) <= 24


def test_prompt_chunks_on_both_attention_paths(model_dir, prompt_ids, hf_reference, monkeypatch):
    """With the CPU decode kernel, short fresh prompt chunks and continuing ones are attended as kernel
    rows and long fresh chunks by torch's SDPA; with the threshold lowered to 20 tokens, steps mix
    decodes and chunks of both kinds, in the order the kernel needs, and tokens stay exact."""
    from serve_app.engine import attention_metadata, model_runner

    monkeypatch.setattr(attention_metadata, "KERNEL_MAX_FRESH_CHUNK", 20)
    ranks_seen = set()
    original = model_runner.ModelRunner._order

    def order(self, scheduled):
        ordered = original(self, scheduled)
        ranks = [attention_metadata.kernel_rank(s) for s in ordered]
        assert ranks == sorted(ranks)
        ranks_seen.update(ranks)
        return ordered

    monkeypatch.setattr(model_runner.ModelRunner, "_order", order)
    assert run(model_dir, prompt_ids, max_num_batched_tokens=64, enable_prefix_caching=False)[0] == hf_reference
    assert ranks_seen == {0, 1, 2}


@pytest.mark.parametrize("batching", ["static", "dynamic", "continuous"])
def test_batching_policies(model_dir, prompt_ids, hf_reference, batching):
    tokens, stats = run(model_dir, prompt_ids, batching=batching, batch_size=3, max_num_seqs=3, batch_timeout_s=0.0)
    assert tokens == hf_reference
    if batching != "continuous":
        # a batch runs to completion before the next is admitted: membership only shrinks within a batch
        previous: set[str] = set()
        for s in stats.steps:
            current = {rid for rid, _, _ in s.batch}
            assert not previous or current <= previous or not (current & previous), (previous, current)
            previous = current
