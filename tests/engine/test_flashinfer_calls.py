"""FlashInferAttention's calls into FlashInfer, checked on CPU against a stand-in module.

The stand-in's `__init__`, `plan` and `run` have FlashInfer's own signatures (copied from
flashinfer-ai/flashinfer 0.6: `decode.py` / `prefill.py`; the names used here are the same since
0.2), so a misspelt or misplaced argument raises TypeError here as it would there. What each call
receives is recorded and checked: the wrapper chosen per step, the page lists, dtypes and scale,
the causal flag, and the tensors `run` gets. The K/V write is the Triton kernel (interpreted on CPU).
"""

from __future__ import annotations

import os
import sys
import types

import numpy as np
import pytest
import torch

pytest.importorskip("triton")
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # the Triton interpreter's numpy use
if os.environ.get("TRITON_INTERPRET") != "1":  # CPU tensors throughout (tests/conftest.py sets it without a GPU)
    pytest.skip("the Triton K/V write runs on CPU tensors only under TRITON_INTERPRET=1", allow_module_level=True)


def _args(local_vars: dict) -> dict:
    """A call's arguments, from `locals()` at the top of the method."""
    return {k: v for k, v in local_vars.items() if k != "self"}


class BatchDecodeWithPagedKVCacheWrapper:
    def __init__(self, float_workspace_buffer, kv_layout="NHD", use_cuda_graph=False, use_tensor_cores=False,
                 paged_kv_indptr_buffer=None, paged_kv_indices_buffer=None, paged_kv_last_page_len_buffer=None,
                 backend="auto", jit_args=None):
        self.calls = []
        self.init = {"workspace": float_workspace_buffer, "kv_layout": kv_layout, "use_tensor_cores": use_tensor_cores}

    def plan(self, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size, *,
             pos_encoding_mode="NONE", window_left=-1, window_right=0, logits_soft_cap=None, q_data_type="float16",
             kv_data_type=None, o_data_type=None, data_type=None, sm_scale=None, rope_scale=None, rope_theta=None,
             non_blocking=True, block_tables=None, seq_lens=None, fixed_split_size=None, disable_split_kv=False,
             q_len_per_req=1):
        self.calls.append(("plan", _args(locals())))

    def run(self, q, paged_kv_cache, *args, q_scale=None, k_scale=None, v_scale=None, out=None, lse=None,
            return_lse=False, enable_pdl=None, window_left=None, sinks=None, q_len_per_req=None,
            skip_softmax_threshold_scale_factor=None, kv_cache_sf=None):
        self.calls.append(("run", _args(locals())))
        return torch.zeros_like(q)


class BatchPrefillWithPagedKVCacheWrapper:
    def __init__(self, float_workspace_buffer, kv_layout="NHD", use_cuda_graph=False, qo_indptr_buf=None,
                 paged_kv_indptr_buf=None, paged_kv_indices_buf=None, paged_kv_last_page_len_buf=None,
                 custom_mask_buf=None, mask_indptr_buf=None, backend="auto", jit_args=None, jit_kwargs=None):
        self.calls = []
        self.init = {"workspace": float_workspace_buffer, "kv_layout": kv_layout}

    def plan(self, qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, num_qo_heads, num_kv_heads,
             head_dim_qk, page_size, head_dim_vo=None, custom_mask=None, packed_custom_mask=None, causal=False,
             pos_encoding_mode="NONE", use_fp16_qk_reduction=False, sm_scale=None, window_left=-1,
             logits_soft_cap=None, rope_scale=None, rope_theta=None, q_data_type="float16", kv_data_type=None,
             o_data_type=None, non_blocking=True, prefix_len_ptr=None, token_pos_in_items_ptr=None,
             token_pos_in_items_len=0, max_item_len_ptr=None, seq_lens=None, seq_lens_q=None, block_tables=None,
             max_token_per_sequence=None, max_sequence_kv=None, fixed_split_size=None, disable_split_kv=False):
        self.calls.append(("plan", _args(locals())))

    def run(self, q, paged_kv_cache, *args, q_scale=None, k_scale=None, v_scale=None, out=None, lse=None,
            return_lse=False, enable_pdl=None, window_left=None, sinks=None, kv_cache_sf=None,
            skip_softmax_threshold_scale_factor=None, use_fp16_softmax=None, uses_spcompress=None):
        self.calls.append(("run", _args(locals())))
        return torch.zeros_like(q)


@pytest.fixture
def fake_flashinfer(monkeypatch):
    module = types.ModuleType("flashinfer")
    module.BatchDecodeWithPagedKVCacheWrapper = BatchDecodeWithPagedKVCacheWrapper
    module.BatchPrefillWithPagedKVCacheWrapper = BatchPrefillWithPagedKVCacheWrapper
    monkeypatch.setitem(sys.modules, "flashinfer", module)
    monkeypatch.setattr("serve_app.engine.attention_flashinfer.WORKSPACE_BYTES", 4096)  # not 128 MiB on a test machine
    return module


