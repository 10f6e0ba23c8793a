"""FlashInfer's paged attention wrappers as the engine's CUDA attention backend.

FlashInfer reads the cache in the engine's layout as is (NHD: `[num_blocks, block_size, Hkv, D]`,
K and V as two tensors). Per step `plan` turns the step's block tables into FlashInfer's page lists
(`indptr`, `indices`, `last_page_len`) and plans one wrapper: the decode wrapper when every sequence
has one query, else the prefill wrapper (causal, any mix of prompt chunks and decodes); every layer
then calls `run` with that plan. The KV write is the Triton slot-mapping kernel.
Constructing `FlashInferAttention` imports flashinfer (`flashinfer-python`, not a dependency). The
calls are those of FlashInfer 0.2 to 0.6 (`plan` with `q_data_type`, `kv_data_type`, `sm_scale` by
keyword; `run(q, (k_cache, v_cache))`).
"""

from __future__ import annotations

import numpy as np
import torch

from serve_app.engine.attention_triton import store_kv
from serve_app.engine.input_batch import StepInputs

WORKSPACE_BYTES = 128 * 2**20


def page_lists(seq_lens: np.ndarray, block_tables: np.ndarray, block_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """FlashInfer's (indptr [S + 1], indices [sum pages], last_page_len [S]) from host arrays."""
    num_pages = -(-seq_lens.astype(np.int64) // block_size)
    indptr = np.zeros(len(seq_lens) + 1, dtype=np.int32)
    np.cumsum(num_pages, out=indptr[1:])
    used = np.arange(block_tables.shape[1])[None, :] < num_pages[:, None]
    indices = block_tables[used].astype(np.int32)  # row-major: each sequence's pages in order
    last_page_len = (seq_lens - (num_pages - 1) * block_size).astype(np.int32)
    return indptr, indices, last_page_len


class FlashInferAttention:
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype,
                 scale: float, device: torch.device) -> None:
        import flashinfer

        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.block_size, self.dtype, self.scale, self.device = block_size, dtype, scale, device
        # zeroed: FlashInfer's wrappers document "must be initialized to 0 for its first use" (its
        # trtllm-gen kernels keep counters there and no longer clear them)
        workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self.decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD", use_tensor_cores=num_heads != num_kv_heads)
        self.prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD")
        self.wrapper = None

    def plan(self, step: StepInputs) -> None:
        """Once per step, before the forward pass (reads the step's host arrays)."""
        seq_lens = step.host_seq_lens
        indptr, indices, last = page_lists(seq_lens, step.host_block_tables, self.block_size)
        dev = lambda a: torch.from_numpy(a).to(self.device, non_blocking=False)  # noqa: E731
        common = dict(q_data_type=self.dtype, kv_data_type=self.dtype, sm_scale=self.scale)
        if step.max_query_len == 1:
            self.decode.plan(dev(indptr), dev(indices), dev(last), self.num_heads, self.num_kv_heads, self.head_dim,
                             self.block_size, pos_encoding_mode="NONE", **common)
            self.wrapper = self.decode
        else:
            qo_indptr = dev(step.host_query_start_loc.astype(np.int32))
            self.prefill.plan(qo_indptr, dev(indptr), dev(indices), dev(last), self.num_heads, self.num_kv_heads,
                              self.head_dim, self.block_size, causal=True, **common)
            self.wrapper = self.prefill

    def __call__(self, q, k, v, k_cache, v_cache, step: StepInputs, scale: float) -> torch.Tensor:
        store_kv(k, v, k_cache, v_cache, step.slot_mapping)
        return self.wrapper.run(q.contiguous(), (k_cache, v_cache))
