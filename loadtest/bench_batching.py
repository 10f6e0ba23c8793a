"""W2 batching study (docs/benchmarks.md): one seeded Poisson arrival trace with mixed prompt and output
lengths, replayed in one run against the same engine (AsyncLLMEngine in this process, same model,
kernels and options) under `static`, `dynamic` and `continuous` batching; only admission differs.

Per policy: output tok/s and requests/s over the makespan (first arrival → last finish), TTFT and e2e
p50/p99 (engine clock: arrival → first token / finish), mean batch size, from the engine's own
per-step `SchedulerStats` and per-request `RequestMetrics`. Writes reports/batching.{json,md},
reports/batching_timeline.png (+ one per policy: requests on y, time on x; queueing / prefill /
decode coloured) and reports/batching_batch_size.png (batch size over time); the full per-step
data (who was in each step) goes to build/bench-batching/raw.json.

    .venv/bin/python loadtest/bench_batching.py            # make bench-batching (≈ 5-10 min on 2 busy cores)
    .venv/bin/python loadtest/bench_batching.py --quick    # 16 requests, build/bench-batching-quick/ (≈ 1-2 min)
    .venv/bin/python loadtest/bench_batching.py --from-raw build/bench-batching/raw.json   # reports only

Policies share `max_num_seqs` (the batch cap) and the token budget; static waits for a full batch of
`--batch-size` (default: the cap) or `--static-timeout-s`; dynamic takes whatever waits, up to the cap.
One torch thread by default: on a 2-core machine that others load too, two OpenMP threads collapse
(measured: a bf16 decode step 7-26x slower than with one thread); every policy gets the same.
A policy that has not finished `--policy-timeout-s` after its first arrival is aborted and reported
as incomplete (the run stays bounded).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import gc
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))

from batching_report import fit_step_cost, write_reports  # noqa: E402
from batching_trace import (  # noqa: E402
    RequestResult,
    StepRecord,
    TraceRequest,
    compare,
    describe_trace,
    make_trace,
    summarize_policy,
)

REPO = Path(__file__).resolve().parents[1]
POLICIES = ("static", "dynamic", "continuous")


def log(msg: str) -> None:
    print(f"[bench-batching {time.strftime('%H:%M:%S')}] {msg}", flush=True)


class StepRecorder:
    """Stat logger: keeps every step's stats (called from the engine thread)."""

    def __init__(self) -> None:
        self.steps: list = []

    def record(self, scheduler_stats, finished) -> None:
        if scheduler_stats is not None:
            self.steps.append(scheduler_stats)


def parse_policy(spec: str) -> tuple[str, str, int]:
    """`static`, `dynamic`, `continuous`, or `static:8` / `dynamic:8` (that batch size) → (label, batching, batch_size);
    batch_size 0 means the batch cap (`--batch-size`, else `--max-num-seqs`)."""
    batching, _, size = spec.partition(":")
    if batching not in POLICIES or (size and (not size.isdigit() or int(size) < 1 or batching == "continuous")):
        raise ValueError(f"policies: {spec!r} is not one of {POLICIES} or static:N / dynamic:N")
    return (f"{batching}-b{size}" if size else batching), batching, int(size or 0)


def engine_kwargs(args: argparse.Namespace, batching: str, batch_size: int = 0) -> dict[str, Any]:
    kwargs: dict[str, Any] = {
        "dtype": args.dtype, "device": "cpu", "batching": batching, "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens, "kv_cache_memory_gib": args.kv_cache_gib,
        "enable_prefix_caching": False,  # random prompts never share blocks; keep every policy's work identical
    }
    size = batch_size or args.batch_size or args.max_num_seqs
    if batching == "static":
        kwargs.update(batch_size=size, batch_timeout_s=args.static_timeout_s)
    elif batching == "dynamic":
        kwargs.update(batch_size=size, batch_timeout_s=0.0)
    return kwargs