def _sched(token_ids, start_pos, table):
    from serve_app.engine.outputs import ScheduledRequest
    from serve_app.types import SamplingParams

    return ScheduledRequest("r", tuple(token_ids), start_pos, tuple(table), True, False, SamplingParams(), None)


def _step(scheduled, block_size=16):
    from serve_app.engine.input_batch import InputBatch

    return InputBatch(block_size, torch.device("cpu")).build(scheduled)


def test_decode_steps_plan_the_decode_wrapper(fake_flashinfer):
    from serve_app.engine.attention_flashinfer import FlashInferAttention

    attn = FlashInferAttention(6, 2, 64, 16, torch.bfloat16, 0.125, torch.device("cpu"))
    assert attn.decode.init["kv_layout"] == "NHD" and attn.prefill.init["kv_layout"] == "NHD"
    assert attn.decode.init["use_tensor_cores"]  # grouped-query heads
    assert not attn.decode.init["workspace"].any()  # FlashInfer: "must be initialized to 0 for its first use"
    step = _step([_sched([5], 16, [7, 3]), _sched([9], 0, [4])])  # contexts 17 and 1
    attn.plan(step)
    assert attn.prefill.calls == []
    (name, plan), = attn.decode.calls
    assert name == "plan"
    assert plan["indptr"].tolist() == [0, 2, 3] and plan["indices"].tolist() == [7, 3, 4]
    assert plan["last_page_len"].tolist() == [1, 1]
    assert all(plan[k].dtype == torch.int32 for k in ("indptr", "indices", "last_page_len"))
    assert (plan["num_qo_heads"], plan["num_kv_heads"], plan["head_dim"], plan["page_size"]) == (6, 2, 64, 16)
    assert plan["q_data_type"] == plan["kv_data_type"] == torch.bfloat16 and plan["sm_scale"] == 0.125
    assert plan["pos_encoding_mode"] == "NONE"  # RoPE is applied by the model, before attention

    q = torch.randn(2, 12, 64, dtype=torch.bfloat16)[:, :6]  # a strided view, as the model's q is
    k = torch.randn(2, 2, 64, dtype=torch.bfloat16)
    v = torch.randn(2, 2, 64, dtype=torch.bfloat16)
    k_cache = torch.zeros(8, 16, 2, 64, dtype=torch.bfloat16)
    v_cache = torch.zeros_like(k_cache)
    out = attn(q, k, v, k_cache, v_cache, step, 0.125)
    assert out.shape == (2, 6, 64)
    name, run = attn.decode.calls[-1]
    assert name == "run" and run["q"].is_contiguous() and torch.equal(run["q"], q) and run["args"] == ()
    assert run["paged_kv_cache"][0] is k_cache and run["paged_kv_cache"][1] is v_cache
    assert torch.equal(k_cache[3, 0], k[0]) and torch.equal(v_cache[4, 0], v[1])  # written before attention


def test_steps_with_prompt_chunks_plan_the_causal_prefill_wrapper(fake_flashinfer):
    from serve_app.engine.attention_flashinfer import FlashInferAttention

    attn = FlashInferAttention(4, 4, 64, 16, torch.float16, 0.125, torch.device("cpu"))
    assert not attn.decode.init["use_tensor_cores"]
    # a decode at context 3, a chunk of 20 tokens after 12 cached ones (context 32: a full last page)
    step = _step([_sched([1], 2, [5]), _sched(range(20), 12, [2, 6])])
    attn.plan(step)
    assert attn.decode.calls == []
    (name, plan), = attn.prefill.calls
    assert plan["qo_indptr"].tolist() == [0, 1, 21] and plan["qo_indptr"].dtype == torch.int32
    assert plan["paged_kv_indptr"].tolist() == [0, 1, 3] and plan["paged_kv_indices"].tolist() == [5, 2, 6]
    assert plan["paged_kv_last_page_len"].tolist() == [3, 16]
    assert plan["causal"] is True  # FlashInfer aligns it to the end of each sequence's KV
    assert (plan["num_qo_heads"], plan["num_kv_heads"], plan["head_dim_qk"], plan["page_size"]) == (4, 4, 64, 16)
    assert plan["q_data_type"] == plan["kv_data_type"] == torch.float16 and plan["sm_scale"] == 0.125


def test_page_lists_ignore_table_entries_past_the_context():
    from serve_app.engine.attention_flashinfer import page_lists

    indptr, indices, last = page_lists(np.array([16, 3], dtype=np.int32), np.array([[4, 9, 9], [1, 9, 9]], dtype=np.int32), 16)
    assert indptr.tolist() == [0, 1, 2] and indices.tolist() == [4, 1] and last.tolist() == [16, 3]
