"""The Triton kernels (KV write by slot mapping, varlen paged attention) against the reference path.

Run by Triton's interpreter on CPU tensors when no GPU is present (`TRITON_INTERPRET=1`, set here
before the kernels' module is first imported): slow, so the shapes stay small. Each case has
random caches, scattered block tables, ragged lengths, decodes and prompt chunks with and without
cached context in one call, and grouped-query heads.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")
if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("no GPU and TRITON_INTERPRET is not set (tests/conftest.py sets it)", allow_module_level=True)
from serve_app.engine import attention_triton as kernels  # noqa: E402
from serve_app.engine.attention import _gather, write_kv  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # the interpreter's own numpy use
TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2}


def reference(q, k_cache, v_cache, block_tables, seq_lens, query_lens, scale):
    """Per sequence: gather its context, attend causally with SDPA in fp32."""
    out, start = [], 0
    hkv = k_cache.shape[2]
    for s, (ctx, n) in enumerate(zip(seq_lens.tolist(), query_lens, strict=True)):
        kp = _gather(k_cache, block_tables[s : s + 1].long())[:, :, :ctx].float()  # [1, Hkv, ctx, D]
        vp = _gather(v_cache, block_tables[s : s + 1].long())[:, :, :ctx].float()
        qp = q[start : start + n].float().transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
        mask = torch.arange(ctx, device=q.device).unsqueeze(0) <= torch.arange(ctx - n, ctx, device=q.device).unsqueeze(1)
        o = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=mask, scale=scale, enable_gqa=q.shape[1] != hkv)
        out.append(o[0].transpose(0, 1))
        start += n
    return torch.cat(out)


def make_case(seq_lens, query_lens, heads, kv_heads, head_dim, block_size, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    max_blocks = max(-(-c // block_size) for c in seq_lens)
    num_blocks = len(seq_lens) * max_blocks + 2
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype).to(DEVICE)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype).to(DEVICE)
    tables = torch.randperm(num_blocks, generator=gen)[: len(seq_lens) * max_blocks].view(len(seq_lens), max_blocks)
    q = torch.randn(sum(query_lens), heads, head_dim, generator=gen).to(dtype).to(DEVICE)
    qsl = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    return q, k_cache, v_cache, tables.to(torch.int32).to(DEVICE), torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE), qsl


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,block_size", [(6, 2, 16), (4, 4, 32)])
def test_varlen_attention_matches_reference(dtype, heads, kv_heads, block_size):
    # two decodes (one at context 1), a prompt chunk from position 0, a chunk after cached context
    seq_lens, query_lens = [1, 37, 21, 50], [1, 1, 21, 13]
    q, kc, vc, tables, lens, qsl = make_case(seq_lens, query_lens, heads, kv_heads, 64, block_size, dtype)
    out = torch.full_like(q, float("nan"))
    kernels.paged_attention_varlen(out, q, kc, vc, tables, lens, qsl, max(query_lens), 0.125)
    torch.testing.assert_close(out.float(), reference(q, kc, vc, tables, lens, query_lens, 0.125), atol=TOL[dtype], rtol=TOL[dtype])


def test_sequences_without_queries_are_left_alone():
    """Padding sequences of a captured batch (no queries, length 0) neither write nor fail."""
    q, kc, vc, tables, lens, _ = make_case([9, 1], [1, 1], 2, 1, 64, 16, torch.float32)
    lens = torch.tensor([9, 0, 0], dtype=torch.int32, device=DEVICE)
    tables = torch.cat([tables, torch.zeros_like(tables[:1])])
    qsl = torch.tensor([0, 1, 1, 1], dtype=torch.int32, device=DEVICE)
    out = torch.zeros_like(q)
    kernels.paged_attention_varlen(out, q, kc, vc, tables, lens, qsl, 1, 0.125)
    torch.testing.assert_close(out[:1], reference(q[:1], kc, vc, tables[:1], lens[:1], [1], 0.125))
    assert out[1:].abs().sum() == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_kv_matches_index_copy(dtype):
    gen = torch.Generator().manual_seed(3)
    qkv = torch.randn(5, 8, 64, generator=gen).to(dtype).to(DEVICE)  # strided K and V views, as the model has
    k, v = qkv[:, 4:6], qkv[:, 6:8]
    slots = torch.tensor([17, 3, -1, 40, 0], device=DEVICE)
    k_cache = torch.zeros(4, 16, 2, 64, dtype=dtype, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    kernels.store_kv(k, v, k_cache, v_cache, slots)
    ref_k, ref_v = torch.zeros_like(k_cache), torch.zeros_like(v_cache)
    keep = slots >= 0
    write_kv(k[keep], v[keep], ref_k, ref_v, slots[keep])
    assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v)


def test_engine_on_triton_kernels_matches_hf(tmp_path):
    """The whole engine with attention_backend=triton against HF greedy tokens (HF on the CPU):
    prompts sharing a prefix (prefix-cache hits), chunked prefill (a 40-token budget), decodes. The
    engine runs on the kernels' device: interpreted on a CPU, on CUDA (with decode CUDA graphs) on a
    GPU, where Triton on a CPU tensor is refused (no TRITON_INTERPRET there)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from serve_app.engine import LLM, SamplingParams

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=True)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    model.save_pretrained(tmp_path)
    shared = list(range(40, 80))
    prompts = [[5, 17, 200, 42, 7], shared + [1, 2, 3], list(range(100, 133)), shared + [9]]
    llm = LLM(str(tmp_path), dtype="float32", device=DEVICE, attention_backend="triton", block_size=16, num_blocks=32, max_num_batched_tokens=40)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    with torch.no_grad():
        expected = [model.generate(torch.tensor([p]), max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=0)[0, len(p):].tolist()
                    for p in prompts]
    assert [list(o.token_ids) for o in outs] == expected
    llm.engine.core.block_manager.check_integrity()
