"""The serving path's ceiling: the null engine (loadtest/null_backend.py) behind the real Serve app.

One *point* = one Serve deployment (ingress replicas, stream batching interval) × one load (concurrent
streams × output tokens per stream). Every stream starts at once; the client (aiohttp, streamed
POST /v1/completions, in the benchmark process) reads raw SSE bytes and timestamps every read, so its
own cost stays small and is counted apart. Measured per point:

- tokens/s carried (output tokens / wall time until the last stream ends) against what the null
  engine would produce alone (`max_num_seqs` / `step_time_s` while every stream runs);
- CPU ms per output token per process group (psutil; valid on a busy machine): HTTP proxy, ingress,
  the LLMServer replica's serving work (the replica process minus the null engine's own thread, read
  from /proc by its OS thread name), the null engine thread, Serve controller, Ray core, client;
- TTFT p50/p99 (client side) and inter-event latency p50/p99 (the gaps between a stream's SSE reads
  after the first), against the engine's step time: what the path adds.
"""

from __future__ import annotations

import asyncio
import itertools
import statistics
import time
from dataclasses import dataclass
from typing import Any

import psutil

from loadtest.null_backend import ENGINE_THREAD_NAME

NULL_BACKEND = "loadtest.null_backend:NullBackend"


@dataclass(frozen=True)
class PathVariant:
    """How the app is deployed for one set of points."""

    ingress_replicas: int
    batch_interval_s: float
    profile: str = "default"  # "direct": Serve's throughput settings + direct ingress (see PROFILES)
    multiplexed: bool = False  # stream_multiplexing

    @property
    def label(self) -> str:
        batching = f"batching {1000 * self.batch_interval_s:.0f} ms" if self.batch_interval_s else "batching off"
        hops = "direct ingress + Serve throughput mode" if self.profile == "direct" else "proxy"
        return f"{self.ingress_replicas} ingress, {batching}, {hops}" + (", multiplexed" if self.multiplexed else "")


def null_app_args(model: str, variant: PathVariant, step_time_s: float, max_num_seqs: int) -> dict[str, Any]:
    """A Serve app (configs' names) with one null-engine LLMServer replica, sized for the sweep."""
    return {
        "model": model, "backend": NULL_BACKEND,
        "engine": {"step_time_s": step_time_s, "max_num_seqs": max_num_seqs},
        "num_replicas": 1, "num_cpus_per_replica": 0, "max_ongoing_requests": 2 * max_num_seqs,
        "max_queued_requests": 4 * max_num_seqs, "ingress_num_replicas": variant.ingress_replicas,
        "ingress_num_cpus": 0, "ingress_max_ongoing_requests": 4 * max_num_seqs,
        "stream_batch_interval_s": variant.batch_interval_s, "stream_multiplexing": variant.multiplexed,
        "request_routing_stats_period_s": 0.5, "api_key_env": "",
    }


def null_engine_cpu_s(procs: list[psutil.Process]) -> float:
    """CPU seconds of the null engine threads in these processes (found by their OS thread name)."""
    total = 0.0
    for proc in procs:
        try:
            for thread in proc.threads():
                with open(f"/proc/{proc.pid}/task/{thread.id}/comm") as f:
                    if f.read().strip() == ENGINE_THREAD_NAME:
                        total += thread.user_time + thread.system_time
        except (psutil.Error, OSError):
            continue
    return total


def cpu_by_group(target) -> dict[str, float]:
    """The target's CPU seconds by group, with the null engine thread split out of the replica."""
    cpu = target.cpu_seconds()
    engine = null_engine_cpu_s(target.processes.get("LLMServer replicas", []))
    cpu["null engine thread"] = engine
    cpu["LLMServer replicas"] = cpu.get("LLMServer replicas", 0.0) - engine
    return cpu


