"""W3 routing (docs/benchmarks.md): KV-aware vs power-of-two vs round-robin, each on 2 LLMServer replicas (small KV
caches) in a private Ray, replaying the same seeded skewed and uniform traces through the handle at `--load` × the
capacity a closed loop measured first; one replay per seed, pooled, each seed's ratio as the spread.

    .venv/bin/python -m loadtest.bench_routing [--quick]   # reports/routing.* (--quick: one seed → build/bench-routing-quick/)
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from loadtest import report, server
from loadtest.batching_model import TraceRequest
from loadtest.report import num, table
from loadtest.stats import percentile, ratio
from serve_app.serving.routing_config import ROUTER_CLASSES
from serve_app.types import GenerateRequest, SamplingParams
from tests.replica_probe import FACTORY, read_probes

ROUTERS = ("pow2", "kv_aware", "round_robin")  # the first deployed calibrates the rate: the baseline
TRACES = ("skewed", "uniform")


@dataclass(frozen=True)
class Mix:
    long_fraction: float = 0.12
    long_prompt: int = 384
    long_output: int = 128
    short_prompt: int = 48
    short_output: int = 16

    @property
    def mean_prompt(self) -> int:
        return round(self.long_fraction * self.long_prompt + (1 - self.long_fraction) * self.short_prompt)

    @property
    def mean_output(self) -> int:
        return round(self.long_fraction * self.long_output + (1 - self.long_fraction) * self.short_output)


def make_trace(name: str, mix: Mix, rate: float, duration_s: float, seed: int, vocab: int = 49152) -> list[TraceRequest]:
    """Trace `name` (TRACES): Poisson arrivals at `rate`/s for `duration_s`, random prompts, `klass` "long", "short" or "uniform"."""
    rng, out = random.Random(seed), []
    t = rng.expovariate(rate)
    while t < duration_s:
        if name == "uniform":
            kind, prompt_len, max_tokens = "uniform", mix.mean_prompt, mix.mean_output
        elif rng.random() < mix.long_fraction:
            kind, prompt_len, max_tokens = "long", mix.long_prompt, mix.long_output
        else:
            kind, prompt_len, max_tokens = "short", mix.short_prompt, mix.short_output
        out.append(TraceRequest(len(out), t, kind, tuple(rng.randrange(100, vocab) for _ in range(prompt_len)), max_tokens))
        t += rng.expovariate(rate)
    return out


@dataclass(frozen=True)
class RequestResult:
    index: int
    kind: str
    arrival_s: float  # scheduled offset
    ttft_s: float | None  # from the scheduled arrival: queueing counts
    e2e_s: float | None
    output_tokens: int
    error: str | None = None


def summarize_run(results: list[RequestResult], wall_s: float, preemptions: int, per_replica: dict[str, dict[str, int]]) -> dict[str, Any]:
    """Latency percentiles (all requests and per kind), output tok/s over the run, preemptions."""
    ok = [r for r in results if r.error is None and r.ttft_s is not None]
    ttft, e2e, tokens = [r.ttft_s for r in ok], [r.e2e_s for r in ok], sum(r.output_tokens for r in ok)
    kinds = {kind: [r.ttft_s for r in ok if r.kind == kind] for kind in sorted({r.kind for r in results})}
    return {"num_requests": len(results), "num_errors": len(results) - len(ok), "errors": sorted({r.error for r in results if r.error})[:5],
            "ttft_p50_s": percentile(ttft, 0.5), "ttft_p99_s": percentile(ttft, 0.99), "e2e_p99_s": percentile(e2e, 0.99),
            "output_tokens": tokens, "wall_s": wall_s, "output_tok_s": tokens / wall_s if wall_s > 0 else None,
            "preemptions": preemptions, "per_replica": per_replica,
            "by_kind": {kind: {"n": len(t), "ttft_p50_s": percentile(t, 0.5), "ttft_p99_s": percentile(t, 0.99)} for kind, t in kinds.items()}}


def compare_runs(routers: dict[str, Any], name: str) -> dict[str, Any]:
    """KV-aware ÷ pow2 on trace `name`: TTFT p50/p99, e2e p99, output tok/s pooled (None if missing), and each seed's TTFT p99."""
    kv, p2 = (routers.get(router, {}).get("runs", {}).get(name, {}) for router in ("kv_aware", "pow2"))
    keys = {"ttft_p99_ratio": "ttft_p99_s", "ttft_p50_ratio": "ttft_p50_s", "e2e_p99_ratio": "e2e_p99_s", "output_tok_s_ratio": "output_tok_s"}
    per_seed = zip(kv.get("per_seed", []), p2.get("per_seed", []), strict=False)
    return {**{n: ratio(kv.get(key), p2.get(key)) for n, key in keys.items()},
            "ttft_p99_ratio_per_seed": [ratio(a["ttft_p99_s"], b["ttft_p99_s"]) for a, b in per_seed]}


