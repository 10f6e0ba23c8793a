"""Same request, same answer: the differential matrix over every execution path this machine can run.

Each combination of projections (C++ kernels, oneDNN, torch's F.linear) and attention (decode +
prompt-chunk kernels, decode kernel alone, torch's SDPA), in bf16 and fp32, runs the real model's
prompts alone without a prefix cache (the reference) and then batched with unrelated prompts, again
after their prefixes were cached, in small chunks, preempted and recomputed, verified by speculative
decoding, and on two threads instead of one. Where the runner claims batch invariance, every sampled
position's fp32 logits must be bit-identical to the reference's; elsewhere each greedy token must be
among the other's top 5.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from serve_app.engine import LLM, cpu_kernels
from serve_app.types import SamplingParams
from tests.engine.logits_recorder import LogitsRecorder

pytestmark = pytest.mark.heavy  # every execution path over many step shapes: make test, not make test-fast

PROMPTS = [
    "What is the capital of France?",
    "Repeat exactly: the quick brown fox jumps over the lazy dog. The quick brown fox jumps over",
    "Name three colors of the rainbow.",
]
OTHERS = ["Write a haiku about the sea.", "Explain why the sky is blue in one sentence."]
MAX_TOKENS = 8

KERNELS = cpu_kernels.linear_kernels([960, 576, 3072, 49152], [576, 576, 1536]) is not None
ONEDNN = torch.ops.mkldnn._is_mkldnn_bf16_supported()
needs_kernels = pytest.mark.skipif(not KERNELS, reason="needs AVX512-BF16 (the C++ bf16 kernels)")
needs_onednn = pytest.mark.skipif(not ONEDNN, reason="needs AVX512 (oneDNN bf16 matmuls)")

# (dtype, linear_backend, attention_backend, the runner must claim invariance)
COMBINATIONS = [
    pytest.param("bfloat16", "kernels", "auto", True, marks=needs_kernels, id="bf16-kernels-chunkkernel"),
    pytest.param("bfloat16", "kernels", "cpu_decode", True, marks=needs_kernels, id="bf16-kernels-decodekernel"),
    pytest.param("bfloat16", "onednn", "auto", True, marks=needs_onednn, id="bf16-onednn-chunkkernel"),
    pytest.param("bfloat16", "dense", "cpu_decode", True, id="bf16-dense-decodekernel"),
    pytest.param("bfloat16", "dense", "torch", False, id="bf16-dense-sdpa"),
    pytest.param("float32", "auto", "auto", False, id="fp32"),
]


def greedy(speculative: bool = False) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, speculative=speculative)


def chats(tokenizer, texts):
    return [list(tokenizer.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True, return_dict=True)["input_ids"])
            for t in texts]


def engine(model_dir, dtype, linear, attention, **kwargs) -> tuple[LLM, LogitsRecorder]:
    llm = LLM(model_dir, dtype=dtype, linear_backend=linear, attention_backend=attention, kv_cache_memory_gib=0.05,
              speculative={"method": "ngram", "k": 3}, **kwargs)
    return llm, LogitsRecorder(llm)


def fresh(llm: LLM) -> LogitsRecorder:
    """A new recorder on `llm` with its prefix cache emptied (the previous recorder is dropped)."""
    llm.reset_prefix_cache()
    runner = llm.engine.core.model_runner
    runner.sampling_logits = type(runner).sampling_logits.__get__(runner)
    return LogitsRecorder(llm)


@pytest.mark.parametrize(("dtype", "linear", "attention", "invariant"), COMBINATIONS)
def test_every_shape_of_a_step_gives_the_reference_logits(model_dir, tokenizer, dtype, linear, attention, invariant):
    prompts, others = chats(tokenizer, PROMPTS), chats(tokenizer, OTHERS)
    llm, _ = engine(model_dir, dtype, linear, attention)
    runner = llm.engine.core.model_runner
    assert runner.batch_invariant == invariant and runner.paths.self_check == "passed"

    reference = fresh(llm)
    for p in prompts:  # alone, nothing cached
        llm.reset_prefix_cache()
        llm.generate([p], greedy())
    shapes = {}
    shapes["batched"] = fresh(llm)
    llm.generate(others[:1] + prompts + others[1:], greedy())
    shapes["prefix hit"] = recorder = fresh(llm)
    llm.generate(prompts, greedy())  # computes and caches the prompts' blocks ...
    recorder.rows.clear()
    for p in prompts:
        llm.generate([p], greedy())  # ... which these read
    scheduler = llm.engine.core.scheduler
    scheduler.config = dataclasses.replace(scheduler.config, max_num_batched_tokens=7)
    shapes["chunked by 7"] = fresh(llm)
    llm.generate(prompts + others, greedy())
    scheduler.config = dataclasses.replace(scheduler.config, max_num_batched_tokens=2048)
    shapes["speculative"] = fresh(llm)
    llm.generate(prompts, greedy(speculative=True))
    assert shapes["speculative"].num_verified > 0
    # the reference ran on one thread (tests/conftest.py); decode_threads switches the count between steps
    shapes["two threads"] = fresh(llm)
    torch.set_num_threads(2)
    try:
        llm.generate(others[:1] + prompts, greedy())
    finally:
        torch.set_num_threads(1)
    # preemption: a cache too small for every prompt at once, so the newest is preempted and recomputed
    small, shapes["preempted"] = engine(model_dir, dtype, linear, attention, num_blocks=2 * len(prompts[0]) // 16 + 4,
                                        max_num_batched_tokens=64)
    outs = small.generate(prompts, SamplingParams(temperature=0.0, max_tokens=3 * MAX_TOKENS, ignore_eos=True, speculative=False))
    assert sum(o.metrics.num_preemptions for o in outs) > 0

    for name, recorder in shapes.items():
        common, same, worst = recorder.compare(reference)
        assert common >= len(PROMPTS), name
        if invariant:
            assert same == common, f"{name}: {common - same} of {common} positions differ (by up to {worst})"
        else:
            assert recorder.topk_agree(reference), name
    if invariant:
        assert shapes["preempted"].changed_on_recompute == 0
