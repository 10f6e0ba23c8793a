"""The W2 batching study's trace generator and report logic on synthetic data (no model, no engine)."""

from __future__ import annotations

import statistics

import pytest

from loadtest import report
from loadtest.batching_model import (
    DEFAULT_CLASSES,
    RequestResult,
    StepRecord,
    compare,
    describe_trace,
    make_trace,
    makespan_lower_bound,
    step_cost_model,
    summarize_policy,
    timeline_segments,
)
from loadtest.bench_batching import body, engine_kwargs, parse_args, plots


def test_trace_is_seeded_poisson_with_mixed_lengths():
    a, b = make_trace(48, 2.0, seed=0), make_trace(48, 2.0, seed=0)
    assert a == b
    assert make_trace(48, 2.0, seed=1) != a
    assert a[0].arrival_s == 0.0 and all(x.arrival_s < y.arrival_s for x, y in zip(a, a[1:], strict=False))
    ranges = {c.name: c for c in DEFAULT_CLASSES}
    for r in a:
        c = ranges[r.klass]
        assert c.prompt_len[0] <= r.prompt_len <= c.prompt_len[1]
        assert c.output_len[0] <= r.output_len <= c.output_len[1]
        assert all(100 <= t < 49152 for t in r.prompt_token_ids)
    big = make_trace(3000, 4.0, seed=2)
    gaps = [y.arrival_s - x.arrival_s for x, y in zip(big, big[1:], strict=False)]
    assert statistics.fmean(gaps) == pytest.approx(0.25, rel=0.06)
    assert statistics.stdev(gaps) == pytest.approx(0.25, rel=0.08)
    shares = describe_trace(big)["classes"]
    assert shares["short"] / 3000 == pytest.approx(0.6, abs=0.03) and shares["long"] / 3000 == pytest.approx(0.1, abs=0.02)
    d = describe_trace(a)
    assert d["output_tokens"] == sum(r.output_len for r in a) and d["num_requests"] == 48
    with pytest.raises(ValueError, match="rate_per_s"):
        make_trace(4, 0.0)


def _steps() -> list[StepRecord]:
    """r0 prefills (1 s step), then r0 + r1 decode, r1's prompt read in the middle step."""
    return [
        StepRecord(0.0, 1.0, 1, 10, 0, 1, (("r0", 10, True),)),
        StepRecord(1.0, 0.5, 2, 8, 1, 0, (("r0", 1, False), ("r1", 8, True))),
        StepRecord(1.5, 0.5, 2, 0, 2, 0, (("r0", 1, False), ("r1", 1, False))),
        StepRecord(2.0, 0.5, 1, 0, 1, 0, (("r1", 1, False),)),
        StepRecord(5.0, 0.5, 1, 0, 1, 0, (("r1", 1, False),)),  # the next step, after the engine idled 2.5 s
    ]


def test_timeline_segments_merge_consecutive_steps_by_kind():
    seg = timeline_segments(_steps())
    assert seg["r0"] == [(0.0, 1.0, "prefill"), (1.0, 2.0, "decode")]
    # consecutive steps merge even across an idle gap in the engine (the request stayed in the batch)
    assert seg["r1"] == [(1.0, 1.5, "prefill"), (1.5, 5.5, "decode")]


def test_summary_throughput_latency_and_batch_shape():
    requests = [
        RequestResult("r0", 0, 0.0, 0.0, 1.0, 2.0, 3),
        RequestResult("r1", 1, 0.5, 1.0, 1.5, 5.5, 4, num_preemptions=1),
    ]
    s = summarize_policy(requests, _steps())
    assert s["makespan_s"] == pytest.approx(5.5)
    assert s["output_tokens"] == 7 and s["output_tok_s"] == pytest.approx(7 / 5.5)
    assert s["request_throughput"] == pytest.approx(2 / 5.5)
    assert s["ttft_p50_s"] == pytest.approx(1.0)  # ttfts 1.0 and 1.0
    assert s["e2e_p50_s"] == pytest.approx((2.0 + 5.0) / 2)
    assert s["e2e_p99_s"] == pytest.approx(2.0 + 0.99 * 3.0)
    assert s["queue_p50_s"] == pytest.approx(0.25)
    assert s["mean_batch_size"] == pytest.approx(7 / 5)
    assert s["time_weighted_batch_size"] == pytest.approx((1 * 1 + 2 * 0.5 + 2 * 0.5 + 0.5 + 0.5) / 3.0)
    assert s["busy_fraction"] == pytest.approx(3.0 / 5.5)
    assert s["num_preemptions"] == 1 and s["max_batch_size"] == 2
    unfinished = summarize_policy([RequestResult("x", 0, 0.0, None, None, None, 0)], [])
    assert unfinished["num_finished"] == 0 and unfinished["output_tok_s"] == 0.0