async def timed_stream(target, prompt: list[int], max_tokens: int) -> tuple[float, list[float], int]:
    """(TTFT, gaps between later reads, completion tokens) of one streamed completion."""
    start = time.perf_counter()
    arrivals: list[float] = []
    tail = b""
    async for raw in target.streams.reads(prompt, max_tokens):
        arrivals.append(time.perf_counter())
        tail = (tail + raw)[-4096:]
    text = tail.decode(errors="replace")
    if '"error"' in text:
        raise RuntimeError(f"stream error: {text[-500:]}")
    tokens = int(text.rsplit('"completion_tokens":', 1)[1].split(",", 1)[0])
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:], strict=False)]
    return arrivals[0] - start, gaps, tokens


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))] if ordered else float("nan")


async def measure_point(target, prompts: list[list[int]], output_len: int) -> dict[str, Any]:
    cpu_before = cpu_by_group(target)
    start = time.perf_counter()
    results = await asyncio.gather(*(timed_stream(target, p, output_len) for p in prompts))
    elapsed = time.perf_counter() - start
    cpu_after = cpu_by_group(target)
    tokens = sum(t for _, _, t in results)
    expected = len(prompts) * output_len
    if tokens != expected:
        raise RuntimeError(f"{tokens} output tokens, expected {expected}")
    cpu_ms = {g: 1000 * (cpu_after[g] - cpu_before[g]) / tokens for g in cpu_after}
    serving = sum(v for g, v in cpu_ms.items() if g not in ("client", "null engine thread"))
    ttfts = [t for t, _, _ in results]
    gaps = [g for _, gs, _ in results for g in gs]
    return {"streams": len(prompts), "output_len": output_len, "output_tok_s": tokens / elapsed, "elapsed_s": elapsed,
            "ttft_p50_s": statistics.median(ttfts), "ttft_p99_s": pct(ttfts, 0.99),
            "itl_p50_s": pct(gaps, 0.5), "itl_p99_s": pct(gaps, 0.99), "num_reads": sum(len(g) + 1 for _, g, _ in results),
            "cpu_ms_per_token": cpu_ms, "serving_cpu_ms_per_token": serving}


# Ray Serve's own throughput settings (environment variables read by every Serve process at start):
# `RAY_SERVE_THROUGHPUT_OPTIMIZED=1` runs user code and the handle's router on the replica's main
# event loop, sends handle calls by value over gRPC, buffers request logs and freezes the GC after
# start-up; direct ingress lets the ingress replica answer HTTP itself (no proxy hop), each ingress
# replica on its own port from a range (the benchmark picks a free range).
PROFILES = ("default", "direct")
# not run unless asked: HAProxy on the HTTP port, our LLMServer replicas as the HTTP ingress
# (serve_app/serving/haproxy_ingress.py, a prototype)
EXPERIMENTAL_PROFILES = ("haproxy",)


def profile_env(profile: str) -> dict[str, str]:
    if profile == "default":
        return {}
    if profile == "haproxy":
        from serve_app.serving.haproxy_env import haproxy_env

        return {**haproxy_env(), "RAY_SERVE_INGRESS_REQUEST_ROUTER_FORWARD_BODY": "1"}
    import socket

    with socket.socket() as s:  # a free port; its neighbours are very likely free too
        s.bind(("127.0.0.1", 0))
        http = s.getsockname()[1]
    return {"RAY_SERVE_THROUGHPUT_OPTIMIZED": "1", "RAY_SERVE_ENABLE_DIRECT_INGRESS": "1",
            "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT": str(http), "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT": str(http + 4),
            "RAY_SERVE_DIRECT_INGRESS_MIN_GRPC_PORT": str(http + 5), "RAY_SERVE_DIRECT_INGRESS_MAX_GRPC_PORT": str(http + 9)}


