"""The C++ CPU decode kernel against the torch reference path, on every code path it has.

The kernel has a portable loop and AVX-512 loops for head_dim 64 and 128 (bf16 with the AVX512-BF16
dot product where the CPU has it); tasks are whole requests for large batches and single KV heads for
small ones; blocks may hold fewer or more than the 16 tokens a vector chunk takes. Each case here
uses random caches, scattered block tables and ragged context lengths (1 included).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from serve_app.engine import cpu_kernels
from serve_app.engine.attention import _gather

KERNEL = cpu_kernels.op("paged_decode")
pytestmark = pytest.mark.skipif(KERNEL is None, reason="the C++ kernel could not be built here")

TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}


def reference(q, k_cache, v_cache, block_tables, lens, scale):
    b, h, d = q.shape
    hkv, bs = k_cache.shape[2], k_cache.shape[1]
    keys = torch.arange(block_tables.shape[1] * bs)
    mask = (keys.unsqueeze(0) < lens.unsqueeze(1)).view(b, 1, 1, -1)
    qd = q.float().view(b, hkv, h // hkv, d)
    out = F.scaled_dot_product_attention(qd, _gather(k_cache, block_tables).float(), _gather(v_cache, block_tables).float(), attn_mask=mask, scale=scale)
    return out.reshape(b, h, d)


def run_case(batch, heads, kv_heads, head_dim, block_size, max_len, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, max_len + 1, (batch,), generator=gen, dtype=torch.int32)
    lens[0] = 1
    lens[-1] = max_len
    max_blocks = -(-max_len // block_size)
    num_blocks = batch * max_blocks + 3
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    block_tables = torch.randperm(num_blocks, generator=gen)[: batch * max_blocks].view(batch, max_blocks)
    q = torch.randn(batch, heads, head_dim, generator=gen).to(dtype)
    out = torch.full_like(q, float("nan"))
    scale = head_dim**-0.5
    KERNEL(out, q, k_cache, v_cache, block_tables, lens, scale)
    torch.testing.assert_close(out.float(), reference(q, k_cache, v_cache, block_tables, lens, scale), atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [64, 128, 40])  # two vector paths and the portable one
@pytest.mark.parametrize("batch", [1, 9])  # one KV head per task / whole requests per task
def test_matches_reference(dtype, head_dim, batch):
    run_case(batch, heads=9, kv_heads=3, head_dim=head_dim, block_size=16, max_len=70, dtype=dtype)


@pytest.mark.parametrize("block_size", [8, 32, 64])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 2), (14, 2)])
def test_block_sizes_and_groups(block_size, heads, kv_heads):
    run_case(6, heads, kv_heads, head_dim=64, block_size=block_size, max_len=150, dtype=torch.bfloat16, seed=block_size)


def test_strided_query_and_output_views():
    """The model passes slices of [T, H, D] tensors; only head_dim needs to be contiguous."""
    gen = torch.Generator().manual_seed(1)
    k_cache = torch.randn(8, 16, 2, 64, generator=gen)
    v_cache = torch.randn(8, 16, 2, 64, generator=gen)
    block_tables = torch.tensor([[3, 5], [7, 0]])
    lens = torch.tensor([20, 9], dtype=torch.int32)
    q_full = torch.randn(5, 4, 64, generator=gen)
    out_full = torch.zeros(5, 4, 64)
    KERNEL(out_full[:2], q_full[:2], k_cache, v_cache, block_tables, lens, 0.125)
    torch.testing.assert_close(out_full[:2], reference(q_full[:2], k_cache, v_cache, block_tables, lens, 0.125))
    assert out_full[2:].abs().sum() == 0


def test_rejects_mismatched_dtypes():
    q = torch.randn(1, 2, 64)
    cache = torch.randn(2, 16, 2, 64, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="one dtype"):
        KERNEL(torch.empty_like(q), q, cache, cache, torch.zeros(1, 1, dtype=torch.long), torch.ones(1, dtype=torch.int32), 1.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_long_contexts_and_peaked_softmax(dtype):
    """Contexts past several 32-token weight packs with ragged tails, and scores spread over a wide
    range (most softmax weights underflow to 0): the vectorized exp and the bf16 weight pairs."""
    gen = torch.Generator().manual_seed(7)
    batch, heads, kv_heads, head_dim, block_size = 5, 6, 2, 64, 16
    lens = torch.tensor([1, 33, 517, 600, 95], dtype=torch.int32)
    max_blocks = -(-600 // block_size)
    num_blocks = batch * max_blocks
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    block_tables = torch.randperm(num_blocks, generator=gen).view(batch, max_blocks)
    q = torch.randn(batch, heads, head_dim, generator=gen).to(dtype)
    for scale in (head_dim**-0.5, 2.0):
        out = torch.full_like(q, float("nan"))
        KERNEL(out, q, k_cache, v_cache, block_tables, lens, scale)
        torch.testing.assert_close(out.float(), reference(q, k_cache, v_cache, block_tables, lens, scale), atol=TOL[dtype], rtol=TOL[dtype])
