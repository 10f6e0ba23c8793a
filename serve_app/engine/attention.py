"""Paged attention over a block-structured KV cache.

Cache layout per layer: `k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]`.
A token at position p of a request lives in slot `block_table[p // block_size] * block_size + p % block_size`.

One forward pass mixes requests: the flattened batch holds the decode tokens first (one query each),
then each prompt chunk's tokens. Every layer writes the new K/V through `slot_mapping`, then
- decodes attend over their whole context, read back through their block tables (one batched call),
- each prompt chunk attends causally over its context: straight from the fresh K/V when the chunk
  starts at position 0, else through its block table (chunked prefill, prefix-cache hits, recompute).

On CPU the decode part runs a C++ kernel (`cpu_kernels.paged_decode`) that reads the blocks in place;
elsewhere (and as the reference) it gathers the blocks and calls `scaled_dot_product_attention`.
With the kernel, the model runner also takes most prompt chunks off the prompt path below
(`model_runner.kernel_rank`; only long fresh chunks stay there): in bf16 where the build has
AVX512-BF16, the C++ prompt-chunk kernel (`cpu_kernels.paged_prefill`, `KernelChunks`) attends them
through their block tables, 16 query tokens at a time; otherwise the decode kernel takes them as rows,
one per token, each with its request's block table and its own causal context.
A step may instead carry a whole-step implementation (`impl`: the Triton kernels or FlashInfer, on
CUDA) that reads every sequence, decode or prompt chunk, in place through the step's block tables.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class PrefillChunk:
    token_start: int  # offset in the flattened batch
    num_tokens: int
    start_pos: int  # position of the first token in its request
    block_table: torch.Tensor | None  # [num_blocks] (None when start_pos == 0: fresh K/V suffice)
    mask: torch.Tensor | None  # [num_tokens, context_len] bool, True = attend (None when start_pos == 0)


@dataclass(frozen=True)
class KernelChunks:
    """Prompt chunks for `cpu_kernels.paged_prefill`: the rows right after the decode rows, chunk s
    owning rows `query_start[s]:query_start[s + 1]` of that run, its first at position `start_pos[s]`."""

    num_rows: int
    block_tables: torch.Tensor  # [S, max_blocks] long (padded with 0)
    query_start: torch.Tensor  # [S + 1] int32, from 0
    start_pos: torch.Tensor  # [S] int32
    kernel: Callable


@dataclass(frozen=True)
class AttentionMetadata:
    """Built once per step by the model runner, shared by every layer."""

    slot_mapping: torch.Tensor  # [num_tokens] long
    num_decodes: int  # rows attended by the decode kernel / its reference: decodes, verifications, prompt rows (kernel_rank 1) without kernel_chunks
    decode_block_tables: torch.Tensor | None  # [num_decodes, max_blocks] long (padded with 0)
    decode_context_lens: torch.Tensor | None  # [num_decodes] int
    decode_mask: torch.Tensor | None  # [num_decodes, 1, 1, max_blocks * block_size] bool (reference path)
    prefills: tuple[PrefillChunk, ...]
    decode_kernel: Callable | None = None  # C++ kernel (CPU) or None for the reference path
    # impl(q, k, v, k_cache, v_cache, step, scale) -> [T, H, D] replaces all of the above (a varlen
    # backend over `step`, an input_batch.StepInputs)
    impl: Callable | None = None
    step: Any = None
    kernel_chunks: KernelChunks | None = None  # the prompt chunks after the decode rows, for the C++ prompt-chunk kernel


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """k, v: [num_tokens, num_kv_heads, head_dim] → their slots in the cache."""
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v)


def _gather(cache: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
    """[num_blocks, bs, Hkv, D] by [B, nb] → [B, Hkv, nb * bs, D] (a copy)."""
    b, nb = block_tables.shape
    gathered = cache[block_tables]  # [B, nb, bs, Hkv, D]
    return gathered.view(b, nb * cache.shape[1], cache.shape[2], cache.shape[3]).transpose(1, 2)


def paged_attention(
    q: torch.Tensor,  # [T, H, D]
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    kv_written: bool = False,
) -> torch.Tensor:
    """Returns [T, H, D]. `kv_written`: k and v are in their cache slots already (a fused op put them there)."""
    if meta.impl is not None:
        return meta.impl(q, k, v, k_cache, v_cache, meta.step, scale)
    if not kv_written:
        write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    group = num_heads // num_kv_heads
    out = torch.empty_like(q)
    b = meta.num_decodes
    if b:
        if meta.decode_kernel is not None:
            meta.decode_kernel(out[:b], q[:b], k_cache, v_cache, meta.decode_block_tables, meta.decode_context_lens, scale)
        else:
            qd = q[:b].view(b, num_kv_heads, group, head_dim)  # the G query heads of a KV head act as G queries
            kd = _gather(k_cache, meta.decode_block_tables)
            vd = _gather(v_cache, meta.decode_block_tables)
            od = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=meta.decode_mask, scale=scale)
            out[:b] = od.reshape(b, num_heads, head_dim)
    chunks = meta.kernel_chunks
    if chunks is not None:
        e = b + chunks.num_rows
        chunks.kernel(out[b:e], q[b:e], k_cache, v_cache, chunks.block_tables, chunks.query_start, chunks.start_pos, scale)
    for chunk in meta.prefills:
        s, e = chunk.token_start, chunk.token_start + chunk.num_tokens
        qp = q[s:e].transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
        if chunk.block_table is None:
            kp = k[s:e].transpose(0, 1).unsqueeze(0)  # [1, Hkv, n, D]
            vp = v[s:e].transpose(0, 1).unsqueeze(0)
            op = F.scaled_dot_product_attention(qp, kp, vp, is_causal=True, scale=scale, enable_gqa=group > 1)
        else:
            ctx = chunk.mask.shape[1]
            kp = _gather(k_cache, chunk.block_table.unsqueeze(0))[:, :, :ctx]
            vp = _gather(v_cache, chunk.block_table.unsqueeze(0))[:, :, :ctx]
            op = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=chunk.mask, scale=scale, enable_gqa=group > 1)
        out[s:e] = op[0].transpose(0, 1)
    return out