def run_null_sweep(make_target, run, model: str, prompts_for, opts, log, profile: str = "default") -> list[dict[str, Any]]:
    """Every variant × (streams, output length) point; `make_target(args)` deploys an app (ServeTarget),
    `run(coroutine)` runs a measurement on the client's event loop, `prompts_for(n)` makes n prompts.
    Direct ingress measures one ingress replica (the client talks to one replica's port)."""
    out = []
    for ingress, interval, mux in itertools.product([1] if profile == "direct" else opts.null_ingress, opts.null_batch,
                                                    opts.null_mux):
        variant = PathVariant(ingress, interval, profile, mux == "on")
        target = make_target(null_app_args(model, variant, opts.null_step_time, opts.null_max_num_seqs))
        points = []
        try:
            run(measure_point(target, prompts_for(8), 16))  # warm-up
            for streams in opts.null_streams:
                for output_len in opts.null_output_lens:
                    for repeat in range(opts.null_repeats):
                        point = run(measure_point(target, prompts_for(streams), output_len))
                        point["repeat"] = repeat
                        log(f"[bench-serving] null engine, {variant.label}, {streams} streams × {output_len} tokens: "
                            f"{point['output_tok_s']:.0f} tok/s, serving CPU {point['serving_cpu_ms_per_token']:.3f} ms/token, "
                            f"ITL p99 {1000 * point['itl_p99_s']:.0f} ms")
                        points.append(point)
        finally:
            target.close()
        out.append({"ingress_replicas": ingress, "batch_interval_s": interval, "label": variant.label, "profile": profile,
                    "multiplexed": variant.multiplexed, "startup_s": target.startup_s, "points": points})
    return out


def engine_rate(streams: int, step_time_s: float, max_num_seqs: int) -> float:
    """Tokens/s the null engine makes alone with `streams` running (one token per stream per step)."""
    return min(streams, max_num_seqs) / step_time_s


# "stream inlet": the relay actor multiplexed deltas once went through (in reports made before the
# direct channel); a column appears only for the groups a report measured
GROUP_ORDER = ("HTTP proxy", "ingress", "stream inlet", "LLMServer replicas", "Ray core (raylet, GCS, ...)",
               "Serve controller", "null engine thread", "client")


def report_lines(results: dict[str, Any]) -> list[str]:
    """Markdown for the null-engine sweep (median over repeats per point)."""
    null = results["null"]
    w = null["workload"]
    measured = {g for v in null["variants"] for p in v["points"] for g in p["cpu_ms_per_token"]}
    group_order = [g for g in GROUP_ORDER if g in measured]
    lines = [
        "## The path's ceiling: the null engine behind Serve",
        "",
        f"Null engine (loadtest/null_backend.py): one LLMServer replica, a step every {1000 * w['step_time_s']:.0f} ms, "
        f"up to {w['max_num_seqs']} streams per step (a GPU-like rate: {engine_rate(w['max_num_seqs'], w['step_time_s'], w['max_num_seqs']):,.0f} "
        f"tok/s at full batch); {w['prompt_len']}-token prompts; every stream starts at once, ignore_eos. "
        "'engine alone' = what the null engine makes with that many streams; 'serving CPU' = proxy + ingress + "
        "replica shim (replica process minus the null engine thread) + Serve controller + Ray core, per output token. "
        "ITL = gaps between a stream's SSE reads at the client (engine step: "
        f"{1000 * w['step_time_s']:.0f} ms). Cells: median over {w['repeats']} repeat(s).",
        "",
        "| deployment | streams × tokens | tok/s carried | engine alone | serving CPU ms/token | "
        + " | ".join(group_order) + " | TTFT p50 / p99 ms | ITL p50 / p99 ms |",
        "|---|---|---|---|---|" + "---|" * len(group_order) + "---|---|",
    ]
    for variant in null["variants"]:
        keys = sorted({(p["streams"], p["output_len"]) for p in variant["points"]})
        for streams, output_len in keys:
            pts = [p for p in variant["points"] if (p["streams"], p["output_len"]) == (streams, output_len)]

            def med(f, pts=pts):
                return statistics.median(f(p) for p in pts)

            groups = " | ".join(f"{med(lambda p, g=g: p['cpu_ms_per_token'].get(g, 0.0)):.3f}" for g in group_order)
            lines.append(
                f"| {variant['label']} | {streams} × {output_len} | {med(lambda p: p['output_tok_s']):,.0f} | "
                f"{engine_rate(streams, w['step_time_s'], w['max_num_seqs']):,.0f} | "
                f"**{med(lambda p: p['serving_cpu_ms_per_token']):.3f}** | {groups} | "
                f"{1000 * med(lambda p: p['ttft_p50_s']):.0f} / {1000 * med(lambda p: p['ttft_p99_s']):.0f} | "
                f"{1000 * med(lambda p: p['itl_p50_s']):.0f} / {1000 * med(lambda p: p['itl_p99_s']):.0f} |")
    lines += ["", "Against the targets (one LLMServer replica, one ingress replica, stream batching 50 ms: "
              "≥ 10,000 output tok/s carried, ≤ 0.1 ms serving CPU per token):", ""]
    for variant in null["variants"]:
        if variant["ingress_replicas"] != 1 or variant["batch_interval_s"] != 0.05:
            continue
        best = max(variant["points"], key=lambda p: p["output_tok_s"])
        cheapest = min(p["serving_cpu_ms_per_token"] for p in variant["points"])
        lines.append(f"- {variant['label']}: at most {best['output_tok_s']:,.0f} tok/s carried "
                     f"({best['streams']} streams × {best['output_len']} tokens, engine alone "
                     f"{engine_rate(best['streams'], w['step_time_s'], w['max_num_seqs']):,.0f}); serving CPU "
                     f"{cheapest:.3f} ms per token at best.")
    return lines + [""]