async def _replay(engine, trace: list[TraceRequest], policy: str, timeout_s: float) -> tuple[list[RequestResult], float, bool, float]:
    """Send each request at its arrival time; returns results (times relative to the first arrival),
    the trace start (monotonic), whether every request finished in time and the largest send lag."""
    from serve_app.types import GenerateRequest, SamplingParams

    t0 = time.monotonic() + 0.1
    finals: dict[int, Any] = {}
    lags: list[float] = []

    async def one(req: TraceRequest) -> None:
        await asyncio.sleep(max(0.0, t0 + req.arrival_s - time.monotonic()))
        lags.append(time.monotonic() - (t0 + req.arrival_s))
        params = SamplingParams(max_tokens=req.output_len, temperature=0.0, ignore_eos=True)
        request = GenerateRequest(f"{policy}-{req.index}", prompt=list(req.prompt_token_ids), sampling_params=params)
        async for out in engine.generate(request):
            if out.finished:
                finals[req.index] = out

    tasks = [asyncio.ensure_future(one(r)) for r in trace]
    done, pending = await asyncio.wait(tasks, timeout=timeout_s + trace[-1].arrival_s)
    for task in pending:  # leaving generate() aborts the request in the engine
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    for task in done:
        task.result()  # surface engine errors
    results = []
    for req in trace:
        out = finals.get(req.index)
        m = out.metrics if out is not None else None

        def rel(t: float | None) -> float | None:
            return None if t is None else t - t0

        results.append(RequestResult(
            request_id=f"{policy}-{req.index}", index=req.index, arrival_s=req.arrival_s if m is None else rel(m.arrival_time),
            first_scheduled_s=rel(m.first_scheduled_time) if m else None, first_token_s=rel(m.first_token_time) if m else None,
            finished_s=rel(m.finished_time) if m else None, num_output_tokens=m.num_generation_tokens if m else 0,
            num_preemptions=m.num_preemptions if m else 0,
        ))
    return results, t0, not pending, max(lags, default=0.0)


def run_policy(args: argparse.Namespace, spec: str, trace: list[TraceRequest]) -> dict[str, Any]:
    from serve_app.engine.async_engine import AsyncLLMEngine
    from serve_app.types import GenerateRequest, SamplingParams

    policy, batching, batch_size = parse_policy(spec)
    recorder = StepRecorder()
    kwargs = engine_kwargs(args, batching, batch_size)
    t_load = time.perf_counter()
    engine = AsyncLLMEngine.from_kwargs(args.model, stat_loggers=[recorder], **kwargs)
    load_s = time.perf_counter() - t_load
    loop = asyncio.new_event_loop()
    try:
        async def warmup() -> None:  # a prefill and a few decodes (kernels, allocator), not measured
            params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
            reqs = [GenerateRequest(f"warmup-{policy}-{i}", prompt=list(range(1000 + i, 1096 + i)), sampling_params=params) for i in range(2)]

            async def consume(r):
                async for _ in engine.generate(r):
                    pass

            await asyncio.gather(*(consume(r) for r in reqs))

        loop.run_until_complete(warmup())
        recorder.steps.clear()
        proc = psutil.Process()
        cpu0, load0 = sum(proc.cpu_times()[:2]), os.getloadavg()[0]
        wall0 = time.perf_counter()
        results, t0, complete, max_lag = loop.run_until_complete(_replay(engine, trace, policy, args.policy_timeout_s))
        wall = time.perf_counter() - wall0
        cpu = sum(proc.cpu_times()[:2]) - cpu0
    finally:
        engine.shutdown()
        loop.close()
    steps = [StepRecord(s.step_start_time - t0, s.step_duration_s, s.num_scheduled_seqs, s.num_prefill_tokens,
                        s.num_decode_tokens, s.num_waiting, tuple(s.batch)) for s in recorder.steps]
    summary = summarize_policy(results, steps)
    summary.update(complete=complete, engine_load_s=load_s, wall_s=wall, process_cpu_cores=cpu / wall if wall else 0.0,
                   load_avg_1m_at_start=load0, load_avg_1m_at_end=os.getloadavg()[0], max_arrival_lag_s=max_lag,
                   engine=kwargs)
    return {"summary": summary, "requests": [r.__dict__ for r in results], "steps": [s.__dict__ for s in steps]}


