"""The W1 benchmark's summary and report on synthetic runs (no model, no engine)."""

from __future__ import annotations

import json

import pytest

from loadtest import report
from loadtest.bench_engine import body, make_prompts, parse_args, plot, summarize


def _results(native_s: list[float], hf_s: list[float], n: int = 4, out_len: int = 8) -> dict:
    def runs(times):
        return [{"repeat": r, "elapsed_s": t, "output_tokens": n * out_len, "output_tok_s": n * out_len / t, "total_tok_s": (n * out_len + n * 16) / t,
                 "extra": {}, "other_cpu_cores": 0.1, "floor_output_tok_s": None} for r, t in enumerate(times)]

    return {"command": "python -m loadtest.bench_engine", "date": "2026-01-01T00:00:00+00:00", "duration_s": 1.0,
            "machine": {"cpu": "x", "flags": ["avx2"], "logical_cores": 2, "physical_cores": 2, "memory_gib": 24, "torch": "2.13.0",
                        "vllm": None, "git": "abc", "load_avg_before": [0, 0, 0]},
            "workload": {"num_requests": n, "prompt_len": 16, "output_len": out_len, "seed": 0, "min_token_id": 100, "vocab_size": 1000,
                         "dtype": "bfloat16", "device": "cpu", "model": "m"},
            "settings": {"repeats": len(native_s), "hf_batch_size": 2, "max_num_seqs": 64, "max_num_batched_tokens": 2048, "kv_cache_gib": 1.0,
                         "threads": 0, "baseline": "hf"},
            "engines": {"native": {"label": "native", "runs": runs(native_s), "info": {"kv_cache_bytes": 2**30}, "peak_rss_mib": 1.0},
                        "hf": {"label": "hf", "runs": runs(hf_s), "info": {}, "peak_rss_mib": 1.0},
                        "vllm": {"label": "vLLM", "runs": [], "skipped": "not installed"}},
            "compute_floors": []}


def test_summary_spreads_paired_ratios_and_report(tmp_path):
    results = _results([1.0, 2.0, 1.0], [4.0, 4.0, 2.0])
    summarize(results)
    native = results["engines"]["native"]
    assert native["output_tok_s"] == {"median": 32.0, "min": 16.0, "max": 32.0, "n": 3}  # 32 tokens / 1 s
    assert native["ratio_vs_baseline"] == {"median": 2.0, "min": 2.0, "max": 4.0, "n": 3}  # paired per repeat: 4, 2, 2
    assert results["target"] == {"goal": "native >= 3x HF static output tok/s", "measured_median_ratio": 2.0, "met": False}
    assert "warning" not in native and native["floor_share"] is None
    paths = report.write(results, tmp_path, "engine_throughput", "W1", body(results), {"engine_throughput": plot(results)})
    md = paths[1].read_text()
    assert "| native | 32.0 (16.0–32.0) |" in md and "| 2.00 (2.00–4.00)× |" in md and "**not met**" in md
    assert "- **vllm**: not installed" in md and "| 3 | hf | 2.0 | 16.0 | 0.10 |" in md
    assert json.loads(paths[0].read_text())["engines"]["native"]["ratio_vs_baseline"]["n"] == 3
    assert paths[2].name == "engine_throughput.png" and paths[2].stat().st_size > 10_000


def test_floor_share_pairs_each_run_with_the_floor_measured_before_it():
    results = _results([1.0, 2.0, 1.0], [4.0, 4.0, 2.0])
    for run, floor in zip(results["engines"]["native"]["runs"], [64.0, 32.0, 64.0], strict=True):
        run["floor_output_tok_s"] = floor  # native's runs: 32, 16, 32 tok/s → 50% of each one's floor
    results["compute_floors"] = [{"repeat": r, "engine": "native", "floor_output_tok_s": f, "decode_tflop_s": f / 100, "prefill_tflop_s": 1.0,
                                  "prefill_flops": 2e9, "decode_flops": 3e9, "prefill_rows": 2048, "decode_rows": 64}
                                 for r, f in enumerate([64.0, 32.0, 64.0])] + [{"repeat": 0, "engine": "hf", "error": "timed out"}]
    results["engines"]["native"]["runs"][2]["output_tokens"] = 31
    summarize(results)
    native = results["engines"]["native"]
    assert native["floor_share"] == {"median": 0.5, "min": 0.5, "max": 0.5, "n": 3}
    assert results["engines"]["hf"]["floor_share"] is None  # no floor measured before its runs
    assert results["compute_floor"]["floor_output_tok_s"] == {"median": 64.0, "min": 32.0, "max": 64.0, "n": 3}
    assert native["warning"] == "repeats [2]: fewer output tokens than 32"
    md = "\n".join(body(results))
    assert "right before each of the 3 runs): 64 (32–64) output tok/s" in md and "native 50 (50–50)%" in md


def test_prompts_are_deterministic_and_skip_special_ids():
    p = make_prompts(8, 32, 1000, 100, seed=0)
    assert p == make_prompts(8, 32, 1000, 100, seed=0) != make_prompts(8, 32, 1000, 100, seed=1)
    assert len(p) == 8 and all(len(x) == 32 and min(x) >= 100 and max(x) < 1000 for x in p)


def test_quick_defaults_do_not_override_explicit_options():
    args = parse_args(["--quick", "--output-len", "5"])
    assert (args.num_requests, args.output_len, args.out_dir) == (8, 5, "build/bench-quick")
    assert parse_args([]).num_requests == 64 and parse_args([]).out_dir == "reports"
    with pytest.raises(SystemExit):
        parse_args(["--engines", "native,tgi"])
