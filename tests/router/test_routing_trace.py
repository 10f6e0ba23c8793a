"""W3 benchmark logic without Ray: traces (seeded, same for every router), percentiles, summaries,
KV-aware ÷ power-of-two comparison, and the report (markdown + PNG) from a synthetic run."""

from __future__ import annotations

import json

import pytest

from loadtest.bench_routing import (
    Mix,
    RequestResult,
    compare_runs,
    make_trace,
    replica_deltas,
    summarize_run,
    write_report,
)


def test_traces_are_seeded_poisson_with_the_skewed_mix():
    mix = Mix()
    a = make_trace("skewed", mix, rate=20.0, duration_s=50.0, seed=3)
    assert a == make_trace("skewed", mix, rate=20.0, duration_s=50.0, seed=3)  # every router replays the same
    assert a != make_trace("skewed", mix, rate=20.0, duration_s=50.0, seed=4)
    assert 900 <= len(a) <= 1100 and all(0 <= r.arrival_s < 50 for r in a)
    assert [r.arrival_s for r in a] == sorted(r.arrival_s for r in a)
    longs = [r for r in a if r.klass == "long"]
    assert 0.08 <= len(longs) / len(a) <= 0.16
    assert all(r.prompt_len == mix.long_prompt and r.output_len == mix.long_output for r in longs)
    uniform = make_trace("uniform", mix, rate=20.0, duration_s=50.0, seed=3)
    assert {(r.prompt_len, r.output_len) for r in uniform} == {(mix.mean_prompt, mix.mean_output)}


def test_summary():
    results = [RequestResult(i, "short", i * 0.1, 0.1 * (i + 1), 1.0 + i, 16) for i in range(10)]
    results.append(RequestResult(10, "long", 1.0, 5.0, 9.0, 128))
    results.append(RequestResult(11, "long", 1.1, None, None, 0, "timeout"))
    s = summarize_run(results, wall_s=20.0, preemptions=3, per_replica={"a": {"requests": 11}})
    assert s["num_requests"] == 12 and s["num_errors"] == 1 and s["errors"] == ["timeout"]
    assert s["output_tokens"] == 10 * 16 + 128 and s["output_tok_s"] == pytest.approx((160 + 128) / 20)
    # linear interpolation (loadtest/stats.py): 11 TTFTs 0.1 ... 1.0 and 5.0, the p99 between the two largest
    assert s["ttft_p99_s"] == pytest.approx(1.0 + 0.9 * 4.0) and s["by_kind"]["short"]["ttft_p99_s"] == pytest.approx(0.991)
    assert s["by_kind"]["long"]["n"] == 1 and s["preemptions"] == 3
    ratios = compare_runs({"kv_aware": {"runs": {"skewed": {"ttft_p99_s": 1.0, "output_tok_s": 110.0, "ttft_p50_s": 0.2, "e2e_p99_s": 4.0}}},
                           "pow2": {"runs": {"skewed": {"ttft_p99_s": 2.0, "output_tok_s": 100.0, "ttft_p50_s": 0.2, "e2e_p99_s": 8.0}}}}, "skewed")
    assert ratios == {"ttft_p99_ratio": 0.5, "ttft_p50_ratio": 1.0, "e2e_p99_ratio": 0.5, "output_tok_s_ratio": 1.1, "ttft_p99_ratio_per_seed": []}
    assert compare_runs({"kv_aware": {"runs": {}}}, "skewed")["ttft_p99_ratio"] is None


def test_replica_deltas_count_this_runs_requests_by_kind():
    before = {"a": {"num_preemptions": 2, "request_ids": ["x-skewed-0-short"]}}
    after = {"a": {"num_preemptions": 5, "request_ids": ["x-skewed-0-short", "kv-skewed-1-long", "kv-skewed-2-short"]},
             "b": {"num_preemptions": 1, "request_ids": ["kv-skewed-3-short", "kv-skewedX-4-long"]}}
    total, per = replica_deltas(before, after, "kv-skewed")
    assert total == 4
    assert per["a"] == {"requests": 2, "preemptions": 3, "long": 1, "short": 1, "uniform": 0}
    assert per["b"] == {"requests": 1, "preemptions": 1, "long": 0, "short": 1, "uniform": 0}


def test_report_from_a_synthetic_run(tmp_path):
    def run(p99s, tok):
        per_seed = [{"seed": i, "ttft_p99_s": p} for i, p in enumerate(p99s)]
        return {"num_requests": 10, "num_errors": 0, "ttft_p50_s": 0.2, "ttft_p99_s": max(p99s), "e2e_p99_s": 3.0,
                "output_tok_s": tok, "preemptions": 1, "per_replica": {"a": {"requests": 6, "long": 1}, "b": {"requests": 4, "long": 0}},
                "by_kind": {"short": {"ttft_p50_s": 0.1, "ttft_p99_s": 0.5}, "long": {"ttft_p50_s": 1.0, "ttft_p99_s": 2.0}},
                "ttft_cdf": [0.1, 0.2, max(p99s)], "per_seed": per_seed}

    machine = {"cpu": "x", "flags": [], "logical_cores": 2, "physical_cores": 2, "memory_gib": 8, "torch": "2.13.0", "vllm": None, "git": "abc",
               "load_avg_before": [1, 1, 1]}
    results = {"date": "2026-01-01 00:00 UTC", "command": "python -m loadtest.bench_routing", "machine": machine, "mix": {**Mix().__dict__, "mean_prompt": Mix().mean_prompt, "mean_output": Mix().mean_output},
               "workload": {"duration_s": 40, "seeds": [0, 1], "load": 0.85, "num_blocks": 128, "rate_req_s": 2.0,
                            "capacity_req_s": 2.35},
               "routers": {"pow2": {"runs": {"skewed": run([2.0, 1.0], 100.0), "uniform": run([1.0, 1.0], 100.0)}},
                           "kv_aware": {"runs": {"skewed": run([1.2, 0.9], 101.0), "uniform": run([1.2, 0.5], 99.0)}}}}
    results["comparison"] = {t: compare_runs(results["routers"], t) for t in ("skewed", "uniform")}
    assert results["comparison"]["skewed"]["ttft_p99_ratio_per_seed"] == pytest.approx([0.6, 0.9])
    write_report(results, tmp_path)
    md = (tmp_path / "routing.md").read_text()
    assert "| skewed | 0.60 | 0.60, 0.90 |" in md and "| yes |" in md  # pooled 1.2 / 2.0 = 0.6 ≤ 0.7, tok/s 1.01
    assert "| uniform | 1.20 | 1.20, 0.50 |" in md and md.rstrip().count("| no |") == 1  # 1.2 > 1.1
    assert "| 0 | 1.200 | 0.900 |" in md  # kv_aware's errors, then each seed's own p99
    assert (tmp_path / "routing.png").stat().st_size > 10_000
    committed = json.loads((tmp_path / "routing.json").read_text())
    assert committed["routers"]["pow2"]["runs"]["skewed"]["per_seed"][1]["ttft_p99_s"] == 1.0
