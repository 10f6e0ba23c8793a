"""A step's row order and paged attention metadata (attention_metadata), on plain tensors: which
rows each attention path gets, and that on every path a mixed step (decodes, a verification, fresh,
continuing and long prompt chunks) attends each token over exactly its request's causal context."""

from __future__ import annotations

import pytest
import torch

from serve_app.engine import attention_metadata, cpu_kernels
from serve_app.engine.attention import paged_attention
from serve_app.engine.attention_metadata import AttentionKernels, is_decode, kernel_rank, paged_metadata
from serve_app.engine.input_batch import InputBatch
from serve_app.engine.outputs import ScheduledRequest
from serve_app.types import SamplingParams

HEADS, KV_HEADS, HEAD_DIM, BLOCK, NUM_BLOCKS = 4, 2, 64, 4, 48
SCALE = HEAD_DIM**-0.5
DECODE = cpu_kernels.op("paged_decode")
PREFILL = cpu_kernels.op("paged_prefill")
PREFILL_SUPPORTED = cpu_kernels.op("paged_prefill_supported")


def sched(rid: str, num_tokens: int, start_pos: int, prompt: bool, spec: int = 0, table: tuple[int, ...] = (0,)) -> ScheduledRequest:
    tokens = tuple(range(num_tokens))
    return ScheduledRequest(rid, tokens, start_pos, table, True, prompt, SamplingParams(), None,
                            spec_token_ids=tokens[num_tokens - spec :] if spec else ())


def test_ranks_put_decode_rows_first_then_kernel_chunks_then_sdpa_chunks(monkeypatch):
    monkeypatch.setattr(attention_metadata, "KERNEL_MAX_FRESH_CHUNK", 8)
    decode, verify = sched("d", 1, 5, False), sched("v", 3, 7, False, spec=2)
    single_prompt_token, recompute = sched("p1", 1, 3, True), sched("g", 4, 9, False)
    short, long, continuing = sched("s", 8, 0, True), sched("l", 9, 0, True), sched("c", 20, 4, True)
    assert is_decode(decode) and is_decode(verify) and is_decode(recompute) and not is_decode(single_prompt_token)
    assert [kernel_rank(s) for s in (decode, verify, short, long, continuing)] == [0, 0, 1, 2, 1]
    assert [kernel_rank(s, kernel=False) for s in (decode, short, continuing)] == [0, 2, 2]
    assert kernel_rank(long, chunk_kernel=True) == 1 and kernel_rank(long, invariant=True) == 1
    assert kernel_rank(long, kernel=False, chunk_kernel=True, invariant=True) == 2  # no decode kernel: no kernel rows
    step = [long, short, decode, continuing, verify]
    assert [s.request_id for s in AttentionKernels(DECODE, None, False).order(step)] == ["d", "v", "s", "c", "l"]
    assert [s.request_id for s in AttentionKernels(None, None, False).order(step)] == ["d", "v", "l", "s", "c"]  # stable


