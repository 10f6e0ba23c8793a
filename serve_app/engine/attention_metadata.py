"""A step's row order and its `PagedAttentionMetadata` (attention.py), for the CPU kernels and the
reference path.

The model runner sorts a step's requests by `kernel_rank` before it builds the step's inputs, so that
each attention path reads one contiguous run of rows: the decode rows first, then the prompt chunks
the prompt-chunk kernel attends, then those torch's SDPA does. `paged_metadata` turns a step built in
that order (`input_batch.StepInputs`) into what every layer's attention reads: the decode rows' block
tables and context lengths (or, without the decode kernel, the reference path's mask), the kernel's
prompt chunks, and each SDPA chunk's block table and causal mask.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from serve_app.engine.attention import DecodeRows, KernelChunks, PagedAttentionMetadata, PrefillChunk
from serve_app.engine.input_batch import StepInputs
from serve_app.engine.outputs import ScheduledRequest

# Without the prompt-chunk kernel (`cpu_kernels.paged_prefill`), a fresh prompt chunk up to this many
# tokens is attended by the CPU decode kernel, one row per token over its causal context (its K/V are
# in the cache by then), instead of torch's SDPA: measured in bf16 at SmolLM2's shapes, 16 prompts x
# 128 tokens 2.7x faster, 4 x 512 1.9x, 2 x 1,024 1.3x, one of 2,048 0.92x. A chunk that continues a
# request (start_pos > 0) always goes to a kernel: the torch path would gather its whole context and
# run a full masked attention. With the prompt-chunk kernel every prompt chunk goes to it (one of
# 2,048 fresh tokens: attention 3.9-4.7x faster than SDPA, the step 2.1x; docs/engine-kernels.md).
KERNEL_MAX_FRESH_CHUNK = 1024


def is_decode(s: ScheduledRequest) -> bool:
    """Rows at output positions: a decode, a verification with proposed tokens, a recomputed run of
    generated tokens (one decode row each). A chunk of prompt tokens is never one, even of a single
    token: each position's K/V always comes from the same kernel, whatever the chunking."""
    return not s.reads_prompt or bool(s.spec_token_ids)


def kernel_rank(s: ScheduledRequest, kernel: bool = True, chunk_kernel: bool = False, invariant: bool = False) -> int:
    """A step's requests in row order: decodes (0), then the prompt chunks a kernel attends (1, only
    with a decode `kernel`: all of them with the prompt-chunk kernel or when batch `invariant`, else
    those within KERNEL_MAX_FRESH_CHUNK or continuing a request), then those torch's SDPA does (2);
    each group a contiguous run of rows. Ranks 0 and 1 are the rows `paged_metadata` hands to the
    block-table paths."""
    if is_decode(s):
        return 0
    if not kernel:
        return 2
    return 1 if chunk_kernel or invariant or s.start_pos > 0 or s.num_tokens <= KERNEL_MAX_FRESH_CHUNK else 2


@dataclass(frozen=True)
class AttentionKernels:
    """The CPU attention kernels a runner's paths use this step (None: not on those paths)."""

    decode: Callable | None  # cpu_kernels.paged_decode
    prefill: Callable | None  # cpu_kernels.paged_prefill (only with the decode kernel)
    invariant: bool  # batch invariant: every prompt chunk to a kernel, whatever its length

    def rank(self, s: ScheduledRequest) -> int:
        return kernel_rank(s, self.decode is not None, self.prefill is not None, self.invariant)

    def order(self, scheduled: Sequence[ScheduledRequest]) -> list[ScheduledRequest]:
        """A step's requests in row order (`kernel_rank`; stable)."""
        return sorted(scheduled, key=self.rank)


