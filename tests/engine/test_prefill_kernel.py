"""The C++ prompt-chunk attention kernel (`paged_prefill`) against fp32 causal attention over the
gathered K/V: fresh prompts and chunks continuing a cached context, several chunks of ragged lengths
in one call (not multiples of the 16-token tile or of the block), GQA groups of 1 to 7 heads, block
sizes below and above the 16-token chunk, strided q/out views."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from serve_app.engine import cpu_kernels
from serve_app.engine.attention import _gather

KERNEL = cpu_kernels.op("paged_prefill")
SUPPORTED = cpu_kernels.op("paged_prefill_supported")
pytestmark = pytest.mark.skipif(KERNEL is None or not SUPPORTED(64), reason="no AVX512-BF16 build of the prefill kernel here")

TOL = 2e-2  # bf16 output (one rounding: 2^-8 relative) and bf16 softmax weights in P.V


def reference(q, k_cache, v_cache, block_tables, query_start, start_pos, scale):
    """fp32 causal attention per chunk over its gathered context: [T, H, D]."""
    out = torch.zeros(q.shape, dtype=torch.float32)
    hkv = k_cache.shape[2]
    for s in range(len(start_pos)):
        a, b, p0 = int(query_start[s]), int(query_start[s + 1]), int(start_pos[s])
        n = b - a
        ctx = p0 + n
        k = _gather(k_cache, block_tables[s : s + 1])[0, :, :ctx].float()  # [Hkv, ctx, D]
        v = _gather(v_cache, block_tables[s : s + 1])[0, :, :ctx].float()
        qs = q[a:b].float().transpose(0, 1)  # [H, n, D]
        mask = torch.arange(ctx).unsqueeze(0) <= (p0 + torch.arange(n)).unsqueeze(1)
        g = q.shape[1] // hkv
        o = F.scaled_dot_product_attention(qs, k.repeat_interleave(g, 0), v.repeat_interleave(g, 0), attn_mask=mask, scale=scale)
        out[a:b] = o.transpose(0, 1)
    return out


def run_case(chunks, heads=9, kv_heads=3, head_dim=64, block_size=16, seed=0, scale=None, q_spread=1.0):
    """chunks: [(start_pos, num_tokens)], one per sequence, each with its own scattered blocks."""
    gen = torch.Generator().manual_seed(seed)
    max_blocks = max(-(-(p + n) // block_size) for p, n in chunks)
    num_blocks = len(chunks) * max_blocks + 3
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to(torch.bfloat16)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to(torch.bfloat16)
    block_tables = torch.randperm(num_blocks, generator=gen)[: len(chunks) * max_blocks].view(len(chunks), max_blocks)
    counts = torch.tensor([n for _, n in chunks])
    query_start = torch.cat([torch.zeros(1, dtype=torch.long), counts.cumsum(0)]).to(torch.int32)
    start_pos = torch.tensor([p for p, _ in chunks], dtype=torch.int32)
    q = (q_spread * torch.randn(int(counts.sum()), heads, head_dim, generator=gen)).to(torch.bfloat16)
    out = torch.full_like(q, float("nan"))
    scale = head_dim**-0.5 if scale is None else scale
    KERNEL(out, q, k_cache, v_cache, block_tables, query_start, start_pos, scale)
    torch.testing.assert_close(out.float(), reference(q, k_cache, v_cache, block_tables, query_start, start_pos, scale), atol=TOL, rtol=TOL)


@pytest.mark.parametrize("head_dim", [64, 128])
def test_fresh_prompts_of_ragged_lengths(head_dim):
    run_case([(0, 1), (0, 16), (0, 37), (0, 128), (0, 200)], head_dim=head_dim)


def test_continuing_chunks_over_cached_context():
    """Chunks after a cached prefix, starting inside a block and on a block boundary, mixed with fresh ones."""
    run_case([(512, 512), (5, 1), (37, 70), (0, 33), (16, 16), (100, 3)], seed=1)


@pytest.mark.parametrize("block_size", [8, 32, 64])
def test_block_sizes(block_size):
    run_case([(0, 90), (29, 51), (64, 17)], block_size=block_size, seed=block_size)


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 2), (14, 2), (12, 3)])
def test_gqa_groups(heads, kv_heads):
    """Groups of 1, 4, 7 (a pass of 4 heads, then 3) and 4 query heads per KV head."""
    run_case([(0, 45), (20, 30)], heads=heads, kv_heads=kv_heads, seed=heads)


def test_peaked_softmax_and_large_scale():
    """Scores over a wide range (most weights underflow) and a running max that moves a lot."""
    run_case([(0, 150), (300, 40)], scale=2.0, q_spread=3.0, seed=5)


def test_strided_views_and_empty_chunks():
    """The runner passes row slices of [T, H, D] tensors; rows outside the given range stay untouched;
    a chunk may own no rows."""
    gen = torch.Generator().manual_seed(3)
    k_cache = torch.randn(8, 16, 2, 64, generator=gen).to(torch.bfloat16)
    v_cache = torch.randn(8, 16, 2, 64, generator=gen).to(torch.bfloat16)
    block_tables = torch.tensor([[3, 5], [7, 0], [1, 2]])
    query_start = torch.tensor([0, 20, 20, 29], dtype=torch.int32)
    start_pos = torch.tensor([0, 4, 3], dtype=torch.int32)
    q_full = torch.randn(40, 4, 64, generator=gen).to(torch.bfloat16)
    out_full = torch.zeros(40, 4, 64, dtype=torch.bfloat16)
    KERNEL(out_full[5:34], q_full[5:34], k_cache, v_cache, block_tables, query_start, start_pos, 0.125)
    expected = reference(q_full[5:34], k_cache, v_cache, block_tables, query_start, start_pos, 0.125)
    torch.testing.assert_close(out_full[5:34].float(), expected, atol=TOL, rtol=TOL)
    assert out_full[:5].abs().sum() == 0 and out_full[34:].abs().sum() == 0


def test_rejects_other_dtypes():
    q = torch.randn(2, 2, 64)
    cache = torch.randn(2, 16, 2, 64)
    with pytest.raises(RuntimeError, match="bfloat16 only"):
        KERNEL(torch.empty_like(q), q, cache, cache, torch.zeros(1, 1, dtype=torch.long), torch.tensor([0, 2], dtype=torch.int32),
               torch.zeros(1, dtype=torch.int32), 1.0)



def test_model_steps_against_reference_and_decode_kernel_rows(model_dir, prompt_ids, monkeypatch):
    """bf16, real model, prompts chunked over several steps (continuing chunks) and mixed with decodes:
    every call's output is within bf16 tolerance of the fp32 reference and no further from it than the
    decode kernel's rows over the same inputs. Fresh chunks past KERNEL_MAX_FRESH_CHUNK (lowered to 20)
    go to the kernel too. (Greedy tokens are not compared: the two kernels round differently, and one
    of these prompts' bf16 continuations flips on that.)"""
    from serve_app.engine import LLM, SamplingParams, attention_metadata

    monkeypatch.setattr(attention_metadata, "KERNEL_MAX_FRESH_CHUNK", 20)
    llm = LLM(model_dir, dtype="bfloat16", kv_cache_memory_gib=0.1, max_num_batched_tokens=48)
    runner = llm.engine.core.model_runner
    assert runner.prefill_kernel is not None
    decode_rows = cpu_kernels.op("paged_decode")
    starts, fresh_lengths = [], []

    def checked(out, q, k_cache, v_cache, block_tables, query_start, start_pos, scale):
        KERNEL(out, q, k_cache, v_cache, block_tables, query_start, start_pos, scale)
        expected = reference(q, k_cache, v_cache, block_tables, query_start, start_pos, scale)
        counts = (query_start[1:] - query_start[:-1]).long()
        lens = torch.cat([torch.arange(int(p) + 1, int(p + n) + 1) for p, n in zip(start_pos, counts, strict=True)]).to(torch.int32)
        rows = torch.empty_like(out)
        decode_rows(rows, q, k_cache, v_cache, block_tables.repeat_interleave(counts, 0), lens, scale)
        torch.testing.assert_close(out.float(), expected, atol=TOL, rtol=TOL)
        assert (out.float() - expected).abs().max() <= 1.25 * (rows.float() - expected).abs().max() + 1e-3
        starts.extend(start_pos.tolist())
        fresh_lengths.extend(int(n) for p, n in zip(start_pos, counts, strict=True) if p == 0)

    runner.prefill_kernel = checked
    llm.generate(prompt_ids[:6], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    assert 0 in starts and any(p > 0 for p in starts)  # fresh and continuing chunks
    assert max(fresh_lengths) > 20
