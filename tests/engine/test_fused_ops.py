"""The fused bf16 CPU residual add + RMSNorm (csrc/fused_ops.cpp) against the pair it replaces, and
the model with it against the model without it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from serve_app.engine import cpu_kernels

ADD_RMS_NORM = cpu_kernels.add_rms_norm_bf16_op()
pytestmark = pytest.mark.skipif(ADD_RMS_NORM is None, reason="the C++ ops could not be built here")


def test_add_rms_norm_matches_add_then_norm():
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(5, 576, generator=gen) * 3).bfloat16()
    residual = torch.randn(5, 576, generator=gen).bfloat16()
    weight = torch.randn(576, generator=gen).bfloat16()
    expected_sum = residual + x
    expected = F.rms_norm(expected_sum.float(), (576,), eps=1e-5).bfloat16() * weight  # HF's rounding
    res = residual.clone()
    out = ADD_RMS_NORM(x, res, weight, 1e-5)
    assert torch.equal(res, expected_sum), "the residual must become residual + x, rounded to bf16, in place"
    assert torch.equal(out, cpu_kernels.rms_norm_bf16_op()(expected_sum, weight, 1e-5))  # the unfused pair, bit for bit
    torch.testing.assert_close(out, expected, atol=0, rtol=2**-7)  # and HF's formula within a bf16 ulp


def test_model_with_fused_ops_matches_model_without(model_dir, prompt_ids):
    """bf16, real model: greedy tokens with the fused op equal those without it."""
    from serve_app.engine import LLM, SamplingParams

    llm = LLM(model_dir, dtype="bfloat16", kv_cache_memory_gib=0.1, max_num_batched_tokens=48)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    model = llm.engine.core.model_runner.model
    assert model._add_rms_norm_op is not None
    fused = [list(o.token_ids) for o in llm.generate(prompt_ids[:4], params)]
    model.use_add_rms_norm_op(None)
    llm.reset_prefix_cache()
    unfused = [list(o.token_ids) for o in llm.generate(prompt_ids[:4], params)]
    assert fused == unfused