def paged_metadata(step: StepInputs, scheduled: Sequence[ScheduledRequest], kernels: AttentionKernels,
                   block_size: int) -> PagedAttentionMetadata:
    """The attention metadata of `step`, built from `scheduled` in `kernels.order`. A verification (a
    decode with proposed tokens), and with the decode kernel a prompt chunk, runs as one decode row
    per token, each over the context up to its own position: its K/V are all written before
    attention, so that is exactly causal attention. With the prompt-chunk kernel, the chunks of rank 1
    go to it instead (`KernelChunks`), whole."""
    end = next((i for i, s in enumerate(scheduled) if kernels.rank(s) == 2), len(scheduled))
    b = end  # requests attended as decode rows
    if kernels.prefill is not None:
        b = next((i for i, s in enumerate(scheduled[:end]) if kernels.rank(s) == 1), end)
    return PagedAttentionMetadata(
        slot_mapping=step.slot_mapping,
        decode_rows=_decode_rows(step, scheduled[:b], kernels.decode, block_size) if b else None,
        kernel_chunks=_kernel_chunks(step, scheduled, b, end, kernels.prefill) if b < end else None,
        prefills=tuple(_prefill_chunk(step, i, scheduled[i]) for i in range(end, len(scheduled))),
    )


def _decode_rows(step: StepInputs, requests: Sequence[ScheduledRequest], kernel: Callable | None, block_size: int) -> DecodeRows:
    """The step's first `len(requests)` requests as decode rows, one per token."""
    b = len(requests)
    device = step.positions.device
    num_rows = sum(s.num_tokens for s in requests)
    max_blocks = max(len(s.block_table) for s in requests)
    if num_rows == b:  # plain decodes: the persistent inputs as they are
        block_tables = step.block_tables[:b, :max_blocks].to(torch.long, memory_format=torch.contiguous_format)
        context_lens = step.seq_lens[:b]
    else:  # verifications, prompt chunks: one row per token, each with its request's table and its own context
        rows_per_seq = torch.tensor([s.num_tokens for s in requests], dtype=torch.long, device=device)
        block_tables = step.block_tables[:b, :max_blocks].to(torch.long).repeat_interleave(rows_per_seq, dim=0)
        context_lens = (step.positions[:num_rows] + 1).to(step.seq_lens.dtype)
    mask = None
    if kernel is None:
        keys = torch.arange(max_blocks * block_size, device=device)
        mask = (keys.unsqueeze(0) < context_lens.unsqueeze(1)).view(num_rows, 1, 1, -1)
    return DecodeRows(num_rows, block_tables, context_lens, kernel, mask)


def _kernel_chunks(step: StepInputs, scheduled: Sequence[ScheduledRequest], b: int, end: int, kernel: Callable) -> KernelChunks:
    """Requests `b .. end - 1` of the step as prompt chunks for the prompt-chunk kernel."""
    chunks = scheduled[b:end]
    qsl = step.query_start_loc[b : end + 1]
    return KernelChunks(
        num_rows=sum(s.num_tokens for s in chunks),
        block_tables=step.block_tables[b:end, : max(len(s.block_table) for s in chunks)].to(
            torch.long, memory_format=torch.contiguous_format),
        query_start=(qsl - qsl[0]).to(torch.int32),
        start_pos=torch.tensor([s.start_pos for s in chunks], dtype=torch.int32, device=step.positions.device),
        kernel=kernel,
    )


def _prefill_chunk(step: StepInputs, i: int, s: ScheduledRequest) -> PrefillChunk:
    """The step's request `i` as a prompt chunk for torch's SDPA: from the fresh K/V when it starts at
    position 0, else through its block table under a causal mask over its whole context."""
    table = chunk_mask = None
    if s.start_pos > 0:
        device = step.positions.device
        table = step.block_tables[i, : len(s.block_table)].long()
        q_pos = torch.arange(s.start_pos, s.context_len, device=device)
        chunk_mask = torch.arange(s.context_len, device=device).unsqueeze(0) <= q_pos.unsqueeze(1)
    return PrefillChunk(int(step.host_query_start_loc[i]), s.num_tokens, s.start_pos, table, chunk_mask)