def mixed_step(gen: torch.Generator) -> list[ScheduledRequest]:
    """Scattered block tables; listed out of row order."""
    shapes = [("long", 12, 0, True, 0), ("fresh", 5, 0, True, 0), ("cont", 6, 4, True, 0),
              ("verify", 3, 7, False, 2), ("decode", 1, 5, False, 0)]
    blocks = torch.randperm(NUM_BLOCKS, generator=gen).tolist()
    out = []
    for rid, n, start, prompt, spec in shapes:
        need = -(-(start + n) // BLOCK)
        out.append(sched(rid, n, start, prompt, spec, tuple(blocks[:need])))
        blocks = blocks[need:]
    return out


def causal_reference(scheduled, q, contexts) -> torch.Tensor:
    """Each token over its request's K/V at positions 0 .. its own, in fp32."""
    out = torch.empty(q.shape, dtype=torch.float32)
    group, at = HEADS // KV_HEADS, 0
    for s in scheduled:
        k_all, v_all = contexts[s.request_id]
        for j in range(s.num_tokens):
            p = s.start_pos + j
            qh = q[at + j].float().view(KV_HEADS, group, HEAD_DIM)
            weights = (torch.einsum("kgd,tkd->kgt", qh, k_all[: p + 1].float()) * SCALE).softmax(-1)
            out[at + j] = torch.einsum("kgt,tkd->kgd", weights, v_all[: p + 1].float()).reshape(HEADS, HEAD_DIM)
        at += s.num_tokens
    return out


PATHS = {
    "reference": (None, None, torch.float32, 1e-5),
    "decode_kernel": (DECODE, None, torch.float32, 2e-5),
    "both_kernels": (DECODE, PREFILL, torch.bfloat16, 2e-2),
}


@pytest.mark.parametrize("path", list(PATHS))
def test_every_token_attends_its_own_causal_context(monkeypatch, path):
    decode, prefill, dtype, tol = PATHS[path]
    if path != "reference" and decode is None:
        pytest.skip("the C++ decode kernel could not be built here")
    if prefill is not None and not (PREFILL_SUPPORTED is not None and PREFILL_SUPPORTED(HEAD_DIM)):
        pytest.skip("the prompt-chunk kernel does not run here (bf16, AVX512-BF16)")
    monkeypatch.setattr(attention_metadata, "KERNEL_MAX_FRESH_CHUNK", 8)
    gen = torch.Generator().manual_seed(0)
    kernels = AttentionKernels(decode, prefill, False)
    scheduled = kernels.order(mixed_step(gen))
    step = InputBatch(BLOCK, torch.device("cpu")).build(scheduled)
    meta = paged_metadata(step, scheduled, kernels, BLOCK)

    # every request's K/V at every position of its context; the cache holds those before the step
    contexts = {s.request_id: (torch.randn(s.context_len, KV_HEADS, HEAD_DIM, generator=gen).to(dtype),
                               torch.randn(s.context_len, KV_HEADS, HEAD_DIM, generator=gen).to(dtype)) for s in scheduled}
    k_cache = torch.zeros(NUM_BLOCKS, BLOCK, KV_HEADS, HEAD_DIM, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    for s in scheduled:
        for p in range(s.start_pos):
            block, offset = s.block_table[p // BLOCK], p % BLOCK
            k_cache[block, offset], v_cache[block, offset] = contexts[s.request_id][0][p], contexts[s.request_id][1][p]
    k = torch.cat([contexts[s.request_id][0][s.start_pos :] for s in scheduled])
    v = torch.cat([contexts[s.request_id][1][s.start_pos :] for s in scheduled])
    q = torch.randn(step.num_tokens, HEADS, HEAD_DIM, generator=gen).to(dtype)

    out = paged_attention(q, k, v, k_cache, v_cache, meta, SCALE)
    torch.testing.assert_close(out.float(), causal_reference(scheduled, q, contexts), atol=tol, rtol=tol)

    # which path took which rows: decode rows first (1 + 3), then, in the order they came, the prompt
    # chunks a kernel takes, then those SDPA takes
    order = [s.request_id for s in scheduled]
    rows = meta.decode_rows
    assert rows.kernel is decode and (rows.mask is None) == (decode is not None)
    per_row_tables = rows.block_tables.tolist()
    assert per_row_tables[:3] == [per_row_tables[0]] * 3 and per_row_tables[0][:3] == list(scheduled[0].block_table)
    sdpa = [(c.token_start, c.num_tokens, c.start_pos, c.block_table is None) for c in meta.prefills]
    if path == "reference":  # every prompt chunk to SDPA, the continuing one through its table
        assert order == ["verify", "decode", "long", "fresh", "cont"] and rows.context_lens.tolist() == [8, 9, 10, 6]
        assert meta.kernel_chunks is None and sdpa == [(4, 12, 0, True), (16, 5, 0, True), (21, 6, 4, False)]
        assert meta.prefills[2].mask.shape == (6, 10)
    elif path == "decode_kernel":  # short and continuing chunks as decode rows, one per token
        assert order == ["verify", "decode", "fresh", "cont", "long"]
        assert rows.context_lens.tolist() == [8, 9, 10, 6, *range(1, 6), *range(5, 11)]
        assert meta.kernel_chunks is None and sdpa == [(15, 12, 0, True)]
    else:  # every prompt chunk to the prompt-chunk kernel, whole
        assert order == ["verify", "decode", "long", "fresh", "cont"] and rows.context_lens.tolist() == [8, 9, 10, 6]
        chunks = meta.kernel_chunks
        assert chunks.num_rows == 23 and chunks.query_start.tolist() == [0, 12, 17, 23] and chunks.start_pos.tolist() == [0, 0, 4]
        assert chunks.block_tables.shape == (3, 3) and sdpa == []


def test_plain_decodes_read_the_step_inputs_as_they_are():
    scheduled = [sched("a", 1, 6, False, table=(3, 1)), sched("b", 1, 2, False, table=(5,))]
    step = InputBatch(BLOCK, torch.device("cpu")).build(scheduled)
    rows = paged_metadata(step, scheduled, AttentionKernels(DECODE, None, False), BLOCK).decode_rows
    assert rows.num_rows == 2 and rows.context_lens.data_ptr() == step.seq_lens.data_ptr()  # no copy
    assert rows.block_tables.dtype == torch.long and rows.block_tables.is_contiguous()
    assert rows.block_tables.tolist() == [[3, 1], [5, 0]] and rows.context_lens.tolist() == [7, 3]
