"""The fused bf16 CPU ops (csrc/fused_ops.cpp) against the torch chains they replace, and the
model with them against the model without them."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from serve_app.engine import cpu_kernels
from serve_app.engine.attention import write_kv

OPS = cpu_kernels.fused_bf16_ops()
pytestmark = pytest.mark.skipif(OPS is None, reason="the C++ ops could not be built here")
BF16_ULP = 2**-7  # relative


def test_add_rms_norm_matches_add_then_norm():
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(5, 576, generator=gen) * 3).bfloat16()
    residual = torch.randn(5, 576, generator=gen).bfloat16()
    weight = torch.randn(576, generator=gen).bfloat16()
    expected_sum = residual + x
    expected = F.rms_norm(expected_sum.float(), (576,), eps=1e-5).bfloat16() * weight  # HF's rounding
    res = residual.clone()
    out = OPS.add_rms_norm(x, res, weight, 1e-5)
    assert torch.equal(res, expected_sum), "the residual must become residual + x, rounded to bf16, in place"
    torch.testing.assert_close(out, expected, atol=0, rtol=BF16_ULP)


def test_silu_and_mul_matches_torch():
    gen = torch.Generator().manual_seed(1)
    gate_up = (torch.randn(7, 2 * 1536, generator=gen) * 4).bfloat16()
    gate, up = gate_up.chunk(2, dim=-1)
    expected = F.silu(gate) * up
    out = OPS.silu_and_mul(gate_up)
    torch.testing.assert_close(out, expected, atol=1e-6, rtol=2 * BF16_ULP)  # exp may differ in its last fp32 bit
    assert (out == expected).float().mean() > 0.99


def test_rope_store_kv_matches_rope_then_write():
    from serve_app.engine.models.llama import LlamaForCausalLM

    gen = torch.Generator().manual_seed(2)
    heads, kv_heads, d, tokens = 9, 3, 64, 6
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * d, generator=gen).bfloat16()
    positions = torch.tensor([0, 5, 17, 3, 99, 100])
    slots = torch.tensor([3, 40, -1, 7, 63, 0])
    inv_freq = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    emb = torch.cat([torch.outer(torch.arange(128).float(), inv_freq)] * 2, dim=-1)
    cos = emb.cos().bfloat16()
    signed_sin = torch.cat((-emb[:, : d // 2].sin(), emb[:, d // 2 :].sin()), dim=-1).bfloat16()
    k_cache, v_cache = torch.zeros(4, 16, kv_heads, d, dtype=torch.bfloat16), torch.zeros(4, 16, kv_heads, d, dtype=torch.bfloat16)
    qk = OPS.rope_store_kv(qkv, positions, cos, signed_sin, k_cache, v_cache, slots, heads)

    expected = LlamaForCausalLM._rope(qkv[:, : (heads + kv_heads) * d].view(tokens, heads + kv_heads, d),
                                      cos[positions].unsqueeze(1), signed_sin[positions].unsqueeze(1))
    assert torch.equal(qk, expected)
    ref_k, ref_v = torch.zeros_like(k_cache), torch.zeros_like(v_cache)
    keep = slots >= 0
    v = qkv[:, (heads + kv_heads) * d :].view(tokens, kv_heads, d)
    write_kv(expected[keep, heads:], v[keep], ref_k, ref_v, slots[keep])
    assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v)


def test_model_with_fused_ops_matches_model_without(model_dir, prompt_ids):
    """bf16, real model: greedy tokens with the fused ops equal those of the unfused torch chain."""
    from serve_app.engine import LLM, SamplingParams

    llm = LLM(model_dir, dtype="bfloat16", kv_cache_memory_gib=0.1, max_num_batched_tokens=48)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    model = llm.engine.core.model_runner.model
    assert model._fused is not None
    fused = [list(o.token_ids) for o in llm.generate(prompt_ids[:4], params)]
    model.use_fused_ops(None)
    llm.reset_prefix_cache()
    unfused = [list(o.token_ids) for o in llm.generate(prompt_ids[:4], params)]
    assert fused == unfused