def calibrate(args: argparse.Namespace, trace: list[TraceRequest]) -> dict[str, Any]:
    """The machine's capacity on this trace's mix: continuous batching with its first
    2 x `max_num_seqs` requests all arriving at once, its steps fitted by the step-cost model
    (`batching_report.fit_step_cost`), and the rate an ideal batcher sustains at that cost (every
    decode step full): 1 / (the trace's mean engine time per request). Replays then arrive at
    `--load` x that rate, so every policy, continuous batching included, meets a growing queue and
    the comparison measures batching, not how fast the trace arrives on this machine. (The burst's
    own requests per second of makespan understate the capacity: its drain runs nearly empty steps.)"""
    n = min(len(trace), 2 * args.max_num_seqs)
    burst = [TraceRequest(r.index, 0.0, r.klass, r.prompt_token_ids, r.output_len) for r in trace[:n]]
    run = run_policy(args, "continuous", burst)
    s = run["summary"]
    fit = fit_step_cost(run["steps"])
    if fit is None:
        raise RuntimeError("calibration: too few distinct steps to fit the step cost")
    fixed, per_decode, per_prompt, r2 = fit
    mean_decodes = statistics.fmean(r.output_len - 1 for r in trace)
    mean_prompt = statistics.fmean(r.prompt_len for r in trace)
    per_request_s = mean_decodes * (fixed / args.max_num_seqs + per_decode) + mean_prompt * per_prompt
    capacity = 1.0 / per_request_s
    return {"requests": n, "makespan_s": s["makespan_s"], "burst_req_s": n / s["makespan_s"], "capacity_req_s": capacity,
            "fit_ms": {"fixed": fixed * 1000, "per_decode": per_decode * 1000, "per_prompt": per_prompt * 1000, "r2": r2},
            "load": args.load, "rate_req_s": args.load * capacity, "output_tok_s": s["output_tok_s"]}


def machine_info() -> dict[str, Any]:
    import torch

    try:
        git = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True, check=False).stdout.strip()
    except OSError:
        git = ""
    return {"cpu": platform.processor() or platform.machine(), "logical_cores": psutil.cpu_count(),
            "memory_gib": round(psutil.virtual_memory().total / 2**30, 1), "python": platform.python_version(),
            "torch": torch.__version__, "torch_threads": torch.get_num_threads(), "git": git}


