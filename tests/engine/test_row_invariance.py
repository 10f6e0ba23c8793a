"""Row-count invariance of every projection path this machine can run: as the engine calls it (on the
row tiles `invariant_tile` measured), `linear(x[:M])[:m] == linear(x[:m])` bit for bit for every row
count a step can send, up to the 2048-token step; and the measurement finds oneDNN's dependence on
the row count where oneDNN runs bf16 (AVX512), so the tiles are not a formality. Also the start-up
self-check's fallback and the path options' validation."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

from serve_app.engine import LLM, cpu_kernels
from serve_app.engine.config import ModelConfig
from serve_app.engine.models.llama import _packed_fp32_logits, _packed_linear
from serve_app.engine.models.row_invariance import (
    UNTILED,
    Projection,
    invariant_tiling,
    row_tiled,
    spread_inputs,
)

KERNELS = cpu_kernels.linear_kernels([960, 576, 3072, 49152], [576, 576, 1536])
ONEDNN = torch.ops.mkldnn._is_mkldnn_bf16_supported()
STEP_ROWS = 2048
SHAPES = [(960, 576), (576, 1536), (3072, 576)]  # SmolLM2's qkv, down, gate_up (out, in)


def reorder(w: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(w, None)


def projections() -> list:
    paths = [pytest.param(Projection("dense", F.linear, lambda w: w), id="dense")]
    paths.append(pytest.param(Projection("onednn", _packed_linear, reorder), id="onednn",
                              marks=pytest.mark.skipif(not ONEDNN, reason="needs AVX512 (oneDNN bf16)")))
    marks = pytest.mark.skipif(KERNELS is None, reason="needs AVX512-BF16 (the C++ bf16 kernels)")
    if KERNELS is not None:
        paths += [pytest.param(Projection("kernels", KERNELS.linear, KERNELS.pack), id="kernels", marks=marks),
                  pytest.param(Projection("kernels-silu-mul", KERNELS.silu_mul, lambda w: KERNELS.pack(w, interleave=True)),
                               id="kernels-silu-mul", marks=marks)]
    return paths


def bucketed_counts(max_rows: int) -> list[int]:
    """Every row count to 64, then every multiple of 64 (the buckets padded calls run at)."""
    return list(range(1, 65)) + list(range(128, max_rows + 1, 64))


@pytest.mark.parametrize("proj", projections())
@pytest.mark.parametrize(("n", "k"), SHAPES)
def test_projection_as_the_engine_calls_it_is_row_count_invariant(proj, n, k):
    tiling = invariant_tiling(proj, n, k, torch.bfloat16, STEP_ROWS)
    linear = row_tiled(proj.fn, tiling)
    weight = proj.pack((torch.randn(n, k, generator=torch.Generator().manual_seed(n)) * 0.05).bfloat16())
    x = spread_inputs(STEP_ROWS, k, torch.bfloat16, seed=7)
    whole = linear(x, weight)
    for m in bucketed_counts(STEP_ROWS):
        assert torch.equal(linear(x[:m], weight), whole[:m]), f"{m} rows (tiling {tiling})"
    alone = torch.cat([linear(x[i : i + 1], weight) for i in range(64)])
    assert torch.equal(whole[:64], alone)


@pytest.mark.heavy  # the whole model, every path
@pytest.mark.skipif(KERNELS is None, reason="needs AVX512-BF16 (the C++ bf16 kernels)")
def test_fp32_logits_are_row_count_invariant_on_every_logits_path():
    for proj in (Projection("kernels-logits", KERNELS.logits, KERNELS.pack),
                 Projection("onednn-fp32-logits", _packed_fp32_logits, lambda w: reorder(w.float()))):
        linear = row_tiled(proj.fn, invariant_tiling(proj, 49152, 576, torch.bfloat16, 256))
        weight = proj.pack((torch.randn(49152, 576) * 0.05).bfloat16())
        x = spread_inputs(256, 576, torch.bfloat16, seed=3)
        whole = linear(x, weight)
        assert whole.dtype == torch.float32
        for m in (1, 2, 7, 8, 9, 17, 33, 64, 65, 128, 200):
            assert torch.equal(linear(x[:m], weight), whole[:m]), (proj.key, m)


@pytest.mark.skipif(not ONEDNN, reason="needs AVX512 (oneDNN bf16)")
def test_measurement_finds_onednn_row_count_dependence():
    """oneDNN's bf16 down projection (K = 1536) changes kernels with the row count, with AMX or without:
    untiled it is not invariant, so the engine calls it on tiles."""
    assert invariant_tiling(Projection("onednn", _packed_linear, reorder), 576, 1536, torch.bfloat16, STEP_ROWS) != UNTILED


@pytest.mark.heavy  # the whole model, every path
def test_self_check_failure_falls_back_and_says_why(model_dir, monkeypatch, caplog):
    from serve_app.engine import model_runner

    calls = []

    def failing_first(selected, reference, claims):
        calls.append(claims)
        return "made to fail" if len(calls) == 1 else None

    monkeypatch.setattr(model_runner, "verdict", failing_first)
    with caplog.at_level(logging.WARNING):
        runner = LLM(model_dir, dtype="bfloat16", kv_cache_memory_gib=0.05).engine.core.model_runner
    assert runner.paths.linear == "dense" and runner.paths.attention == "cpu_decode"
    assert runner.paths.self_check.startswith("fell back") and "made to fail" in runner.paths.self_check
    assert runner.paths.labels["self_check"] == "fell back"
    assert "self-check" in caplog.text and "made to fail" in caplog.text


def test_path_options_are_validated(model_dir):
    with pytest.raises(ValueError, match="linear_backend"):
        ModelConfig(model_dir, linear_backend="mkl")
    with pytest.raises(ValueError, match="attention_backend"):
        ModelConfig(model_dir, attention_backend="sdpa")
    with pytest.raises(ValueError, match="linear_backend: onednn is for bf16 on CPU"):
        LLM(model_dir, dtype="float32", linear_backend="onednn")