def replica_deltas(before: dict, after: dict, tag: str) -> tuple[int, dict[str, dict[str, int]]]:
    """Preemptions during the run, and per replica: this run's requests (by kind) and preemptions."""
    per_replica = {}
    for rid, state in after.items():
        mine = [r for r in state["request_ids"] if r.startswith(tag + "-")]
        per_replica[rid] = {"requests": len(mine), "preemptions": state["num_preemptions"] - before.get(rid, {}).get("num_preemptions", 0),
                            **{kind: sum(r.endswith("-" + kind) for r in mine) for kind in ("long", "short", "uniform")}}
    return sum(c["preemptions"] for c in per_replica.values()), per_replica


def two_replicas(num_blocks: int, **overrides: Any) -> dict[str, Any]:
    """The app W3 and W4 deploy: 2 replicas, small KV caches, one torch thread each, fresh routing stats, the probe."""
    return {"model": str(server.MODEL), "api_key_env": "", "num_replicas": 2, "num_cpus_per_replica": 0.5, "torch_num_threads": 1,
            "max_ongoing_requests": 32, "max_queued_requests": -1, "request_routing_stats_period_s": 0.2, "health_check_period_s": 2.0,
            "stat_logger_factories": [FACTORY], "engine": {"dtype": "bfloat16", "num_blocks": num_blocks, "max_num_seqs": 16}, **overrides}


def request_router(handle: Any) -> Any:
    """The request router inside this process's handle (Ray-private attributes: None if they move)."""
    with contextlib.suppress(AttributeError):
        return handle._router._asyncio_router.request_router
    return None


