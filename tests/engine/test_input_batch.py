"""Step inputs built in persistent buffers (input_batch) against a per-token reference, and the
memory-sizing options' validation."""

from __future__ import annotations

import pytest
import torch

from serve_app.engine.config import CacheConfig, EngineConfig
from serve_app.engine.input_batch import InputBatch
from serve_app.engine.outputs import ScheduledRequest
from serve_app.types import SamplingParams


def sched(token_ids, start_pos, table):
    return ScheduledRequest("r", tuple(token_ids), start_pos, tuple(table), True, True, SamplingParams(), None)


def test_matches_per_token_reference():
    bs = 4
    batch = InputBatch(bs, torch.device("cpu"))
    steps = [
        [sched([7], 9, [3, 1, 8]), sched([5], 0, [2]), sched(range(10, 16), 2, [6, 4])],
        [sched(range(300), 0, list(range(75)))],  # grows the buffers
        [sched([1], 4, [5, 0])],  # smaller again: stale rows must not leak in
    ]
    for scheduled in steps:
        step = batch.build(scheduled)
        ids, pos, slots, qsl = [], [], [], [0]
        for s in scheduled:
            ids += s.token_ids
            pos += range(s.start_pos, s.context_len)
            slots += [s.block_table[p // bs] * bs + p % bs for p in range(s.start_pos, s.context_len)]
            qsl.append(qsl[-1] + s.num_tokens)
        assert step.input_ids.tolist() == ids and step.positions.tolist() == pos and step.slot_mapping.tolist() == slots
        assert step.query_start_loc.tolist() == qsl
        assert step.seq_lens.tolist() == [s.context_len for s in scheduled]
        width = max(len(s.block_table) for s in scheduled)
        assert step.block_tables.tolist() == [list(s.block_table) + [0] * (width - len(s.block_table)) for s in scheduled]
        assert step.max_query_len == max(s.num_tokens for s in scheduled)


class FakeCopyEvent:
    """Stands in for the CUDA event that marks a step's copies out of the pinned buffers."""

    def __init__(self, batch: InputBatch, done: bool) -> None:
        self.batch, self.done, self.waited_on = batch, done, []

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:  # what the host buffers hold when build() waits
        self.waited_on.append(self.batch._h_tok[0, :2].tolist())


def test_does_not_rewrite_the_host_buffers_under_pending_copies():
    """On CUDA a step's non-blocking copies read the pinned buffers only when the stream gets to
    them, and a step that samples nothing (prompt chunks only) ends without a host sync: the next
    build must wait for those copies before it writes the buffers, and only then."""
    batch = InputBatch(4, torch.device("cpu"))
    batch.build([sched([7, 8], 0, [3])])
    pending = batch._copied = FakeCopyEvent(batch, done=False)
    step = batch.build([sched([5, 6], 2, [3])])
    assert pending.waited_on == [[7, 8]]  # waited, before overwriting the previous step's tokens
    assert step.input_ids.tolist() == [5, 6]
    done = batch._copied = FakeCopyEvent(batch, done=True)
    batch.build([sched([1], 4, [3, 2])])
    assert done.waited_on == []  # copies already done (every sampling step syncs): no host sync


def test_gpu_memory_utilization_excludes_kv_cache_memory_gib():
    with pytest.raises(ValueError, match="gpu_memory_utilization, kv_cache_memory_gib"):
        CacheConfig(gpu_memory_utilization=0.9, kv_cache_memory_gib=2)
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        CacheConfig(gpu_memory_utilization=1.5)
    assert CacheConfig().kv_cache_gib == 1.0 and CacheConfig(gpu_memory_utilization=0.8).gpu_memory_utilization == 0.8


def test_gpu_memory_utilization_needs_cuda(model_dir):
    from serve_app.engine.model_runner import ModelRunner

    config = EngineConfig.from_kwargs(model_dir, gpu_memory_utilization=0.5)
    with pytest.raises(ValueError, match="gpu_memory_utilization: only for CUDA"):
        ModelRunner(config.model, config.cache, config.model.hf_config(), config.scheduler)


def test_triton_on_cpu_needs_the_interpreter(monkeypatch):
    from serve_app.engine.attention_backends import resolve_backend

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        resolve_backend("triton", torch.device("cpu"), torch.bfloat16)
    with pytest.raises(ValueError, match="flashinfer needs a CUDA"):
        resolve_backend("flashinfer", torch.device("cpu"), torch.bfloat16)
    assert resolve_backend("auto", torch.device("cpu"), torch.bfloat16) == "cpu_kernel"
    assert resolve_backend("torch", torch.device("cuda"), torch.float32) == "torch"


def test_auto_on_cuda_passes_over_a_flashinfer_that_does_not_import(tmp_path, monkeypatch):
    """flashinfer installed but broken (e.g. its wheel copied over without its dependencies): `auto`
    must fall back to Triton rather than fail building the engine; a working one is chosen."""
    import sys

    from serve_app.engine.attention_backends import resolve_backend

    broken, working = tmp_path / "broken", tmp_path / "working"
    for root, body in ((broken, "raise ImportError('No module named tvm_ffi')\n"), (working, "")):
        (root / "flashinfer").mkdir(parents=True)
        (root / "flashinfer" / "__init__.py").write_text(body)
    cuda = torch.device("cuda")  # resolve_backend only looks at the device type
    try:
        monkeypatch.syspath_prepend(str(broken))
        assert resolve_backend("auto", cuda, torch.bfloat16) == "triton"
        monkeypatch.syspath_prepend(str(working))
        assert resolve_backend("auto", cuda, torch.bfloat16) == "flashinfer"
        assert resolve_backend("auto", cuda, torch.float32) == "triton"  # no fp32 kernels in FlashInfer
    finally:
        sys.modules.pop("flashinfer", None)


def test_flashinfer_page_lists():
    """FlashInfer's page lists (its module imports flashinfer only when a backend is built)."""
    import numpy as np

    from serve_app.engine.attention_flashinfer import page_lists

    seq_lens = np.array([1, 16, 17, 40], dtype=np.int32)
    tables = np.array([[7, 0, 0], [3, 9, 0], [4, 5, 0], [8, 2, 6]], dtype=np.int32)
    indptr, indices, last = page_lists(seq_lens, tables, 16)
    assert indptr.tolist() == [0, 1, 2, 4, 7]
    assert indices.tolist() == [7, 3, 4, 5, 8, 2, 6]
    assert last.tolist() == [1, 16, 1, 8]
