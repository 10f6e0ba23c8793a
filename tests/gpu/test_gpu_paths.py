"""The CUDA paths of the native engine: Triton and FlashInfer attention, decode CUDA graphs, GPU
sampling, and the KV cache sized by `gpu_memory_utilization`.

Every attention backend (with and without CUDA graphs) must give HF's fp32 greedy tokens on the real
model; graphs must actually replay (batch sizes between buckets included: requests finish at
different steps); seeded sampling must not depend on graphs; a pure decode step syncs the host once.
Marked `gpu`; skipped without CUDA (the Triton kernels themselves are also checked on CPU by
tests/engine/test_triton_kernels.py, which runs on the GPU when there is one).
"""

from __future__ import annotations

import importlib.util
import warnings

import pytest

from tests.gpu import test_gpu_exact as exact
from tests.gpu.test_gpu_exact import DEVICE, MAX_TOKENS, MODEL_DIR, _assert_same, native_greedy

# the same fixtures (real model, chat prompts, HF's fp32 tokens, no TF32)
exact_fp32, tokenizer, prompts, hf_fp32 = exact.exact_fp32, exact.tokenizer, exact.prompts, exact.hf_fp32

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(not (MODEL_DIR / "config.json").is_file(), reason=f"{MODEL_DIR} missing: run `make model`"),
]

BACKENDS = ["triton", "torch"]  # FlashInfer has no fp32 kernels: checked in bf16 below


def _skip_missing(backend: str) -> None:
    if backend != "torch" and importlib.util.find_spec(backend) is None:
        pytest.skip(f"{backend} is not installed")


@pytest.mark.parametrize("enforce_eager", [False, True], ids=["graphs", "eager"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_fp32_token_exact(backend, enforce_eager, prompts, hf_fp32, tokenizer):
    _skip_missing(backend)
    llm, native, _ = native_greedy("float32", prompts, MAX_TOKENS, attention_backend=backend, enforce_eager=enforce_eager,
                                   max_num_batched_tokens=64)  # chunked prefill over cached context too
    _assert_same(native, hf_fp32, tokenizer)
    graphs = llm.engine.core.model_runner.decode_graphs
    if backend == "torch" or enforce_eager:
        assert graphs is None
    else:
        assert graphs is not None and graphs.num_replays > 0, "decode steps never replayed a CUDA graph"


def test_flashinfer_bf16_agrees_with_triton(prompts):
    """bf16 (FlashInfer's dtypes): FlashInfer and the Triton kernels, both reading the same paged
    cache layout, agree on the first tokens (rounding may flip near-ties later)."""
    _skip_missing("flashinfer")
    outs = {}
    for backend in ("flashinfer", "triton"):
        llm, outs[backend], _ = native_greedy("bfloat16", prompts, 8, attention_backend=backend, enforce_eager=True,
                                              max_num_batched_tokens=64)
        assert llm.engine.core.model_runner.backend == backend
        del llm
    first = sum(a[:2] == b[:2] for a, b in zip(outs["flashinfer"], outs["triton"], strict=True))
    assert first >= len(prompts) - 1, f"first tokens agree for only {first}/{len(prompts)} prompts"


def test_seeded_sampling_same_with_and_without_graphs(prompts):
    from serve_app.engine import LLM, SamplingParams

    params = [SamplingParams(temperature=0.8, top_p=0.9, top_k=40, max_tokens=24, seed=100 + i, ignore_eos=True) for i in range(len(prompts))]
    outs = []
    for eager in (False, True):
        llm = LLM(str(MODEL_DIR), dtype="float32", device=DEVICE, kv_cache_memory_gib=0.25, attention_backend="triton", enforce_eager=eager)
        outs.append([list(o.token_ids) for o in llm.generate(prompts, params)])
        del llm
    assert outs[0] == outs[1]


def test_one_host_sync_per_decode_step(prompts):
    from serve_app.engine import LLM, SamplingParams
    from serve_app.engine.request import Request

    llm = LLM(str(MODEL_DIR), dtype="bfloat16", device=DEVICE, kv_cache_memory_gib=0.25, attention_backend="triton")
    core = llm.engine.core
    for i, p in enumerate(prompts[:4]):
        core.add_request(Request(f"r{i}", list(p), SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True), None, 0.0))
    while core.scheduler.waiting or any(r.num_output_tokens == 0 for r in core.scheduler.running):
        core.step()  # prefills first
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            core.step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    syncs = [w for w in caught if "synchroniz" in str(w.message).lower()]
    assert core.model_runner.decode_graphs.num_replays >= 1
    assert len(syncs) <= 1, [str(w.message) for w in syncs]


def test_kv_cache_from_gpu_memory_utilization(prompts, hf_fp32, tokenizer):
    from serve_app.engine import LLM, SamplingParams
    from serve_app.engine.model_runner import kv_cache_bytes_per_block

    total = torch.cuda.mem_get_info()[1]
    llm = LLM(str(MODEL_DIR), dtype="float32", device=DEVICE, gpu_memory_utilization=0.3)
    runner = llm.engine.core.model_runner
    per_block = kv_cache_bytes_per_block(runner.args, runner.block_size, runner.dtype)
    assert runner.kv_cache_bytes == runner.num_blocks * per_block
    assert 2**30 < runner.kv_cache_bytes < 0.3 * total  # most of 30% of a large GPU, never more
    eos_ids = llm.engine.input_processor.eos_token_ids
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))
    _assert_same([[t for t in o.token_ids if t not in eos_ids] for o in outs], hf_fp32, tokenizer)
