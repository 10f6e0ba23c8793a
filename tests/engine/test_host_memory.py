"""KV-cache tensors carved from one huge-page-advised buffer (serve_app/engine/host_memory.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from serve_app.engine.host_memory import _advise_huge_pages, huge_page_bytes, zeroed_cpu_tensors


def test_tensors_are_zeroed_contiguous_and_disjoint():
    tensors = zeroed_cpu_tensors((37, 16, 3, 64), torch.bfloat16, 6)
    assert len(tensors) == 6
    assert tensors[0].data_ptr() % huge_page_bytes() == 0
    for i, t in enumerate(tensors):
        assert t.shape == (37, 16, 3, 64) and t.dtype == torch.bfloat16 and t.is_contiguous()
        assert not t.any()
        t.fill_(i + 1)
    assert [int(t[0, 0, 0, 0]) for t in tensors] == [1, 2, 3, 4, 5, 6]  # no tensor overlaps another
    assert all(float(t.float().mean()) == i + 1 for i, t in enumerate(tensors))


@pytest.mark.skipif(not sys.platform.startswith("linux") or not Path("/sys/kernel/mm/transparent_hugepage").is_dir(),
                    reason="madvise(MADV_HUGEPAGE) needs Linux with transparent huge pages")
def test_advice_is_accepted_on_linux():
    page = huge_page_bytes()
    raw = torch.empty(3 * page, dtype=torch.uint8)
    start = -raw.data_ptr() % page
    assert _advise_huge_pages(raw.data_ptr() + start, page)


def test_engine_caches_come_from_it(model_dir):
    from serve_app.engine.config import EngineConfig
    from serve_app.engine.model_runner import ModelRunner

    cfg = EngineConfig.from_kwargs(model_dir, dtype="bfloat16", num_blocks=40)
    runner = ModelRunner(cfg.model, cfg.cache, cfg.model.hf_config(), cfg.scheduler)
    k0, v0 = runner.kv_caches[0]
    assert k0.data_ptr() % huge_page_bytes() == 0 and v0.data_ptr() == k0.data_ptr() + k0.numel() * k0.element_size()
    assert len(runner.kv_caches) == runner.args.num_layers and k0.shape[0] == 40
