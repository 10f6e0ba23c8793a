"""Triton kernels for the paged KV cache: the KV write by slot mapping and varlen paged attention.

Both read and write the cache in place (no gather, no temporaries outside the KV budget) and take
only device tensors, so a decode step that uses them can be captured in a CUDA graph.

- `store_kv`: token t's K and V rows go to slot `slot_mapping[t]` (one program per token);
  a negative slot is skipped (padding rows of a captured batch).
- `paged_attention_varlen`: every sequence of the step, decodes (one query) and prompt chunks
  (many, with or without cached context) alike: sequence s owns queries
  `query_start_loc[s] : query_start_loc[s + 1]`, which sit at the last positions of its
  `seq_lens[s]` tokens, and attends causally over its context read block by block through its
  block table, with an online softmax in fp32. One program handles a tile of (query, head) rows
  that share one KV head: the G query heads of a grouped-query KV head ride in the same tile, so
  each K/V block is loaded once for all of them. A sequence with no queries does nothing.

Cache layout (as everywhere in the engine): `[num_blocks, block_size, num_kv_heads, head_dim]`.
Under `TRITON_INTERPRET=1` (set before this module is imported) the kernels run on CPU tensors:
that is how the default test suite checks them against the reference path. The interpreter
multiplies bf16 tiles wrongly, so on CPU tensors the dot products take fp32 copies (on a GPU, bf16
and fp16 tiles go to the tensor cores as they are, with fp32 accumulation).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _store_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    k_stride, v_stride,
    ROW: tl.constexpr,  # num_kv_heads * head_dim
    BLOCK: tl.constexpr,  # ROW rounded up to a power of two
):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:
        offs = tl.arange(0, BLOCK)
        mask = offs < ROW
        k = tl.load(k_ptr + t * k_stride + offs, mask=mask)
        v = tl.load(v_ptr + t * v_stride + offs, mask=mask)
        tl.store(k_cache_ptr + slot * ROW + offs, k, mask=mask)
        tl.store(v_cache_ptr + slot * ROW + offs, v, mask=mask)


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """k, v: [T, Hkv, D] (each token's heads contiguous) → slots `slot_mapping` [T] (< 0: skipped)."""
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    assert k.stride(2) == 1 and k.stride(1) == head_dim and v.stride(2) == 1 and v.stride(1) == head_dim
    assert k_cache.is_contiguous() and v_cache.is_contiguous()
    row = num_kv_heads * head_dim
    _store_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping, k.stride(0), v.stride(0), ROW=row, BLOCK=triton.next_power_of_2(row)
    )


