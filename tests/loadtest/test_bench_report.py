"""The W1 benchmark's report logic on synthetic runs (no model, no engine)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "loadtest"))

from bench_engine import make_prompts, parse_args  # noqa: E402
from bench_report import agreement, summarize, write_reports  # noqa: E402


def _results(native_s: list[float], hf_s: list[float], n: int = 4, out_len: int = 8) -> dict:
    def runs(times, tokens):
        return [{"repeat": r, "elapsed_s": t, "token_ids": tokens, "extra": {}, "other_cpu_cores": 0.1} for r, t in enumerate(times)]

    same = [[5] * out_len for _ in range(n)]
    diverging = [[5] * out_len for _ in range(n - 1)] + [[6] * out_len]
    return {
        "workload": {"num_requests": n, "prompt_len": 16, "output_len": out_len, "seed": 0, "min_token_id": 100,
                     "vocab_size": 1000, "dtype": "bfloat16", "device": "cpu", "model": "m"},
        "settings": {"repeats": len(native_s), "hf_batch_size": 2, "max_num_seqs": 64, "max_num_batched_tokens": 2048,
                     "kv_cache_gib": 1.0, "threads": 0, "baseline": "hf"},
        "command": "python loadtest/bench_engine.py", "date": "2026-01-01T00:00:00+00:00", "duration_s": 1.0,
        "machine": {"cpu": "x", "logical_cores": 2, "physical_cores": 2, "memory_gib": 24, "python": "3.11",
                    "torch": "2.13.0", "transformers": "5.19.0", "vllm": None, "device": "cpu", "git": "abc",
                    "load_avg_at_start": [0, 0, 0]},
        "engines": {
            "native": {"label": "native", "runs": runs(native_s, diverging), "info": {"kv_cache_bytes": 2**30}, "peak_rss_mib": 1.0},
            "hf": {"label": "hf", "runs": runs(hf_s, same), "info": {}, "peak_rss_mib": 1.0},
            "vllm": {"label": "vLLM", "runs": [], "skipped": "not installed"},
        },
    }


def test_summary_spread_paired_ratio_and_reports(tmp_path):
    results = _results([1.0, 2.0, 1.0], [4.0, 4.0, 2.0])
    summarize(results)
    native = results["engines"]["native"]
    assert native["output_tok_s"]["median"] == pytest.approx(32.0)  # 32 tokens / 1 s
    assert native["output_tok_s"]["min"] == pytest.approx(16.0)
    assert native["total_tok_s"]["max"] == pytest.approx((32 + 64) / 1.0)
    assert native["ratio_vs_baseline"]["median"] == pytest.approx(2.0)  # paired per repeat: 4, 2, 2
    assert native["ratio_vs_baseline"]["max"] == pytest.approx(4.0)
    assert native["agreement_vs_baseline"]["exact_match"] == pytest.approx(0.75)
    assert native["kv_cache_mib"] == 1024
    assert results["target"]["met"] is False
    assert all("token_ids" not in r for r in native["runs"])
    paths = write_reports(results, tmp_path)
    doc = paths["md"].read_text()
    assert "| native | 32.0 (16.0–32.0) |" in doc and "skipped" in doc and "2.00 (2.00–4.00)×" in doc
    assert json.loads(paths["json"].read_text())["engines"]["native"]["ratio_vs_baseline"]["n"] == 3
    assert paths.get("png") is None or paths["png"].stat().st_size > 0


def test_floor_share_pairs_each_run_with_the_floor_measured_before_it(tmp_path):
    results = _results([1.0, 2.0, 1.0], [4.0, 4.0, 2.0])
    floors = [64.0, 32.0, 64.0]  # native's runs: 32, 16, 32 tok/s -> 50%, 50%, 50% of their own floor
    for run, floor in zip(results["engines"]["native"]["runs"], floors, strict=True):
        run["floor_output_tok_s"] = floor
    results["compute_floors"] = [
        {"repeat": r, "engine": "native", "floor_output_tok_s": f, "decode_tflop_s": f / 100, "prefill_tflop_s": 1.0,
         "prefill_flops": 2e9, "decode_flops": 3e9, "prefill_rows": 2048, "decode_rows": 64}
        for r, f in enumerate(floors)
    ] + [{"repeat": 0, "engine": "hf", "error": "timed out"}]
    summarize(results)
    share = results["engines"]["native"]["floor_share"]
    assert share["median"] == pytest.approx(0.5) and share["min"] == pytest.approx(0.5) and share["max"] == pytest.approx(0.5)
    assert results["engines"]["hf"]["floor_share"] is None  # its run had no floor measured before it
    floor = results["compute_floor"]
    assert floor["floor_output_tok_s"] == {"min": 32.0, "median": 64.0, "max": 64.0, "n": 3}
    doc = write_reports(results, tmp_path)["md"].read_text()
    assert "measured right before each of the 3 runs): 64 (32–64) output tok/s" in doc
    assert "native 50% (50%–50%)" in doc


def test_agreement_counts_common_prefix():
    a = agreement([[1, 2, 3], [1, 9, 9]], [[1, 2, 3], [1, 2, 3]])
    assert a == {"first_token_match": 1.0, "exact_match": 0.5, "mean_common_prefix_tokens": 2.0}


def test_prompts_are_deterministic_and_skip_special_ids():
    p = make_prompts(8, 32, 1000, 100, seed=0)
    assert p == make_prompts(8, 32, 1000, 100, seed=0) != make_prompts(8, 32, 1000, 100, seed=1)
    assert len(p) == 8 and all(len(x) == 32 and min(x) >= 100 and max(x) < 1000 for x in p)


def test_quick_defaults_do_not_override_explicit_options():
    args = parse_args(["--quick", "--output-len", "5"])
    assert (args.num_requests, args.output_len, args.out_dir) == (8, 5, "build/bench-quick")
    assert parse_args([]).num_requests == 64 and parse_args([]).out_dir == "reports"