async def send(handle: Any, request_id: str, prompt: list[int], max_tokens: int, start: float) -> tuple[float | None, float, int]:
    """One streamed generation through the handle; (TTFT, e2e, output tokens) from `start` (loop clock)."""
    loop, ttft, tokens = asyncio.get_running_loop(), None, 0
    request = GenerateRequest(request_id, prompt=prompt, sampling_params=SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    async for chunk in handle.options(stream=True).generate.remote(request):
        ttft = loop.time() - start if chunk.token_ids and ttft is None else ttft
        tokens += len(chunk.token_ids)
    return ttft, loop.time() - start, tokens


async def replay(handle: Any, trace: list[TraceRequest], tag: str, drain_s: float) -> tuple[list[RequestResult], float]:
    loop = asyncio.get_running_loop()
    t0 = loop.time() + 0.5

    async def one(req: TraceRequest) -> RequestResult:
        await asyncio.sleep(max(0.0, t0 + req.arrival_s - loop.time()))
        try:
            ttft, e2e, tokens = await send(handle, f"{tag}-{req.index}-{req.klass}", list(req.prompt_token_ids), req.output_len, t0 + req.arrival_s)
            return RequestResult(req.index, req.klass, req.arrival_s, ttft, e2e, tokens,
                                 None if tokens == req.output_len else f"{tokens} tokens, expected {req.output_len}")
        except Exception as exc:  # noqa: BLE001 - recorded, the run goes on
            return RequestResult(req.index, req.klass, req.arrival_s, None, None, 0, type(exc).__name__)

    tasks = [asyncio.ensure_future(one(r)) for r in trace]
    done, pending = await asyncio.wait(tasks, timeout=trace[-1].arrival_s + drain_s)
    for task in pending:
        task.cancel()
    results = [t.result() if t in done else RequestResult(r.index, r.klass, r.arrival_s, None, None, 0, "timeout") for r, t in zip(trace, tasks, strict=True)]
    finished = [r.arrival_s + r.e2e_s for r in results if r.e2e_s is not None]
    return results, (max(finished) - trace[0].arrival_s) if finished else 0.0


async def calibrate(handle: Any, mix: Mix, seconds: float, concurrency: int, seed: int) -> float:
    """Requests completed per second by `concurrency` clients replaying the skewed trace back to back, from a quarter
    into the window (ramp-up skipped) to its end; requests still running then are cancelled (a drain would understate it)."""
    trace, loop, completed, ids = make_trace("skewed", mix, 1000.0, 10.0, seed + 99), asyncio.get_running_loop(), 0, iter(range(10**9))
    start = loop.time()

    async def client(offset: int) -> None:
        nonlocal completed
        for k in range(offset, 10**9):
            req = trace[k % len(trace)]
            await send(handle, f"calib-{next(ids)}-{req.klass}", list(req.prompt_token_ids), req.output_len, loop.time())
            if loop.time() - start >= seconds / 4:
                completed += 1

    clients = [asyncio.ensure_future(client(i * len(trace) // concurrency)) for i in range(concurrency)]
    await asyncio.sleep(seconds)
    measured = completed
    for c in clients:
        c.cancel()
    await asyncio.gather(*clients, return_exceptions=True)
    if not measured:
        raise RuntimeError(f"calibration: no request completed in {seconds:.0f} s")
    return measured / (seconds * 3 / 4)


def run_router(router: str, opts: argparse.Namespace, mix: Mix, probe_dir: Path, rate: float | None, loop) -> tuple[dict[str, Any], float]:
    """Deploy `router`'s app, warm it up, calibrate if no rate yet, replay every trace once per seed."""
    args = two_replicas(opts.num_blocks, router=router,
                        **({"router_kwargs": dict(opts.kv_router_kwargs)} if router == "kv_aware" and opts.kv_router_kwargs else {}))
    # each router its own app name: Serve caches a driver's handles by (deployment, app) with their router
    with server.deployed(args, f"bench-routing-{router}") as app:
        out: dict[str, Any] = {"router": router, "deploy_s": app.startup_s, "runs": {}}
        replica_ids = set(server.serve_replicas(app.name))
        loop.run_until_complete(replay(app.handle, make_trace("uniform", mix, 10.0, 0.4, 7), f"{router}-warmup", 60.0))
        out["router_class"] = type(request_router(app.handle)).__name__
        if out["router_class"] not in (ROUTER_CLASSES[router].rpartition(":")[2], "NoneType"):
            raise RuntimeError(f"{router}: the handle routes with {out['router_class']}, not {ROUTER_CLASSES[router]}")
        if rate is None:
            capacity = loop.run_until_complete(calibrate(app.handle, mix, opts.calibrate_s, opts.calibrate_concurrency, opts.seeds[0]))
            rate, out["calibration"] = opts.load * capacity, {"capacity_req_s": capacity, "load": opts.load}
            print(f"[bench-routing] calibration: {capacity:.2f} req/s completed → trace rate {rate:.2f} req/s", flush=True)
        for name in TRACES:
            pooled, wall, preemptions, per_replica, per_seed = [], 0.0, 0, {}, []
            for seed in opts.seeds:
                server.wait_idle(app.name)
                tag, before = f"{router}-{name}-s{seed}", read_probes(probe_dir)
                decisions = dict(getattr(request_router(app.handle), "num_decisions", {}))
                results, seed_wall = loop.run_until_complete(replay(app.handle, make_trace(name, mix, rate, opts.duration, seed), tag, opts.drain_s))
                time.sleep(1.0)  # the probes' last writes
                after = {rid: s for rid, s in read_probes(probe_dir).items() if rid in replica_ids}
                n_pre, replicas = replica_deltas(before, after, tag)
                s = summarize_run(results, seed_wall, n_pre, replicas)
                now = getattr(request_router(app.handle), "num_decisions", {})
                per_seed.append({"seed": seed, "router_decisions": {m: n - decisions.get(m, 0) for m, n in now.items()},
                                 **{k: s[k] for k in ("num_requests", "num_errors", "ttft_p50_s", "ttft_p99_s", "e2e_p99_s", "output_tok_s", "preemptions")}})
                pooled, wall, preemptions = pooled + results, wall + seed_wall, preemptions + n_pre
                for rid, counts in replicas.items():
                    per_replica[rid] = {k: per_replica.get(rid, {}).get(k, 0) + v for k, v in counts.items()}
                print(f"[bench-routing] {router} {name} seed {seed}: {json.dumps(per_seed[-1], default=lambda x: round(x, 3))}", flush=True)
            out["runs"][name] = {**summarize_run(pooled, wall, preemptions, per_replica), "per_seed": per_seed, "rate_req_s": rate}
    return out, rate


def body(results: dict[str, Any]) -> list[str]:
    m, w = results["mix"], results["workload"]
    lines = [f"Seeds {w['seeds']}, {w['duration_s']:.0f} s of arrivals at {num(w.get('rate_req_s'))} req/s = {w['load']} × the calibrated capacity "
             f"{num(w.get('capacity_req_s'))} req/s; {w['num_blocks']} KV blocks × 16 tokens per replica; skewed: {m['long_fraction']:.0%} "
             f"{m['long_prompt']} → {m['long_output']} among {m['short_prompt']} → {m['short_output']}; uniform: {m['mean_prompt']} → "
             f"{m['mean_output']}. TTFT from each request's scheduled arrival; percentiles pool every seed.", ""]
    for name in TRACES:
        runs = {router: r["runs"][name] for router, r in results["routers"].items() if name in r["runs"]}
        lines += [f"## {name} trace", ""] + table(
            ["router", "requests", "TTFT p50 (s)", "TTFT p99 (s)", "e2e p99 (s)", "output tok/s", "preemptions", "requests per replica (long)",
             "errors", *(f"TTFT p99 seed {s}" for s in w["seeds"]), "TTFT p50 / p99 short", "TTFT p50 / p99 long"],
            [[router, run["num_requests"], num(run["ttft_p50_s"], 3), num(run["ttft_p99_s"], 3), num(run["e2e_p99_s"]), num(run["output_tok_s"], 0),
              run["preemptions"], " / ".join(f"{c['requests']} ({c['long']})" for c in run["per_replica"].values()), run["num_errors"],
              *(num(s["ttft_p99_s"], 3) for s in run["per_seed"]),
              *(f"{num(run['by_kind'].get(k, {}).get('ttft_p50_s'), 3)} / {num(run['by_kind'].get(k, {}).get('ttft_p99_s'), 3)}" for k in ("short", "long"))]
             for router, run in runs.items()])
    rows = []
    for name, (ttft_max, tok_min) in {"skewed": (0.70, 0.97), "uniform": (1.10, None)}.items():
        c = results["comparison"].get(name, {})
        met = c.get("ttft_p99_ratio") is not None and c["ttft_p99_ratio"] <= ttft_max and (tok_min is None or (c["output_tok_s_ratio"] or 0) >= tok_min)
        rows.append([name, num(c.get("ttft_p99_ratio")), ", ".join(num(r) for r in c.get("ttft_p99_ratio_per_seed", [])), num(c.get("ttft_p50_ratio")),
                     num(c.get("e2e_p99_ratio")), num(c.get("output_tok_s_ratio")),
                     f"TTFT p99 ≤ {ttft_max:.2f}" + (f", tok/s ≥ {tok_min} (no loss, ±3% noise)" if tok_min else ""), "yes" if met else "no"])
    return lines + ["## KV-aware ÷ power-of-two (targets)", ""] + table(
        ["trace", "TTFT p99 (pooled)", "TTFT p99 per seed", "TTFT p50", "e2e p99", "output tok/s", "target", "met"], rows)


def write_report(results: dict[str, Any], out_dir: Path) -> list[Path]:
    plot = report.bars("TTFT p99 by trace and router (pooled over seeds)", "seconds",
                       {t: {router: r["runs"].get(t, {}).get("ttft_p99_s") for router, r in results["routers"].items()} for t in TRACES})
    return report.write(results, out_dir, "routing", "W3 routing: KV-aware vs power-of-two vs round-robin", body(results), {"routing": plot})


def main() -> None:
    parser = report.Parser(__doc__, "build/bench-routing-quick", duration=8.0, calibrate_s=12.0, drain_s=60.0, seeds=[0])
    parser.add_argument("--routers", nargs="+", default=list(ROUTERS), choices=ROUTERS)
    parser.add_argument("--rate", type=float, help="arrivals/s (default: --load × the calibrated capacity)")
    parser.options({"duration": "seconds of arrivals per trace", "load": "× the capacity", "drain_s": "after the last arrival, wait this long at most",
                    "num_blocks": "KV blocks per replica (2 long + 8 short requests fill one)", "seeds": "one trace per seed, replayed in turn, pooled"},
                   duration=32.0, load=0.85, calibrate_s=32.0, calibrate_concurrency=16, num_blocks=96, drain_s=90.0, seeds=[0, 1, 2])
    parser.add_argument("--kv-router-kwargs", nargs="*", default=[], metavar="NAME=VALUE", type=lambda t: (t.partition("=")[0], json.loads(t.partition("=")[2])),
                        help="KVCacheAwareRouter options (routing_config.KVRouterSettings), e.g. prefill_weight=0")
    opts, mix, results = parser.parse_args(), Mix(), report.start("bench_routing")
    results.update(mix={**asdict(mix), "mean_prompt": mix.mean_prompt, "mean_output": mix.mean_output}, routers={},
                   workload={"duration_s": opts.duration, "seeds": opts.seeds, "load": opts.load, "num_blocks": opts.num_blocks})
    with server.probed("bench-routing") as probe_dir, contextlib.closing(asyncio.new_event_loop()) as loop:
        for router in opts.routers:  # the first calibrates the rate (unless --rate gives it) for the others
            results["routers"][router], opts.rate = run_router(router, opts, mix, probe_dir, opts.rate, loop)
            results["workload"]["rate_req_s"] = opts.rate
            if "calibration" in results["routers"][router]:
                results["workload"]["capacity_req_s"] = results["routers"][router]["calibration"]["capacity_req_s"]
    results["comparison"] = {name: compare_runs(results["routers"], name) for name in TRACES}
    print(write_report(results, Path(opts.out_dir))[1].read_text())


if __name__ == "__main__":
    main()