def test_compare_ratios():
    r = {"static": {"output_tok_s": 10.0, "ttft_p50_s": 4.0}, "continuous": {"output_tok_s": 30.0, "ttft_p50_s": 1.0}}
    c = compare(r)
    assert c["continuous"] == {"output_tok_s_ratio": 3.0, "ttft_p50_ratio": 0.25}
    assert c["static"]["output_tok_s_ratio"] == 1.0
    assert compare({"continuous": r["continuous"]}) == {}


def test_policies_and_engine_options():
    args = parse_args(["--max-num-seqs", "16", "--static-timeout-s", "1.5"])
    assert args.policies == ["static", "dynamic", "continuous"]
    assert engine_kwargs(args, "static") == {**engine_kwargs(args, "continuous"), "batching": "static",
                                             "batch_size": 16, "batch_timeout_s": 1.5}
    assert engine_kwargs(args, "dynamic")["batch_timeout_s"] == 0.0
    assert "batch_size" not in engine_kwargs(args, "continuous")
    assert parse_args(["--policies", "continuous"]).policies == ["continuous"]
    with pytest.raises(SystemExit):
        parse_args(["--policies", "lifo"])


def _policy(name: str, tok_s: float, ttft: float, batching: str) -> dict:
    steps = [{"start_s": 0.1 * i, "duration_s": 0.1, "num_seqs": 1 + i % 3, "num_prefill_tokens": 5 if i == 0 else 0,
              "num_decode_tokens": 1 + i % 3, "num_waiting": 0, "batch": [["r0", 1, i == 0]]} for i in range(10)]
    requests = [{"request_id": "r0", "index": 0, "arrival_s": 0.0, "first_scheduled_s": 0.0, "first_token_s": 0.1,
                 "finished_s": 1.0, "num_output_tokens": 9, "num_preemptions": 0}]
    summary = {"output_tok_s": tok_s, "output_tokens": 9, "request_throughput": 1.0, "ttft_p50_s": ttft, "ttft_p99_s": ttft, "e2e_p50_s": 1.0,
               "e2e_p99_s": 1.0, "queue_p50_s": 0.0, "mean_batch_size": 2.0, "time_weighted_batch_size": 2.0, "max_batch_size": 3,
               "num_steps": 10, "mean_step_s": 0.1, "makespan_s": 1.0, "busy_fraction": 1.0, "process_cpu_cores": 1.0,
               "load_avg_1m_at_start": 1.0, "load_avg_1m_at_end": 1.0, "num_preemptions": 0, "max_arrival_lag_s": 0.0,
               "complete": True, "engine": {"batching": batching, "batch_size": 8, "batch_timeout_s": 2.0}}
    return {"summary": summary, "requests": requests, "steps": steps}


def test_reports_targets_and_files(tmp_path):
    policies = {"static": _policy("static", 10.0, 4.0, "static"), "dynamic": _policy("dynamic", 15.0, 2.0, "dynamic"),
                "continuous": _policy("continuous", 30.0, 1.0, "continuous"), "static-b8": _policy("static-b8", 8.0, 5.0, "static")}
    results = {
        "workload": {**describe_trace(make_trace(4, 1.0)), "rate_per_s": 1.0, "seed": 0},
        "settings": {"dtype": "bfloat16", "max_num_seqs": 32, "max_num_batched_tokens": 2048, "static_timeout_s": 2.0, "batch_size": 0},
        "machine": {"cpu": "x86_64", "flags": [], "logical_cores": 2, "physical_cores": 2, "memory_gib": 8, "torch": "2.13.0", "vllm": None,
                    "git": "abc", "load_avg_before": [1, 1, 1]},
        "command": ".venv/bin/python -m loadtest.bench_batching", "date": "2026-01-01T00:00:00+00:00", "duration_s": 60.0,
        "policies": policies, "comparison": compare({k: v["summary"] for k, v in policies.items()}),
    }
    results["step_cost_model"] = step_cost_model(results)
    paths = report.write(results, tmp_path / "out", "batching", "W2", body(results), plots(results))
    assert [p.name for p in paths] == ["batching.json", "batching.md", "batching_timeline.png", "batching_batch_size.png"]
    md = (tmp_path / "out" / "batching.md").read_text()
    assert "throughput **3.00x** (target ≥ 2.5x: met), TTFT p50 **0.25x** (target ≤ 0.5x: met)" in md
    assert "| continuous | 30.0 | 1.00 | 1.00 |" in md and "| 3.00x | 0.25x |" in md
    assert "static-b8: static (batch 8, wait ≤ 2 s)" in md and "## Step-cost model: the bound on this machine" in md
    assert "![batching_timeline](batching_timeline.png)" in md
    policies["continuous"]["summary"]["output_tok_s"] = 20.0
    results["comparison"] = compare({k: v["summary"] for k, v in policies.items()})
    assert "(target ≥ 2.5x: **not met**)" in "\n".join(body(results))


