"""W3 routing benchmark (docs/benchmarks.md): KV-aware vs power-of-two vs round-robin routing.

One Ray instance on 127.0.0.1, one run. For each router the app is deployed with 2 LLMServer replicas
(small KV caches, one torch thread each) and the *same* two traces are replayed open-loop from this
process through a DeploymentHandle (which runs the configured router, as the ingress's handle does):

- skewed: Poisson arrivals near capacity, ~12% long requests (384-token prompt, 128 output tokens)
  among short ones (48 → 16);
- uniform: the same arrival times, every request of the mix's mean size.

Each trace is replayed once per seed (`--seeds`, default 0 1 2: different arrival times and long
requests), idle in between: a p99 over one ~90-request replay is its one or two slowest requests,
and which bursts a seed holds moves it by 3x, so the report pools every seed's requests and lists
each seed's ratio as the spread.

"Near capacity": unless `--rate` is given, a saturated closed loop on the first deployment (16
clients replaying the skewed mix) measures how many requests/s the two replicas complete; the traces
arrive at `--load` (0.85) times that. Measured per run: TTFT (from each request's scheduled arrival, so queueing counts) p50/p99,
e2e p99, output tok/s over the run, preemptions and requests per replica (from the replica probe,
`loadtest/replica_probe.py`). Routers run in sequence on a shared 2-core machine: read the ratios,
not the absolute numbers, and expect noise from whatever else runs.

    .venv/bin/python loadtest/bench_routing.py                 # writes reports/routing.{json,md,png}
    .venv/bin/python loadtest/bench_routing.py --quick         # smoke run (one seed) into build/bench-routing-quick/
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import json
import os
import platform
import shlex
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # Ray on the loopback address only

from loadtest.replica_probe import FACTORY, PROBE_DIR_ENV, read_probes, serve_replicas  # noqa: E402
from loadtest.routing_trace import Mix, RequestResult, TraceRequest, compare, make_trace, summarize_run  # noqa: E402
from serve_app.serving.routing_config import ROUTER_CLASSES  # noqa: E402

APP = "bench-routing"  # + "-<router>": Serve caches a driver's handles by (deployment, app), and a
# handle keeps the request router it started with, so each router needs its own app name
ROUTERS = ("pow2", "kv_aware", "round_robin")  # the first deployed calibrates the rate: the baseline
TRACES = ("skewed", "uniform")


def app_args(router: str, opts: argparse.Namespace) -> dict[str, Any]:
    return {
        "model": str(REPO / "models" / "smollm2-135m-instruct"), "num_replicas": 2, "num_cpus_per_replica": 0.5,
        "torch_num_threads": 1, "max_ongoing_requests": 32, "max_queued_requests": -1,
        "request_routing_stats_period_s": 0.2, "health_check_period_s": 2.0, "router": router, "api_key_env": "",
        "stat_logger_factories": [FACTORY],
        "engine": {"dtype": "bfloat16", "num_blocks": opts.num_blocks, "max_num_seqs": 16},
        **({"router_kwargs": dict(opts.kv_router_kwargs)} if router == "kv_aware" and opts.kv_router_kwargs else {}),
    }


# ---- replicas ------------------------------------------------------------------------------------------
def wait_idle(app: str, timeout_s: float = 120.0) -> None:
    import ray

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        replicas = serve_replicas(app)
        stats = [ray.get(a.record_routing_stats.remote(), timeout=10) for a in replicas.values()]
        if stats and all(s["num_running"] == 0 and s["num_waiting"] == 0 for s in stats):
            return
        time.sleep(0.5)
    raise RuntimeError("replicas did not become idle")


def probe_snapshot(probe_dir: Path, replica_ids: set[str]) -> dict[str, dict[str, Any]]:
    return {rid: s for rid, s in read_probes(probe_dir).items() if rid in replica_ids}


def replica_deltas(before: dict, after: dict, tag: str) -> tuple[int, dict[str, dict[str, int]]]:
    """Preemptions during the run, and per replica: requests of this run (by kind) it served."""
    preemptions = 0
    per_replica: dict[str, dict[str, int]] = {}
    for rid, state in after.items():
        preemptions += state["num_preemptions"] - before.get(rid, {}).get("num_preemptions", 0)
        mine = [r for r in state["request_ids"] if r.startswith(tag + "-")]
        counts = {"requests": len(mine), "preemptions": state["num_preemptions"] - before.get(rid, {}).get("num_preemptions", 0)}
        for kind in ("long", "short", "uniform"):
            counts[kind] = sum(1 for r in mine if r.endswith("-" + kind))
        per_replica[rid] = counts
    return preemptions, per_replica


def _request_router(handle: Any) -> Any:
    """The request router inside this process's handle (Ray-private attributes: None if they move)."""
    try:
        return handle._router._asyncio_router.request_router
    except AttributeError:
        return None