def plot(results: dict[str, Any], path) -> None:
    """tok/s carried and serving CPU per token against streams, one line per deployment × output length."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    w = results["null"]["workload"]
    fig, (ax_rate, ax_cpu) = plt.subplots(1, 2, figsize=(12, 6.5))
    lens = sorted({p["output_len"] for v in results["null"]["variants"] for p in v["points"]})
    for color, variant in zip(plt.cm.tab10.colors, results["null"]["variants"], strict=False):
        for output_len in sorted({p["output_len"] for p in variant["points"]}):
            style = {"color": color, "linestyle": ("-", "--", ":", "-.")[lens.index(output_len) % 4]}
            streams = sorted({p["streams"] for p in variant["points"] if p["output_len"] == output_len})
            rate, cpu = [], []
            for s in streams:
                pts = [p for p in variant["points"] if (p["streams"], p["output_len"]) == (s, output_len)]
                rate.append(statistics.median(p["output_tok_s"] for p in pts))
                cpu.append(statistics.median(p["serving_cpu_ms_per_token"] for p in pts))
            label = f"{variant['label']}, {output_len} tok"
            ax_rate.plot(streams, rate, marker="o", label=label, **style)
            ax_cpu.plot(streams, cpu, marker="o", **style)
    all_streams = sorted({p["streams"] for v in results["null"]["variants"] for p in v["points"]})
    ax_rate.plot(all_streams, [engine_rate(s, w["step_time_s"], w["max_num_seqs"]) for s in all_streams], "k--",
                 label="null engine alone")
    ax_rate.set(xlabel="concurrent streams", ylabel="output tokens/s carried", title="What the Serve path carries")
    ax_cpu.axhline(0.1, color="k", linestyle=":", label="target 0.1 ms")
    ax_cpu.set(xlabel="concurrent streams", ylabel="serving CPU ms per output token", title="Serving CPU per token")
    ax_rate.set_ylim(bottom=0)
    ax_cpu.set_ylim(bottom=0)
    ax_cpu.legend(fontsize=8)
    fig.legend(*ax_rate.get_legend_handles_labels(), loc="lower center", ncol=2, fontsize=8)
    fig.suptitle(f"Null engine, step {1000 * w['step_time_s']:.0f} ms; load average at start {results['loadavg_start']}")
    fig.tight_layout(rect=(0, 0.25, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
