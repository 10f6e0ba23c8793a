"""The fused bf16 CPU ops (csrc/fused_ops.cpp: residual add + RMSNorm; csrc/rope_kv.cpp: RoPE + K/V
write) against the torch ops they replace, bit for bit, and the real model with each against the
model without it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from serve_app.engine import cpu_kernels

ADD_RMS_NORM = cpu_kernels.op("add_rms_norm_bf16")
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
    assert torch.equal(out, cpu_kernels.op("rms_norm_bf16")(expected_sum, weight, 1e-5))  # the unfused pair, bit for bit
    torch.testing.assert_close(out, expected, atol=0, rtol=2**-7)  # and HF's formula within a bf16 ulp


@pytest.mark.parametrize("attr", ["_add_rms_norm_op", "_rope_write_kv_op"])
def test_model_with_each_fused_op_matches_model_without(model_dir, prompt_ids, attr):
    """bf16, real model: greedy tokens with the fused op equal those with the torch ops it replaces."""
    from serve_app.engine import LLM, SamplingParams

    llm = LLM(model_dir, dtype="bfloat16", kv_cache_memory_gib=0.1, max_num_batched_tokens=48)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    model = llm.engine.core.model_runner.model
    assert getattr(model, attr) is not None
    fused = [list(o.token_ids) for o in llm.generate(prompt_ids[:4], params)]
    setattr(model, attr, None)
    llm.reset_prefix_cache()
    unfused = [list(o.token_ids) for o in llm.generate(prompt_ids[:4], params)]
    assert fused == unfused


ROPE_WRITE_KV = cpu_kernels.op("rope_write_kv_bf16")


@pytest.mark.parametrize("head_dim", [64, 128, 40])  # the AVX-512 path (D % 32 == 0) and the portable one
def test_rope_write_kv_matches_the_torch_ops(head_dim):
    from serve_app.engine.attention import write_kv
    from serve_app.engine.models.llama import LlamaForCausalLM

    gen = torch.Generator().manual_seed(head_dim)
    heads, kv_heads, tokens, block_size, num_blocks = 9, 3, 37, 16, 8
    qkv = (torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=gen) * 4).bfloat16()
    positions = torch.randint(0, 500, (tokens,), generator=gen)
    angles = torch.outer(torch.arange(512, dtype=torch.float32), torch.rand(head_dim // 2, generator=gen))
    emb = torch.cat((angles, angles), dim=-1)
    cos = emb.cos().bfloat16()
    sin = torch.cat((-emb[:, : head_dim // 2].sin(), emb[:, head_dim // 2 :].sin()), dim=-1).bfloat16()
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:tokens]
    caches = [torch.zeros(num_blocks, block_size, kv_heads, head_dim, dtype=torch.bfloat16) for _ in range(4)]

    split = (heads + kv_heads) * head_dim
    qk = LlamaForCausalLM._rope(qkv[:, :split].view(tokens, heads + kv_heads, head_dim), cos[positions].unsqueeze(1),
                                sin[positions].unsqueeze(1))
    v = qkv[:, split:].view(tokens, kv_heads, head_dim)
    write_kv(qk[:, heads:], v, caches[0], caches[1], slots)

    fused = qkv.clone()
    ROPE_WRITE_KV(fused, positions, cos, sin, caches[2], caches[3], slots, heads, kv_heads)
    assert torch.equal(fused[:, :split], qk.reshape(tokens, split))  # q and k rotated in place, bit for bit
    assert torch.equal(fused[:, split:], qkv[:, split:])  # v untouched
    assert torch.equal(caches[2], caches[0]) and torch.equal(caches[3], caches[1])