def router_class(handle: Any) -> str | None:
    router = _request_router(handle)
    return None if router is None else type(router).__name__


def router_decisions(handle: Any) -> dict[str, int]:
    """The KV-aware router's decisions so far by mode ("kv" / "fallback": stale or missing stats)."""
    return dict(getattr(_request_router(handle), "num_decisions", {}))


def replica_of_requests(snapshot: dict[str, dict[str, Any]], tag: str) -> dict[str, str]:
    """Engine request id → the replica that ran it (the last one, if it ran on more than one)."""
    return {r: rid for rid, state in snapshot.items() for r in state["request_ids"] if r.startswith(tag + "-")}


# ---- load -----------------------------------------------------------------------------------------------
async def send(handle: Any, request_id: str, prompt: list[int], max_tokens: int, start: float) -> tuple[float | None, float, int]:
    """One streamed generation; (TTFT, e2e, output tokens), timed from `start` (loop clock)."""
    from serve_app.types import GenerateRequest, SamplingParams

    loop = asyncio.get_running_loop()
    request = GenerateRequest(request_id, prompt=prompt,
                              sampling_params=SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    ttft, tokens = None, 0
    async for chunk in handle.options(stream=True).generate.remote(request):
        if chunk.token_ids and ttft is None:
            ttft = loop.time() - start
        tokens += len(chunk.token_ids)
    return ttft, loop.time() - start, tokens


async def replay(handle: Any, trace: list[TraceRequest], tag: str, drain_s: float) -> tuple[list[RequestResult], float]:
    loop = asyncio.get_running_loop()
    t0 = loop.time() + 0.5

    async def one(req: TraceRequest) -> RequestResult:
        start = t0 + req.arrival_s
        await asyncio.sleep(max(0.0, start - loop.time()))
        try:
            ttft, e2e, tokens = await send(handle, f"{tag}-{req.index}-{req.kind}", list(req.prompt), req.max_tokens, start)
            error = None if tokens == req.max_tokens else f"{tokens} tokens, expected {req.max_tokens}"
            return RequestResult(req.index, req.kind, req.arrival_s, ttft, e2e, tokens, error)
        except Exception as exc:  # noqa: BLE001 - recorded, the run goes on
            return RequestResult(req.index, req.kind, req.arrival_s, None, None, 0, type(exc).__name__)

    tasks = [asyncio.ensure_future(one(r)) for r in trace]
    done, pending = await asyncio.wait(tasks, timeout=(trace[-1].arrival_s if trace else 0) + drain_s)
    for task in pending:
        task.cancel()
    results = []
    for req, task in zip(trace, tasks, strict=True):
        if task in done:
            results.append(task.result())
        else:
            results.append(RequestResult(req.index, req.kind, req.arrival_s, None, None, 0, "timeout"))
    finished = [t0 + r.arrival_s + r.e2e_s for r in results if r.e2e_s is not None]
    wall = (max(finished) - t0 - trace[0].arrival_s) if finished else 0.0
    return results, wall


async def calibrate(handle: Any, mix: Mix, seconds: float, concurrency: int, seed: int) -> float:
    """Saturated closed loop: `concurrency` clients each replay the skewed trace's requests in order,
    back to back, so completions follow the trace's mix; capacity = requests completed per second from
    a quarter into the window (ramp-up skipped) to its end. Requests still running at the end are
    cancelled (aborted in the engines), not waited for: counting a drain would understate capacity."""
    trace = make_trace("skewed", mix, rate=1000.0, duration_s=10.0, seed=seed + 99)
    loop = asyncio.get_running_loop()
    start = loop.time()
    completed = 0
    counter = iter(range(10**9))

    async def client(offset: int) -> None:
        nonlocal completed
        for k in range(offset, 10**9):
            req = trace[k % len(trace)]
            await send(handle, f"calib-{next(counter)}-{req.kind}", list(req.prompt), req.max_tokens, loop.time())
            if loop.time() - start >= seconds / 4:
                completed += 1

    clients = [asyncio.ensure_future(client(i * len(trace) // concurrency)) for i in range(concurrency)]
    await asyncio.sleep(seconds)
    measured = completed
    for c in clients:
        c.cancel()
    await asyncio.gather(*clients, return_exceptions=True)
    if measured == 0:
        raise RuntimeError(f"calibration: no request completed in {seconds:.0f} s")
    return measured / (seconds * 3 / 4)


# ---- one trace -----------------------------------------------------------------------------------------
def run_trace(handle: Any, app: str, router: str, name: str, traces: list[list[TraceRequest]], opts: argparse.Namespace,
              probe_dir: Path, replica_ids: set[str], loop: asyncio.AbstractEventLoop) -> dict[str, Any]:
    """Replay one trace per seed, one after another (idle in between); the summary pools every seed's
    requests (percentiles over all of them), and `per_seed` keeps each replay's own summary."""
    pooled: list[RequestResult] = []
    requests: list[dict[str, Any]] = []
    per_seed: list[dict[str, Any]] = []
    wall = 0.0
    preemptions = 0
    per_replica: dict[str, dict[str, int]] = {}
    decisions: dict[str, int] = {}
    for seed, trace in zip(opts.seeds, traces, strict=True):
        wait_idle(app)
        tag = f"{router}-{name}-s{seed}"
        before = probe_snapshot(probe_dir, replica_ids)
        decisions_before = router_decisions(handle)
        results, seed_wall = loop.run_until_complete(replay(handle, trace, tag, opts.drain_s))
        time.sleep(1.0)  # the probes' last writes
        after = probe_snapshot(probe_dir, replica_ids)
        seed_preemptions, seed_replicas = replica_deltas(before, after, tag)
        seed_decisions = {mode: n - decisions_before.get(mode, 0) for mode, n in router_decisions(handle).items()}
        summary = summarize_run(results, seed_wall, seed_preemptions, seed_replicas)
        per_seed.append({"seed": seed, "router_decisions": seed_decisions,
                         **{k: summary[k] for k in ("num_requests", "num_errors", "ttft_p50_s", "ttft_p99_s", "e2e_p99_s",
                                                    "output_tok_s", "preemptions")}})
        served_by = replica_of_requests(after, tag)
        requests += [{**r.as_dict(), "seed": seed, "replica": served_by.get(f"{tag}-{r.index}-{r.kind}")} for r in results]
        pooled += results
        wall += seed_wall
        preemptions += seed_preemptions
        for rid, counts in seed_replicas.items():
            total = per_replica.setdefault(rid, {})
            for key, n in counts.items():
                total[key] = total.get(key, 0) + n
        for mode, n in seed_decisions.items():
            decisions[mode] = decisions.get(mode, 0) + n
        print(f"[bench-routing] {router} {name} seed {seed}: {len(trace)} requests, TTFT p50 {summary['ttft_p50_s']:.3f} s "
              f"p99 {summary['ttft_p99_s']:.3f} s, e2e p99 {summary['e2e_p99_s']:.2f} s, {summary['output_tok_s']:.0f} out tok/s, "
              f"{seed_preemptions} preemptions, errors {summary['num_errors']}, router decisions {seed_decisions}, "
              f"per replica {seed_replicas}", flush=True)
    summary = summarize_run(pooled, wall, preemptions, per_replica)
    summary.update(per_seed=per_seed, router_decisions=decisions, requests=requests,
                   ttft_cdf=sorted(r.ttft_s for r in pooled if r.ttft_s is not None))
    return summary


# ---- one router ----------------------------------------------------------------------------------------
def run_router(router: str, opts: argparse.Namespace, mix: Mix, probe_dir: Path, rate: float | None,
               loop: asyncio.AbstractEventLoop) -> tuple[dict[str, Any], float]:
    from ray import serve

    from serve_app.serving.app import build_app

    started = time.monotonic()
    app = f"{APP}-{router}"
    serve.run(build_app(app_args(router, opts)), name=app, route_prefix="/")
    handle = serve.get_deployment_handle("LLMServer", app_name=app)
    replica_ids = set(serve_replicas(app))
    out: dict[str, Any] = {"router": router, "deploy_s": time.monotonic() - started, "replicas": sorted(replica_ids), "runs": {}}
    print(f"[bench-routing] {router}: deployed in {out['deploy_s']:.1f} s", flush=True)
    try:
        warm = make_trace("uniform", mix, rate=10.0, duration_s=0.4, seed=7)
        loop.run_until_complete(replay(handle, warm, f"{router}-warmup", 60.0))
        out["router_class"] = router_class(handle)
        expected = ROUTER_CLASSES[router].rsplit(":", 1)[-1]
        if out["router_class"] not in (expected, None):
            raise RuntimeError(f"{router}: the handle routes with {out['router_class']}, not {expected}")
        if rate is None:
            capacity = loop.run_until_complete(calibrate(handle, mix, opts.calibrate_s, opts.calibrate_concurrency, opts.seeds[0]))
            rate = opts.load * capacity
            out["calibration"] = {"router": router, "capacity_req_s": capacity, "load": opts.load, "rate_req_s": rate,
                                  "seconds": opts.calibrate_s, "concurrency": opts.calibrate_concurrency}
            print(f"[bench-routing] calibration: {capacity:.2f} req/s completed → trace rate {rate:.2f} req/s", flush=True)
        for name in TRACES:
            out["runs"][name] = run_trace(handle, app, router, name, [make_trace(name, mix, rate, opts.duration, seed) for seed in opts.seeds],
                                          opts, probe_dir, replica_ids, loop)
            out["runs"][name]["rate_req_s"] = rate
    finally:
        serve.delete(app)
    return out, rate


def compare_runs(routers: dict[str, Any], name: str) -> dict[str, Any]:
    """KV-aware ÷ pow2 on the pooled requests of every seed, plus the TTFT p99 ratio of each seed's replay."""
    out = compare({r: v["runs"].get(name, {}) for r, v in routers.items()})
    seeds = {r: v["runs"].get(name, {}).get("per_seed", []) for r, v in routers.items()}
    out["ttft_p99_ratio_per_seed"] = [compare({"kv_aware": kv, "pow2": p2})["ttft_p99_ratio"]
                                      for kv, p2 in zip(seeds.get("kv_aware", []), seeds.get("pow2", []), strict=False)]
    return out


# ---- report -------------------------------------------------------------------------------------------
def _f(x: float | None, digits: int = 2, scale: float = 1.0) -> str:
    return "–" if x is None else f"{x * scale:.{digits}f}"


def write_report(results: dict[str, Any], out_dir: Path, raw_path: Path | None = None) -> None:
    """routing.md, routing.png and routing.json (summaries; without the per-request lists, which go to
    `raw_path` with everything else when given)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    if raw_path is not None:
        raw_path.parent.mkdir(parents=True, exist_ok=True)
        raw_path.write_text(json.dumps(results))
    committed = {**results, "routers": {router: {**r, "runs": {name: {k: v for k, v in run.items() if k != "requests"}
                                                             for name, run in r["runs"].items()}}
                                        for router, r in results["routers"].items()}}
    (out_dir / "routing.json").write_text(json.dumps(committed, indent=2))
    m, w = results["mix"], results["workload"]
    lines = [
        "# W3 routing: KV-aware vs power-of-two vs round-robin", "",
        f"Generated {results['date']} (commit {results.get('git', 'unknown')}) by:", "", f"    {results['command']}", "",
        f"Machine: {results['machine']}; load average at start {results['loadavg_start']}, at end {results['loadavg_end']} "
        "(a shared 2-core machine: routers ran one after another, so machine-load drift is part of the differences).",
        f"Deployment per router: 2 LLMServer replicas, bf16, {w['num_blocks']} KV blocks × 16 tokens each, max_num_seqs 16, "
        "1 torch thread each, routing stats every 0.2 s; load sent from the benchmark process through a "
        "DeploymentHandle (it runs the deployment's router, as the ingress's handle does), streamed, greedy, ignore_eos.",
        f"Traces (one per seed, seeds {', '.join(map(str, w['seeds']))}, replayed in turn; Poisson, {w['duration_s']:.0f} s of "
        f"arrivals each at {w['rate_req_s']:.2f} req/s = "
        f"{w['load']:.2f} × the calibrated capacity {_f(w.get('capacity_req_s'))} req/s): **skewed** = "
        f"{m['long_fraction']:.0%} long ({m['long_prompt']}-token prompt → {m['long_output']} tokens) among short "
        f"({m['short_prompt']} → {m['short_output']}); **uniform** = every request {m['mean_prompt']} → {m['mean_output']} "
        "tokens (same token volume). TTFT is measured from each request's scheduled arrival. Percentiles pool the "
        "requests of every seed's replay; the per-seed table shows the spread.", "",
    ]
    for name in TRACES:
        lines += [f"## {name} trace", "",
                  "| router | requests | TTFT p50 (s) | TTFT p99 (s) | e2e p99 (s) | output tok/s | preemptions | "
                  "requests per replica (long) | errors |", "|---|---|---|---|---|---|---|---|---|"]
        for router, r in results["routers"].items():
            run = r["runs"].get(name)
            if run is None:
                continue
            split = " / ".join(f"{c['requests']} ({c['long']})" for c in run["per_replica"].values())
            lines.append(f"| {router} | {run['num_requests']} | {_f(run['ttft_p50_s'], 3)} | {_f(run['ttft_p99_s'], 3)} | "
                         f"{_f(run['e2e_p99_s'])} | {_f(run['output_tok_s'], 0)} | {run['preemptions']} | {split} | "
                         f"{run['num_errors']} |")
        seeds = w["seeds"]
        lines += ["", "TTFT p99 (s) of each seed's replay:", "", "| router | " + " | ".join(f"seed {s}" for s in seeds) + " |",
                  "|---|" + "---|" * len(seeds)]
        for router, r in results["routers"].items():
            per_seed = r["runs"].get(name, {}).get("per_seed", [])
            lines.append(f"| {router} | " + " | ".join(_f(s["ttft_p99_s"], 3) for s in per_seed) + " |")
        if name == "skewed":
            lines += ["", "By request kind (TTFT p50 / p99, s):", "", "| router | short | long |", "|---|---|---|"]
            for router, r in results["routers"].items():
                k = r["runs"].get(name, {}).get("by_kind", {})
                cells = [f"{_f(k.get(kind, {}).get('ttft_p50_s'), 3)} / {_f(k.get(kind, {}).get('ttft_p99_s'), 3)}"
                         for kind in ("short", "long")]
                lines.append(f"| {router} | {cells[0]} | {cells[1]} |")
        lines.append("")
    c = results["comparison"]
    sk, un = c.get("skewed", {}), c.get("uniform", {})
    lines += ["## KV-aware ÷ power-of-two (targets)", "",
              "| trace | TTFT p99 (pooled) | TTFT p99 per seed | TTFT p50 | e2e p99 | output tok/s | target | met |",
              "|---|---|---|---|---|---|---|---|",
              f"| skewed | {_f(sk.get('ttft_p99_ratio'))} | {_per_seed(sk)} | {_f(sk.get('ttft_p50_ratio'))} | "
              f"{_f(sk.get('e2e_p99_ratio'))} | {_f(sk.get('output_tok_s_ratio'))} | TTFT p99 ≤ 0.70, tok/s ≥ 1.00 (no loss; "
              f"±3% noise allowed) | {_verdict(sk, 0.70, 0.97)} |",
              f"| uniform | {_f(un.get('ttft_p99_ratio'))} | {_per_seed(un)} | {_f(un.get('ttft_p50_ratio'))} | "
              f"{_f(un.get('e2e_p99_ratio'))} | {_f(un.get('output_tok_s_ratio'))} | TTFT p99 ≤ 1.10 | {_verdict(un, 1.10, None)} |", "",
              "One run, as measured; no re-runs were picked. Summaries, per-replica counts and the KV-aware router's "
              "decisions by mode: `routing.json`; every request's timings and replica: `build/bench-routing/raw.json` "
              "(not committed). Plot: `routing.png`.", ""]
    (out_dir / "routing.md").write_text("\n".join(lines))
    plot(results, out_dir / "routing.png")


def _per_seed(ratios: dict[str, Any]) -> str:
    return ", ".join(_f(r) for r in ratios.get("ttft_p99_ratio_per_seed", [])) or "–"


def _verdict(ratios: dict[str, Any], ttft_max: float, tok_min: float | None) -> str:
    ttft = ratios.get("ttft_p99_ratio")
    if ttft is None:
        return "n/a"
    ok = ttft <= ttft_max
    if tok_min is not None:
        tok = ratios.get("output_tok_s_ratio")
        ok = ok and tok is not None and tok >= tok_min
    return "yes" if ok else "no"


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    routers = list(results["routers"])
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.6))
    width = 0.8 / max(len(routers), 1)
    for i, router in enumerate(routers):
        runs = results["routers"][router]["runs"]
        xs = [t + i * width for t in range(len(TRACES))]
        axes[0].bar(xs, [runs.get(t, {}).get("ttft_p99_s") or 0 for t in TRACES], width, label=f"{router} p99")
        axes[0].scatter(xs, [runs.get(t, {}).get("ttft_p50_s") or 0 for t in TRACES], color="black", marker="_", s=200,
                        zorder=3, label="p50" if i == 0 else None)
        axes[1].bar(xs, [runs.get(t, {}).get("output_tok_s") or 0 for t in TRACES], width, label=router)
        cdf = runs.get("skewed", {}).get("ttft_cdf", [])
        if cdf:
            axes[2].plot(cdf, [(k + 1) / len(cdf) for k in range(len(cdf))], drawstyle="steps-post", label=router)
    for ax, title, ylabel in ((axes[0], "TTFT p99 (bars) and p50 (ticks)", "seconds"),
                              (axes[1], "output tokens/s", "tok/s")):
        ax.set_xticks([t + width * (len(routers) - 1) / 2 for t in range(len(TRACES))], TRACES)
        ax.set_title(title)
        ax.set_ylabel(ylabel)
        ax.legend(fontsize=8)
    axes[2].set_xscale("log")
    axes[2].set_title("TTFT CDF, skewed trace")
    axes[2].set_xlabel("seconds (log)")
    axes[2].legend(fontsize=8)
    fig.suptitle("W3 routing: 2 replicas, same traces; " + results["date"])
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---- main -----------------------------------------------------------------------------------------------
def _router_kwarg(text: str) -> tuple[str, Any]:
    name, sep, value = text.partition("=")
    if not sep:
        raise argparse.ArgumentTypeError(f"{text!r}: expected NAME=VALUE")
    return name, json.loads(value)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--routers", nargs="+", default=list(ROUTERS), choices=ROUTERS)
    parser.add_argument("--duration", type=float, default=32.0, help="seconds of arrivals per trace")
    parser.add_argument("--rate", type=float, default=None, help="arrivals/s (default: --load × calibrated capacity)")
    parser.add_argument("--load", type=float, default=0.85)
    parser.add_argument("--calibrate-s", type=float, default=32.0)
    parser.add_argument("--calibrate-concurrency", type=int, default=16)
    parser.add_argument("--num-blocks", type=int, default=96, help="KV blocks per replica (2 long + 8 short requests fill one)")
    parser.add_argument("--drain-s", type=float, default=90.0, help="after the last arrival, wait this long at most")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2],
                        help="one trace per seed, replayed in turn; results pool all of them, and per-seed ratios show the spread")
    parser.add_argument("--kv-router-kwargs", nargs="*", default=[], type=_router_kwarg, metavar="NAME=VALUE",
                        help="KVCacheAwareRouter options (routing_config.KVRouterSettings), e.g. prefill_weight=0")
    parser.add_argument("--out-dir", default=None)
    parser.add_argument("--quick", action="store_true", help="8 s traces, 12 s calibration (smoke run)")
    opts = parser.parse_args()
    if opts.quick:
        opts.duration, opts.calibrate_s, opts.drain_s, opts.seeds = 8.0, 12.0, 60.0, opts.seeds[:1]
    out_dir = Path(opts.out_dir or (REPO / ("build/bench-routing-quick" if opts.quick else "reports")))
    mix = Mix()
    os.chdir(REPO)  # replicas import loadtest.replica_probe from the driver's working directory
    probe_dir = Path(tempfile.mkdtemp(prefix="routing-probes-"))
    os.environ[PROBE_DIR_ENV] = str(probe_dir)  # before Ray starts: replicas inherit it

    import ray
    from ray import serve

    started = time.monotonic()
    results: dict[str, Any] = {
        "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "command": ".venv/bin/python loadtest/bench_routing.py " + " ".join(shlex.quote(a) for a in sys.argv[1:]),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}",
        "git": _git_commit(),
        "loadavg_start": " ".join(f"{x:.2f}" for x in os.getloadavg()),
        "mix": {**Mix().__dict__, "mean_prompt": mix.mean_prompt, "mean_output": mix.mean_output},
        "workload": {"duration_s": opts.duration, "seeds": opts.seeds, "load": opts.load, "num_blocks": opts.num_blocks},
        "routers": {},
    }
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, namespace="bench-routing")
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    rate = opts.rate
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": _free_port()}, proxy_location="HeadOnly")
        for router in opts.routers:
            out, rate = run_router(router, opts, mix, probe_dir, rate, loop)
            if "calibration" in out:
                results["workload"]["capacity_req_s"] = out["calibration"]["capacity_req_s"]
            results["routers"][router] = out
        results["workload"]["rate_req_s"] = rate
    finally:
        with contextlib.suppress(Exception):
            serve.shutdown()
        ray.shutdown()
        shutil.rmtree(probe_dir, ignore_errors=True)
    results["loadavg_end"] = " ".join(f"{x:.2f}" for x in os.getloadavg())
    results["duration_s"] = time.monotonic() - started
    results["comparison"] = {name: compare_runs(results["routers"], name) for name in TRACES}
    write_report(results, out_dir, REPO / "build" / ("bench-routing-quick" if opts.quick else "bench-routing") / "raw.json")
    print(f"[bench-routing] {results['duration_s']:.0f} s; wrote {out_dir / 'routing.md'}")
    print((out_dir / "routing.md").read_text())


def _git_commit() -> str:
    import subprocess

    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "serve_app", "loadtest"], cwd=REPO,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return out.stdout.strip() + (" (+ uncommitted changes)" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _free_port() -> int:
    import socket

    with contextlib.closing(socket.socket()) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    main()
