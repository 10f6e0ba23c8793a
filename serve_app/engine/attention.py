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
With the kernel, most prompt chunks also leave the prompt path below (`attention_metadata.kernel_rank`
orders a step's rows for it; only long fresh chunks stay there): in bf16 where the build has
AVX512-BF16, the C++ prompt-chunk kernel (`cpu_kernels.paged_prefill`, `KernelChunks`) attends them
through their block tables, 16 query tokens at a time; otherwise the decode kernel takes them as rows,
one per token, each with its request's block table and its own causal context.
That is a `PagedAttentionMetadata`. A step may instead be a `WholeStepAttentionMetadata`: one
implementation (the Triton kernels or FlashInfer, on CUDA) that reads every sequence, decode or prompt
chunk, in place through the step's block tables.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class DecodeRows:
    """The first `num_rows` rows of the step, one query each over its own context, read through its
    request's block table: decodes, each token of a verification, and the prompt chunks of
    `kernel_rank` 1 when no prompt-chunk kernel takes them (one row per token)."""

    num_rows: int
    block_tables: torch.Tensor  # [num_rows, max_blocks] long (padded with 0)
    context_lens: torch.Tensor  # [num_rows] int
    kernel: Callable | None  # the C++ decode kernel (CPU), or None: the reference path (gather, SDPA under `mask`)
    mask: torch.Tensor | None  # [num_rows, 1, 1, max_blocks * block_size] bool, True = attend (reference path only)


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
class PrefillChunk:
    """A prompt chunk torch's SDPA attends (after every kernel row), causally over its context."""

    token_start: int  # offset in the flattened batch
    num_tokens: int
    start_pos: int  # position of the first token in its request
    block_table: torch.Tensor | None  # [num_blocks] (None when start_pos == 0: fresh K/V suffice)
    mask: torch.Tensor | None  # [num_tokens, context_len] bool, True = attend (None when start_pos == 0)


@dataclass(frozen=True)
class PagedAttentionMetadata:
    """A step attended layer by layer in this module: the K/V written through `slot_mapping`, then
    the decode rows, the kernel's prompt chunks and the SDPA prompt chunks, in that row order (each
    part absent when the step has none). Built once per step, shared by every layer."""

    slot_mapping: torch.Tensor  # [num_tokens] long
    decode_rows: DecodeRows | None
    kernel_chunks: KernelChunks | None
    prefills: tuple[PrefillChunk, ...]

    @classmethod
    def fresh_prompt(cls, num_tokens: int, device: torch.device | str = "cpu") -> PagedAttentionMetadata:
        """One prompt of `num_tokens` from position 0 in slots 0 .. num_tokens - 1 (SDPA, causal)."""
        return cls(torch.arange(num_tokens, device=device), None, None, (PrefillChunk(0, num_tokens, 0, None, None),))


@dataclass(frozen=True)
class WholeStepAttentionMetadata:
    """A step attended by one implementation over all its sequences (the Triton kernels or
    FlashInfer): `impl(q, k, v, k_cache, v_cache, step, scale) -> [T, H, D]` writes the K/V itself and
    reads every sequence, decode or prompt chunk, in place through `step` (an input_batch.StepInputs)."""

    impl: Callable
    step: Any


AttentionMetadata = PagedAttentionMetadata | WholeStepAttentionMetadata


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
    if isinstance(meta, WholeStepAttentionMetadata):
        return meta.impl(q, k, v, k_cache, v_cache, meta.step, scale)
    if not kv_written:
        write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    group = num_heads // num_kv_heads
    out = torch.empty_like(q)
    b = 0
    rows = meta.decode_rows
    if rows is not None:
        b = rows.num_rows
        if rows.kernel is not None:
            rows.kernel(out[:b], q[:b], k_cache, v_cache, rows.block_tables, rows.context_lens, scale)
        else:
            qd = q[:b].view(b, num_kv_heads, group, head_dim)  # the G query heads of a KV head act as G queries
            kd = _gather(k_cache, rows.block_tables)
            vd = _gather(v_cache, rows.block_tables)
            od = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=rows.mask, scale=scale)
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