def test_step_cost_model_recovers_costs_and_bounds_the_ratio():
    """Steps timed by a known cost (20 ms + 2 ms per sequence + 0.5 ms per prompt token) give that cost
    back, and the bound follows from it: static ran 4 decode steps where 2 full ones would do."""
    def step(decode: int, prefill: int) -> dict:
        return {"duration_s": 0.020 + 0.002 * decode + 0.0005 * prefill, "num_decode_tokens": decode,
                "num_prefill_tokens": prefill}

    static = [step(0, 30), step(3, 0), step(1, 0), step(1, 0), step(1, 0)]  # 6 output tokens in 5 steps
    continuous = [step(0, 30), step(3, 0), step(3, 0)]
    results = {"workload": {"output_tokens": 6, "prompt_tokens": 30}, "settings": {"max_num_seqs": 3},
               "policies": {"static": {"steps": static, "summary": {"makespan_s": 0.2}},
                            "continuous": {"steps": continuous, "summary": {"makespan_s": 0.1}}}}
    m = step_cost_model(results)
    assert m["fixed_ms"] == pytest.approx(20.0) and m["per_decode_token_ms"] == pytest.approx(2.0)
    assert m["per_prompt_token_ms"] == pytest.approx(0.5) and m["r2"] == pytest.approx(1.0)
    assert m["policies"]["static"]["predicted_busy_s"] == pytest.approx(sum(s["duration_s"] for s in static))
    ideal = 2 * 0.020 + 6 * 0.002 + 30 * 0.0005  # 2 full decode steps
    assert m["ideal_continuous"] == {"num_steps": 2, "busy_s": pytest.approx(ideal)}
    assert m["throughput_bound_vs_static"] == pytest.approx(0.2 / ideal)
    assert m["fixed_only_bound_vs_static"] == pytest.approx(5 / 2)
    # with the trace's requests listed, the bound is the makespan one: here the chain of the 4-token
    # request (1 prefill + 3 decode steps from t = 0) plus the per-token work of the other
    results["workload"]["requests"] = [[0.0, 20, 4], [0.0, 10, 2]]
    results["settings"]["max_num_batched_tokens"] = 64
    m = step_cost_model(results)
    chain = 4 * 0.020 + (3 + 1) * 0.002 + 30 * 0.0005
    assert m["makespan_bound"]["bound_s"] == pytest.approx(chain) and m["makespan_bound"]["binding"] == "chain"
    assert m["throughput_bound_vs_static"] == pytest.approx(0.2 / chain)
    # each policy against the bound at the step costs of its own steps (continuous's 3 steps span only 2 shapes: no fit)
    assert list(m["own_fits"]) == ["static"] and m["own_fits"]["static"]["fixed_ms"] == pytest.approx(20.0)
    assert m["own_fits"]["static"]["share_of_bound"] == pytest.approx(chain / 0.2)
    results["policies"]["continuous"]["steps"] = results["policies"]["static"]["steps"] = [step(1, 0)] * 4
    assert step_cost_model(results) is None  # one distinct step shape: nothing to fit


COST = {"fixed": 0.020, "per_decode": 0.002, "per_prompt": 0.0005}


def test_makespan_bound_work_and_chains():
    """(arrival, prompt, output) requests; cap 4 sequences per step, a 2,048-token budget."""
    def bound(requests):
        return makespan_lower_bound(requests, COST["fixed"], COST["per_decode"], COST["per_prompt"], 4, 2048)

    # a burst of 8 requests with 2 decodes each: 4 full decode steps + every token's cost (the work bound)
    b = bound([(0.0, 4, 3)] * 8)
    assert b["binding"] == "work" and b["bound_s"] == pytest.approx(4 * 0.020 + 8 * (2 * 0.002 + 4 * 0.0005))
    # one long request: its 1 + 9 steps in a row, each paying the fixed cost, plus its tokens (the chain bound)
    b = bound([(0.0, 10, 10)])
    assert b["binding"] == "chain" and b["bound_s"] == pytest.approx(10 * 0.020 + 9 * 0.002 + 10 * 0.0005)
    # a late arrival: nothing of it runs before it arrives; the work of the first (0.007 s) fits before it
    b = bound([(1.0, 10, 2), (6.0, 10, 2)])  # times are from the first arrival
    assert b["work_bound_s"] == pytest.approx(5.0 + 0.020 + 0.007)
    assert b["chain_bound_s"] == pytest.approx(5.0 + 2 * 0.020 + 0.007)
    # a prompt longer than the step budget takes several steps
    assert bound([(0.0, 5000, 1)])["chain_bound_s"] == pytest.approx(3 * 0.020 + 5000 * 0.0005)
