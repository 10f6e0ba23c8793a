"""W2 batching study (docs/benchmarks.md): one seeded Poisson trace (loadtest/batching_model.py) at `--load` × the
capacity calibrated first, replayed against one in-process AsyncLLMEngine under `static`, `dynamic` and `continuous`
batching; then the step-cost model over every step and the shortest makespan any admission policy could reach.

    .venv/bin/python -m loadtest.bench_batching [--quick]   # reports/batching.* (--quick: 16 requests → build/bench-batching-quick/)
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import statistics
import time
from typing import Any

from loadtest import machine, report
from loadtest.batching_model import (
    RequestResult,
    StepRecord,
    TraceRequest,
    compare,
    describe_trace,
    fit_step_cost,
    make_trace,
    step_cost_model,
    summarize_policy,
    timeline_segments,
)
from loadtest.report import num, table
from serve_app.types import GenerateRequest, SamplingParams
from tests.recording_logger import RecordingLogger

POLICIES = ("static", "dynamic", "continuous")
TARGET_THROUGHPUT_RATIO, TARGET_TTFT_RATIO = 2.5, 0.5  # continuous vs static
COLORS = {"queued": "#cfcfcf", "prefill": "tab:orange", "decode": "tab:blue"}
log = report.logger("bench-batching")


def engine_kwargs(args: argparse.Namespace, batching: str) -> dict[str, Any]:
    kwargs: dict[str, Any] = {"dtype": args.dtype, "device": "cpu", "batching": batching, "max_num_seqs": args.max_num_seqs,
                              "max_num_batched_tokens": args.max_num_batched_tokens, "kv_cache_memory_gib": args.kv_cache_gib,
                              "enable_prefix_caching": False}  # random prompts share nothing: keep every policy's work identical
    if batching != "continuous":  # batches of the batch cap
        kwargs.update(batch_size=args.max_num_seqs, batch_timeout_s=args.static_timeout_s if batching == "static" else 0.0)
    return kwargs


async def _replay(engine, trace: list[TraceRequest], policy: str, timeout_s: float) -> tuple[list[RequestResult], float, bool, float]:
    """Each request sent at its arrival time; (results relative to the trace start, the start (monotonic),
    whether all finished in time, the largest send lag)."""
    t0, finals, lags = time.monotonic() + 0.1, {}, []

    async def one(req: TraceRequest) -> None:
        await asyncio.sleep(max(0.0, t0 + req.arrival_s - time.monotonic()))
        lags.append(time.monotonic() - (t0 + req.arrival_s))
        params = SamplingParams(max_tokens=req.output_len, temperature=0.0, ignore_eos=True)
        async for out in engine.generate(GenerateRequest(f"{policy}-{req.index}", prompt=list(req.prompt_token_ids), sampling_params=params)):
            if out.finished:
                finals[req.index] = out.metrics

    tasks = [asyncio.ensure_future(one(r)) for r in trace]
    done, pending = await asyncio.wait(tasks, timeout=timeout_s + trace[-1].arrival_s)
    for task in pending:  # leaving generate() aborts the request in the engine
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    for task in done:
        task.result()  # surface engine errors

    def rel(t: float | None) -> float | None:
        return None if t is None else t - t0

    results = [RequestResult(f"{policy}-{r.index}", r.index, rel(m.arrival_time), rel(m.first_scheduled_time), rel(m.first_token_time),
                             rel(m.finished_time), m.num_generation_tokens, m.num_preemptions) if (m := finals.get(r.index))
               else RequestResult(f"{policy}-{r.index}", r.index, r.arrival_s, None, None, None, 0) for r in trace]
    return results, t0, not pending, max(lags, default=0.0)


def run_policy(args: argparse.Namespace, policy: str, trace: list[TraceRequest]) -> dict[str, Any]:
    from serve_app.engine.async_engine import AsyncLLMEngine

    recorder, kwargs = RecordingLogger(), engine_kwargs(args, policy)
    engine, loop = AsyncLLMEngine.from_kwargs(args.model, stat_loggers=[recorder], **kwargs), asyncio.new_event_loop()
    try:  # warm-up (kernels, allocator), not measured
        loop.run_until_complete(_replay(engine, [TraceRequest(i, 0.0, "warm-up", tuple(range(1000 + i, 1096 + i)), 4) for i in range(2)],
                                        f"warmup-{policy}", 60))
        recorder.steps.clear()
        cpu0, load0, wall0 = machine.own_cpu_s(), os.getloadavg()[0], time.perf_counter()
        results, t0, complete, max_lag = loop.run_until_complete(_replay(engine, trace, policy, args.policy_timeout_s))
        wall, cpu = time.perf_counter() - wall0, machine.own_cpu_s() - cpu0
    finally:
        engine.shutdown()
        loop.close()
    steps = [StepRecord(s.step_start_time - t0, s.step_duration_s, s.num_scheduled_seqs, s.num_prefill_tokens, s.num_decode_tokens,
                        s.num_waiting, tuple(s.batch)) for s in recorder.steps]
    summary = summarize_policy(results, steps)
    summary.update(complete=complete, wall_s=wall, process_cpu_cores=cpu / wall if wall else 0.0, load_avg_1m_at_start=load0,
                   load_avg_1m_at_end=os.getloadavg()[0], max_arrival_lag_s=max_lag, engine=kwargs)
    return {"summary": summary, "requests": [r.__dict__ for r in results], "steps": [s.__dict__ for s in steps]}


def calibrate(args: argparse.Namespace, trace: list[TraceRequest]) -> dict[str, Any]:
    """The machine's capacity on this trace's mix (docs/benchmarks.md): the rate an ideal batcher sustains at the
    step cost fitted to 2 x `max_num_seqs` of its requests arriving at once under continuous batching."""
    n = min(len(trace), 2 * args.max_num_seqs)
    run = run_policy(args, "continuous", [TraceRequest(r.index, 0.0, r.klass, r.prompt_token_ids, r.output_len) for r in trace[:n]])
    if (fit := fit_step_cost(run["steps"])) is None:
        raise RuntimeError("calibration: too few distinct steps to fit the step cost")
    fixed, per_decode, per_prompt, r2 = fit
    per_request_s = (statistics.fmean(r.output_len - 1 for r in trace) * (fixed / args.max_num_seqs + per_decode)
                     + statistics.fmean(r.prompt_len for r in trace) * per_prompt)
    return {"requests": n, "burst_req_s": n / run["summary"]["makespan_s"], "capacity_req_s": 1 / per_request_s, "load": args.load,
            "rate_req_s": args.load / per_request_s, "fit_ms": {"fixed": fixed * 1000, "per_decode": per_decode * 1000,
                                                               "per_prompt": per_prompt * 1000, "r2": r2}}


def body(results: dict[str, Any]) -> list[str]:
    w, st, pol = results["workload"], results["settings"], {k: v["summary"] for k, v in results["policies"].items()}
    cmp_, cal = results["comparison"], w.get("calibration")
    lines = [f"{w['num_requests']} requests, Poisson arrivals at {w['rate_per_s']:.2f}/s (seed {w['seed']}) over {w['arrival_span_s']:.1f} s"
             + (f", {cal['load']:g} × the capacity calibrated first ({cal['capacity_req_s']:.2f} req/s at full steps)" if cal else "")
             + f"; classes {w['classes']}; prompts {w['prompt_len']['min']}–{w['prompt_len']['max']} tokens, outputs "
             f"{w['output_len']['min']}–{w['output_len']['max']} (greedy, ignore_eos); in-process AsyncLLMEngine, {st['dtype']}, every "
             f"policy max_num_seqs {st['max_num_seqs']}, {st['max_num_batched_tokens']}-token steps, prefix caching off. Admission: "
             + "; ".join(f"{n}: {s['engine']['batching']}" + (f" (batch {s['engine']['batch_size']}, wait ≤ {s['engine']['batch_timeout_s']:g} s)"
                                                                if "batch_size" in s["engine"] else "") for n, s in pol.items()) + ".", ""]
    lines += table(["policy", "output tok/s", "req/s", "TTFT p50 (s)", "TTFT p99 (s)", "e2e p50 (s)", "e2e p99 (s)", "mean batch",
                    "tok/s vs static", "TTFT p50 vs static"],
                   [[name + ("" if s["complete"] else " (incomplete)"), f"{s['output_tok_s']:.1f}", f"{s['request_throughput']:.2f}",
                     num(s["ttft_p50_s"]), num(s["ttft_p99_s"]), num(s["e2e_p50_s"]), num(s["e2e_p99_s"]), f"{s['mean_batch_size']:.1f}",
                     num(cmp_.get(name, {}).get("output_tok_s_ratio")) + "x", num(cmp_.get(name, {}).get("ttft_p50_ratio")) + "x"]
                    for name, s in pol.items()])
    c = cmp_.get("continuous")
    if c and c["output_tok_s_ratio"] is not None and c["ttft_p50_ratio"] is not None:
        lines += [f"Targets: continuous / static throughput **{c['output_tok_s_ratio']:.2f}x** (target ≥ {TARGET_THROUGHPUT_RATIO}x: "
                  f"{'met' if c['output_tok_s_ratio'] >= TARGET_THROUGHPUT_RATIO else '**not met**'}), TTFT p50 **{c['ttft_p50_ratio']:.2f}x** "
                  f"(target ≤ {TARGET_TTFT_RATIO}x: {'met' if c['ttft_p50_ratio'] <= TARGET_TTFT_RATIO else '**not met**'}).", ""]
    if m := results.get("step_cost_model"):
        lines += ["## Step-cost model: the bound on this machine", "",
                  f"Fit over every step (R² {m['r2']:.2f}): a step costs **{m['fixed_ms']:.1f} ms fixed + {m['per_decode_token_ms']:.2f} ms "
                  f"per decoding sequence + {m['per_prompt_token_ms']:.2f} ms per prompt token**; an ideal continuous batcher (every decode step "
                  f"full) would need {m['ideal_continuous']['num_steps']} steps, {m['ideal_continuous']['busy_s']:.1f} s of engine time.", ""]
        if b := m.get("makespan_bound"):
            lines += [f"No admission policy can finish this trace in less than **{b['bound_s']:.1f} s** from its first arrival (work bound "
                      f"{b['work_bound_s']:.1f} s, chain bound {b['chain_bound_s']:.1f} s; batching_model.makespan_lower_bound), so none can "
                      f"reach more than **{m['throughput_bound_vs_static']:.2f}x** static's throughput; with the fixed cost alone (a "
                      f"memory-bound GPU's regime) the bound would be {m['fixed_only_bound_vs_static']:.2f}x. Prompt tokens are "
                      f"{m['prompt_share_of_static_busy']:.0%} of static's engine time. Each policy against the bound at the costs "
                      "fitted to its own steps (the machine's speed drifts between the policies' runs):", ""]
            lines += table(["policy", "fixed (ms)", "per decoding sequence (ms)", "per prompt token (ms)", "R²", "shortest makespan (s)",
                            "measured makespan (s)", "share of the bound"],
                           [[n, f"{f['fixed_ms']:.1f}", f"{f['per_decode_token_ms']:.2f}", f"{f['per_prompt_token_ms']:.2f}", f"{f['r2']:.2f}",
                             f"{f['bound_s']:.1f}", f"{pol[n]['makespan_s']:.1f}", f"**{f['share_of_bound']:.0%}**"] for n, f in m["own_fits"].items()])
    lines += ["## Diagnostics", ""] + table(
        ["policy", "makespan (s)", "steps", "mean step (ms)", "max batch", "engine busy", "process CPU (cores)", "load avg 1m start→end", "max send lag (ms)"],
        [[n, f"{s['makespan_s']:.1f}", s["num_steps"], f"{s['mean_step_s'] * 1000:.0f}", s["max_batch_size"], f"{s['busy_fraction']:.0%}",
          f"{s['process_cpu_cores']:.2f}", f"{s['load_avg_1m_at_start']:.1f}→{s['load_avg_1m_at_end']:.1f}", f"{s['max_arrival_lag_s'] * 1000:.0f}"]
         for n, s in pol.items()])
    return lines + ["Timelines: a row per request, by arrival; grey queued, orange prefill, blue decode.", ""]


def plots(results: dict[str, Any]) -> dict[str, report.Plot]:
    policies = results["policies"]
    x_max = max(p["summary"]["makespan_s"] for p in policies.values()) * 1.02 + 0.5

    def timelines(plt):  # a row per request: queued, then its prefill and decode steps
        from matplotlib.patches import Patch

        height = max(2.5, 0.09 * results["workload"]["num_requests"] + 1)
        fig, axes = plt.subplots(len(policies), 1, figsize=(11, height * len(policies)), sharex=True, squeeze=False)
        for ax, (name, policy) in zip(axes[:, 0], policies.items(), strict=True):
            segments = timeline_segments([StepRecord(**{**s, "batch": tuple(tuple(b) for b in s["batch"])}) for s in policy["steps"]])
            for r in policy["requests"]:
                queued_until = r["first_scheduled_s"] if r["first_scheduled_s"] is not None else (r["finished_s"] or x_max)
                ax.broken_barh([(r["arrival_s"], max(queued_until - r["arrival_s"], 1e-3))], (r["index"] - 0.4, 0.8), color=COLORS["queued"])
                for kind in ("prefill", "decode"):
                    spans = [(a, b - a) for a, b, k in segments.get(r["request_id"], ()) if k == kind]
                    ax.broken_barh(spans, (r["index"] - 0.4, 0.8), color=COLORS[kind])
            s = policy["summary"]
            ax.set(xlim=(0, x_max), ylim=(len(policy["requests"]) - 0.5, -0.5), ylabel="request (by arrival)")
            ax.set_title(f"{name}: {s['output_tok_s']:.1f} output tok/s, TTFT p50 {num(s['ttft_p50_s'], 1)} s, mean batch "
                         f"{s['mean_batch_size']:.1f}, makespan {s['makespan_s']:.0f} s", fontsize=10, loc="left")
            ax.legend(handles=[Patch(color=c, label=k) for k, c in COLORS.items()], loc="upper right", fontsize=7, ncol=3)
        axes[-1, 0].set_xlabel("time since the first arrival (s)")
        return fig

    return {"batching_timeline": timelines, "batching_batch_size": report.lines(
        "Sequences in each step", "time since the first arrival (s)", "sequences", {n: [(st["start_s"], st["num_seqs"]) for st in p["steps"]]
                                                                                   for n, p in policies.items()})}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = report.Parser(__doc__, "build/bench-batching-quick", "a quarter of the tokens", model=True, num_requests=16)
    p.add_argument("--policies", nargs="+", default=list(POLICIES), choices=POLICIES, help="run in order")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.options({"load": "arrival rate as a multiple of the calibrated capacity", "max_num_seqs": "the batch cap, every policy",
               "static_timeout_s": "static: the longest wait for a full batch"}, num_requests=96, load=1.5, max_num_seqs=32,
              static_timeout_s=2.0, seed=0, max_num_batched_tokens=2048, kv_cache_gib=1.0, policy_timeout_s=300.0)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    import torch
    from transformers import AutoConfig

    results, vocab = report.start("bench_batching"), AutoConfig.from_pretrained(args.model).vocab_size

    def build_trace(rate: float) -> list[TraceRequest]:
        trace = make_trace(args.num_requests, rate, args.seed, vocab_size=vocab)
        if args.quick:  # the same shape of trace, a quarter of the tokens
            trace = [TraceRequest(r.index, r.arrival_s, r.klass, r.prompt_token_ids[:max(8, r.prompt_len // 4)], max(2, r.output_len // 4))
                     for r in trace]
        return trace

    calibration = calibrate(args, build_trace(1.0))
    args.rate = calibration["rate_req_s"]
    log(f"capacity {calibration['capacity_req_s']:.2f} req/s at full steps (the burst: {calibration['burst_req_s']:.2f}) → "
        f"arrivals at {args.rate:.2f} req/s")
    trace = build_trace(args.rate)
    results["workload"] = {**describe_trace(trace), "rate_per_s": args.rate, "seed": args.seed, "calibration": calibration,
                           "requests": [[r.arrival_s, r.prompt_len, r.output_len] for r in trace]}  # the makespan bound's input
    results.update(settings={**vars(args), "torch_threads": torch.get_num_threads()}, policies={})
    for name in args.policies:
        gc.collect()
        results["policies"][name] = run_policy(args, name, trace)
        s = results["policies"][name]["summary"]
        log(f"{name}: {s['output_tok_s']:.1f} output tok/s, TTFT p50 {num(s['ttft_p50_s'])} s, makespan {s['makespan_s']:.1f} s"
            + ("" if s["complete"] else " (INCOMPLETE)"))
    results.update(comparison=compare({k: v["summary"] for k, v in results["policies"].items()}), step_cost_model=step_cost_model(results))
    committed = {**results, "policies": {n: {k: v for k, v in p.items() if k != "steps"} for n, p in results["policies"].items()}}
    paths = report.write(committed, args.out_dir, "batching", "W2 batching study: static vs dynamic vs continuous on one trace",
                         body(results), plots(results))
    log("wrote " + ", ".join(map(str, paths)))


if __name__ == "__main__":
    main()