def command_line() -> str:
    script = Path(sys.argv[0]).resolve()
    rel = script.relative_to(REPO) if script.is_relative_to(REPO) else script
    return " ".join([".venv/bin/python", str(rel), *map(shlex.quote, sys.argv[1:])])


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=str(REPO / "models" / "smollm2-135m-instruct"))
    p.add_argument("--policies", default=",".join(POLICIES),
                   help="comma-separated, run in this order; static:N / dynamic:N add a variant with batch size N")
    p.add_argument("--num-requests", type=int, default=96)
    p.add_argument("--rate", type=float, default=None,
                   help="Poisson arrivals per second (default: --load x the capacity calibrated on this machine first)")
    p.add_argument("--load", type=float, default=1.5, help="arrival rate as a multiple of the calibrated capacity")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default, every core)")
    p.add_argument("--max-num-seqs", type=int, default=32, help="batch cap, every policy")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--batch-size", type=int, default=0, help="static/dynamic batch size (0: --max-num-seqs)")
    p.add_argument("--static-timeout-s", type=float, default=2.0, help="static: longest wait for a full batch")
    p.add_argument("--kv-cache-gib", type=float, default=1.0)
    p.add_argument("--policy-timeout-s", type=float, default=300.0, help="abort a policy's run this long after its last arrival")
    p.add_argument("--out-dir", help="default reports/ (build/bench-batching-quick/ with --quick)")
    p.add_argument("--quick", action="store_true", help="smoke run: 16 requests at 4 req/s, a quarter of the tokens")
    p.add_argument("--from-raw", help="only rewrite the reports from a previous run's raw JSON (build/bench-batching/raw.json)")
    args = p.parse_args(argv)
    args.policies = [x.strip() for x in args.policies.split(",") if x.strip()]
    for spec in args.policies:
        try:
            parse_policy(spec)
        except ValueError as exc:
            p.error(str(exc))
    if args.quick:
        args.num_requests = 16
    args.out_dir = Path(args.out_dir or (REPO / ("build/bench-batching-quick" if args.quick else "reports")))
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.from_raw:
        results = json.loads(Path(args.from_raw).read_text())
        paths = write_reports(results, args.out_dir)
        log("rewrote " + ", ".join(str(p) for p in paths) + f" from {args.from_raw} (measured {results['date']})")
        return 0
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    started = time.perf_counter()
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(args.model).vocab_size
    def build_trace(rate: float) -> list[TraceRequest]:
        trace = make_trace(args.num_requests, rate, args.seed, vocab_size=vocab)
        if args.quick:  # same shape of trace, a quarter of the output tokens
            trace = [TraceRequest(r.index, r.arrival_s, r.klass, r.prompt_token_ids[: max(8, r.prompt_len // 4)], max(2, r.output_len // 4))
                     for r in trace]
        return trace

    calibration = None
    if args.rate is None:
        log(f"calibrating: continuous batching, {min(args.num_requests, 2 * args.max_num_seqs)} of the trace's requests at once ...")
        calibration = calibrate(args, build_trace(1.0))
        args.rate = calibration["rate_req_s"]
        log(f"capacity {calibration['capacity_req_s']:.2f} req/s at full steps (the burst itself: {calibration['burst_req_s']:.2f}) -> "
            f"arrivals at {args.load} x = {args.rate:.2f} req/s")
        gc.collect()
    trace = build_trace(args.rate)
    workload = describe_trace(trace)
    log(f"trace: {workload['num_requests']} requests over {workload['arrival_span_s']:.1f} s "
        f"({workload['prompt_tokens']} prompt + {workload['output_tokens']} output tokens, classes {workload['classes']}); "
        f"torch threads {torch.get_num_threads()}, load avg {os.getloadavg()[0]:.1f}")
    policies: dict[str, Any] = {}
    for spec in args.policies:
        policy = parse_policy(spec)[0]
        log(f"{policy}: replaying")
        policies[policy] = run_policy(args, spec, trace)
        s = policies[policy]["summary"]
        log(f"{policy}: {s['output_tok_s']:.1f} output tok/s, {s['request_throughput']:.2f} req/s, TTFT p50 {s['ttft_p50_s']:.2f} s "
            f"p99 {s['ttft_p99_s']:.2f} s, mean batch {s['mean_batch_size']:.1f}, makespan {s['makespan_s']:.1f} s"
            + ("" if s["complete"] else " (INCOMPLETE: timed out)"))
        gc.collect()
    results = {
        "workload": {**workload, "rate_per_s": args.rate, "seed": args.seed, "quick": args.quick, "calibration": calibration,
                     # (arrival s, prompt tokens, output tokens) per request: the makespan bound's input
                     "requests": [[r.arrival_s, r.prompt_len, r.output_len] for r in trace]},
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "machine": machine_info(),
        "command": command_line(),
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "policies": policies,
        "comparison": compare({k: v["summary"] for k, v in policies.items()}),
        "duration_s": time.perf_counter() - started,
    }
    raw = REPO / "build" / "bench-batching" / ("raw-quick.json" if args.quick else "raw.json")
    paths = write_reports(results, args.out_dir, raw_path=raw)
    log(f"done in {results['duration_s']:.0f} s: " + ", ".join(str(p.relative_to(REPO)) if p.is_relative_to(REPO) else str(p) for p in paths))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