@triton.jit
def _paged_attention_kernel(
    out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, query_start_ptr,
    scale,
    q_stride_t, q_stride_h, o_stride_t, o_stride_h, bt_stride,
    GROUP: tl.constexpr,  # query heads per KV head
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,  # HEAD_DIM rounded up to a power of two
    BLOCK_M: tl.constexpr,  # (query, head) rows per program
    BLOCK_SIZE: tl.constexpr,  # the cache's tokens per block (>= 16, a power of two)
    DOT_F32: tl.constexpr,  # dot products in exact fp32 (fp32 caches; and the interpreter, whose bf16 dot is wrong)
):
    seq = tl.program_id(0)
    tile = tl.program_id(1)
    kv_head = tl.program_id(2)
    q_start = tl.load(query_start_ptr + seq)
    q_len = tl.load(query_start_ptr + seq + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + seq)
    if tile * BLOCK_M < q_len * GROUP:
        rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        row_mask = rows < q_len * GROUP
        tok = rows // GROUP  # query index within the sequence
        head = kv_head * GROUP + rows % GROUP
        offs_d = tl.arange(0, BLOCK_D)
        d_mask = offs_d < HEAD_DIM
        q_off = (q_start + tok).to(tl.int64)[:, None] * q_stride_t + head[:, None] * q_stride_h + offs_d[None, :]
        q = tl.load(q_ptr + q_off, mask=row_mask[:, None] & d_mask[None, :], other=0.0)
        q_pos = seq_len - q_len + tok  # position of each row's query
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        # keys up to the last query of this tile (causal), never past the sequence
        last_tok = tl.minimum((tile * BLOCK_M + BLOCK_M - 1) // GROUP, q_len - 1)
        num_blocks = tl.cdiv(seq_len - q_len + last_tok + 1, BLOCK_SIZE)
        offs_n = tl.arange(0, BLOCK_SIZE)
        for blk in range(0, num_blocks):
            phys = tl.load(block_tables_ptr + seq * bt_stride + blk).to(tl.int64)
            k_pos = blk * BLOCK_SIZE + offs_n
            kv_off = phys * (BLOCK_SIZE * NUM_KV_HEADS * HEAD_DIM) + offs_n[:, None] * (NUM_KV_HEADS * HEAD_DIM) + kv_head * HEAD_DIM + offs_d[None, :]
            kv_mask = (k_pos < seq_len)[:, None] & d_mask[None, :]
            k = tl.load(k_cache_ptr + kv_off, mask=kv_mask, other=0.0)  # [N, D]
            if DOT_F32:
                s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
            else:
                s = tl.dot(q, tl.trans(k))
            s = s * scale  # [M, N] fp32
            visible = (k_pos[None, :] <= q_pos[:, None]) & row_mask[:, None]
            s = tl.where(visible, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet
            alpha = tl.exp(m_i - m_safe)
            p = tl.exp(s - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(v_cache_ptr + kv_off, mask=kv_mask, other=0.0)
            if DOT_F32:
                pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
            else:
                pv = tl.dot(p.to(v.dtype), v)
            acc = acc * alpha[:, None] + pv
            m_i = m_new
        acc = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        o_off = (q_start + tok).to(tl.int64)[:, None] * o_stride_t + head[:, None] * o_stride_h + offs_d[None, :]
        tl.store(out_ptr + o_off, acc.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & d_mask[None, :])


def paged_attention_varlen(
    out: torch.Tensor,  # [T, H, D]
    q: torch.Tensor,  # [T, H, D] (head_dim contiguous)
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [S, max_blocks] int32/int64
    seq_lens: torch.Tensor,  # [S] int32: context length after this step's tokens
    query_start_loc: torch.Tensor,  # [S + 1] int32: cumulative query counts
    max_query_len: int,  # a bound on the queries of any sequence (sizes the grid; no device sync)
    scale: float,
) -> torch.Tensor:
    num_seqs = seq_lens.shape[0]
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    group = q.shape[1] // num_kv_heads
    assert block_size >= 16 and block_size & (block_size - 1) == 0, "block_size: the Triton kernel needs a power of two >= 16"
    assert q.stride(2) == 1 and out.stride(2) == 1 and k_cache.is_contiguous() and v_cache.is_contiguous()
    if num_seqs == 0 or max_query_len == 0:
        return out
    block_m = 16 if max_query_len * group <= 16 else 64
    grid = (num_seqs, triton.cdiv(max_query_len * group, block_m), num_kv_heads)
    _paged_attention_kernel[grid](
        out, q, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
        scale,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        GROUP=group, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_M=block_m, BLOCK_SIZE=block_size, DOT_F32=q.dtype == torch.float32 or q.device.type == "cpu",
    )
    return out


class TritonAttention:
    """The step's attention with the Triton kernels: `plan` once per step, call once per layer."""

    def plan(self, step) -> None:  # the kernels read the step's tensors directly
        pass

    def __call__(self, q, k, v, k_cache, v_cache, step, scale: float) -> torch.Tensor:
        """q: [T, H, D], k, v: [T, Hkv, D] → [T, H, D]; writes k, v into the cache first."""
        store_kv(k, v, k_cache, v_cache, step.slot_mapping)
        out = torch.empty_like(q)
        return paged_attention_varlen(
            out, q, k_cache, v_cache, step.block_tables, step.seq_lens, step.query_start_loc, step.max_query_len, scale
        )
