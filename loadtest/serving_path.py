"""The serving path's ceiling: the null backend (serve_app/backends/null.py) behind the real Serve app. A point = a
deployment (ingress replicas, stream batching, multiplexing, profile) × a load (streams × output tokens, all
started at once). The client reads raw SSE bytes (`Completions.raw_stream`: its own cost small, counted apart).
Per point: tokens/s carried against what the null engine makes alone; CPU ms per output token per process
group (the replica's serving work = its process less the null engine's thread, found by name in /proc); TTFT
and the gaps between a stream's reads (ITL).
"""

from __future__ import annotations

import itertools
from typing import Any

from loadtest import machine, report
from loadtest.client import burst
from loadtest.report import table
from loadtest.stats import percentile
from serve_app.backends.null import ENGINE_THREAD_NAME
from serve_app.metrics.local_stack import free_port

# Ray Serve's throughput settings, read by every Serve process at start: `RAY_SERVE_THROUGHPUT_OPTIMIZED=1`
# runs user code and the handle's router on the replica's event loop, sends handle calls by value over
# gRPC, buffers request logs and freezes the GC after start-up; direct ingress lets each ingress replica
# answer HTTP itself (no proxy hop) on a port of its own from a range; `haproxy` adds HAProxy on Serve's
# HTTP port in front of those ports (Ray's HAProxy mode; `make serve`'s default).
PROFILES = ("default", "direct", "haproxy")
# a column appears only for the groups a report measured
GROUP_ORDER = ("HTTP proxy", "ingress", "LLMServer replicas", "Ray core (raylet, GCS, ...)", "Serve controller", "null engine thread", "client")
NULL_STEP_TIME_S, NULL_MAX_NUM_SEQS = 0.02, 256  # the null engine's step and its batch cap
HOPS = {"default": "through the proxy", "direct": "direct ingress + Serve throughput mode",
        "haproxy": "HAProxy → direct ingress + Serve throughput mode"}


# where the engines' threads may run: anywhere (the OS decides), each replica's threads pinned to a core of its own,
# or each engine's OpenMP threads bound one to a core (OMP_PROC_BIND=close, OMP_PLACES=cores)
PLACEMENTS = {"float": "", "pin": ", each replica pinned to a core", "bind": ", OpenMP threads bound to cores"}
PLACEMENT_ENV = {"bind": {"OMP_PROC_BIND": "close", "OMP_PLACES": "cores"}}


def label(variant: dict[str, Any]) -> str:
    """A deployment variant ({"profile", "batch_interval_s", "multiplexed"[, "placement", "omp_wait_policy", "worker_niceness",
    "core_process", "decode_threads"]}) in words."""
    batch = f"stream batching {1000 * variant['batch_interval_s']:g} ms" if variant["batch_interval_s"] else "no stream batching"
    omp = f", OpenMP wait policy {variant['omp_wait_policy']}" if variant.get("omp_wait_policy", "passive") != "passive" else ""
    nice = f", Ray's workers at niceness {variant['worker_niceness']}" if variant.get("worker_niceness") else ""
    process = ", engine in a process of its own" if variant.get("core_process") else ""
    decode = f", decode steps on {variant['decode_threads']} thread(s)" if variant.get("decode_threads") else ""
    return (f"{HOPS[variant['profile']]}, {'streams multiplexed' if variant['multiplexed'] else 'one Serve item per delta'}, {batch}"
            + PLACEMENTS[variant.get("placement", "float")] + omp + nice + process + decode)


def profile_env(profile: str) -> dict[str, str]:
    """The environment of a profile's Ray instance (direct ingress: free ports, very likely with free neighbours)."""
    if profile == "default":
        return {}
    http = free_port()
    direct = {"RAY_SERVE_THROUGHPUT_OPTIMIZED": "1", "RAY_SERVE_ENABLE_DIRECT_INGRESS": "1", "RAY_SERVE_LOG_TO_STDERR": "1",
              "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT": str(http), "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT": str(http + 4),
              "RAY_SERVE_DIRECT_INGRESS_MIN_GRPC_PORT": str(http + 5), "RAY_SERVE_DIRECT_INGRESS_MAX_GRPC_PORT": str(http + 9)}
    if profile == "haproxy":
        from serve_app.serving.haproxy_env import haproxy_env

        return {**haproxy_env(), **direct}
    return direct


def null_app_args(model: str, ingress_replicas: int, batch_interval_s: float, multiplexed: bool) -> dict[str, Any]:
    """One null-engine LLMServer replica, sized for the sweep."""
    n = NULL_MAX_NUM_SEQS
    return {"model": model, "backend": "null", "engine": {"step_time_s": NULL_STEP_TIME_S, "max_num_seqs": n}, "num_replicas": 1,
            "num_cpus_per_replica": 0, "max_ongoing_requests": 2 * n, "max_queued_requests": 4 * n, "ingress_num_replicas": ingress_replicas,
            "ingress_num_cpus": 0, "ingress_max_ongoing_requests": 4 * n, "stream_batch_interval_s": batch_interval_s,
            "stream_multiplexing": multiplexed, "request_routing_stats_period_s": 0.5, "api_key_env": ""}


def null_engine_cpu_s(procs: list) -> float:
    """CPU seconds of the null engine threads in these processes (found by their OS thread name)."""
    total = 0.0
    for proc in procs:
        try:
            for thread in proc.threads():
                with open(f"/proc/{proc.pid}/task/{thread.id}/comm") as f:
                    if f.read().strip() == ENGINE_THREAD_NAME:
                        total += thread.user_time + thread.system_time
        except (machine.psutil.Error, OSError):
            continue
    return total


def cpu_by_group(target) -> dict[str, float]:
    """The target's CPU seconds by process group, the null engine thread split out of the replica."""
    cpu = target.cpu_seconds()
    cpu["null engine thread"] = null_engine_cpu_s(target.processes.get("LLMServer replicas", []))
    cpu["LLMServer replicas"] = cpu.get("LLMServer replicas", 0.0) - cpu["null engine thread"]
    return cpu


async def measure_point(target, prompts: list[list[int]], output_len: int) -> dict[str, Any]:
    before = cpu_by_group(target)
    out = await burst(target.client.raw_stream, prompts, output_len)
    cpu_ms = {g: 1000 * (v - before[g]) / out["output_tokens"] for g, v in cpu_by_group(target).items()}
    return {**out, "streams": len(prompts), "output_len": output_len, "cpu_ms_per_token": cpu_ms,
            "serving_cpu_ms_per_token": sum(v for g, v in cpu_ms.items() if g not in ("client", "null engine thread"))}


def run_null_sweep(serve_target, run, model: str, prompts_for, opts, profile: str = "default") -> list[dict[str, Any]]:
    """Every variant × (streams, output length) point of one profile; `serve_target(args)` is a context
    manager deploying the app, `run(coroutine)` runs on the client's event loop, `prompts_for(n)` makes n
    prompts. Direct ingress measures one ingress replica (the client talks to one replica's port)."""
    out = []
    for ingress, interval, mux in itertools.product([1] if profile == "direct" else opts.null_ingress, opts.null_batch, opts.null_mux):
        variant = {"ingress_replicas": ingress, "batch_interval_s": interval, "profile": profile, "multiplexed": mux == "on"}
        name = f"{ingress} ingress, {label(variant)}"
        with serve_target(null_app_args(model, ingress, interval, mux == "on")) as target:
            run(measure_point(target, prompts_for(8), 16))  # warm-up
            points = []
            for streams, output_len, repeat in itertools.product(opts.null_streams, opts.null_output_lens, range(opts.null_repeats)):
                points.append({**run(measure_point(target, prompts_for(streams), output_len)), "repeat": repeat})
                print(f"[bench-serving] null engine, {name}, {streams} streams × {output_len} tokens: {points[-1]['output_tok_s']:.0f} "
                      f"tok/s, serving CPU {points[-1]['serving_cpu_ms_per_token']:.3f} ms/token", flush=True)
        out.append({**variant, "label": name, "startup_s": target.startup_s, "points": points})
    return out


def engine_rate(streams: int, step_time_s: float, max_num_seqs: int) -> float:
    """Tokens/s the null engine makes alone with `streams` running (one token per stream per step)."""
    return min(streams, max_num_seqs) / step_time_s


def _median_points(variant: dict[str, Any]) -> dict[tuple[int, int], dict[str, Any]]:
    """Per (streams, output length): the median over repeats of every measured figure."""
    out = {}
    for key in sorted({(p["streams"], p["output_len"]) for p in variant["points"]}):
        pts = [p for p in variant["points"] if (p["streams"], p["output_len"]) == key]
        out[key] = {k: percentile([p[k] for p in pts], 0.5) for k in ("output_tok_s", "serving_cpu_ms_per_token", "ttft_p50_s", "ttft_p99_s",
                                                                      "itl_p50_s", "itl_p99_s")}
        out[key]["groups"] = {g: percentile([p["cpu_ms_per_token"].get(g, 0.0) for p in pts], 0.5) for g in pts[0]["cpu_ms_per_token"]}
    return out


def report_lines(null: dict[str, Any]) -> list[str]:
    w = null["workload"]
    groups = [g for g in GROUP_ORDER if any(g in p["cpu_ms_per_token"] for v in null["variants"] for p in v["points"])]
    rows, targets = [], []
    for v in null["variants"]:
        for (streams, output_len), m in _median_points(v).items():
            rows.append([v["label"], f"{streams} × {output_len}", f"{m['output_tok_s']:,.0f}", f"{engine_rate(streams, w['step_time_s'], w['max_num_seqs']):,.0f}",
                         f"**{m['serving_cpu_ms_per_token']:.3f}**", *(f"{m['groups'].get(g, 0.0):.3f}" for g in groups),
                         f"{1000 * m['ttft_p50_s']:.0f} / {1000 * m['ttft_p99_s']:.0f}", f"{1000 * m['itl_p50_s']:.0f} / {1000 * m['itl_p99_s']:.0f}"])
        if v["ingress_replicas"] == 1 and v["batch_interval_s"] == 0.05:
            best = max(v["points"], key=lambda p: p["output_tok_s"])
            targets.append(f"- {v['label']}: at most {best['output_tok_s']:,.0f} tok/s carried ({best['streams']} streams × {best['output_len']} "
                           f"tokens); serving CPU {min(p['serving_cpu_ms_per_token'] for p in v['points']):.3f} ms per token at best.")
    return ["## The path's ceiling: the null engine behind Serve", "",
            f"One null-engine LLMServer replica, a step every {1000 * w['step_time_s']:.0f} ms, up to {w['max_num_seqs']} streams per step "
            f"({engine_rate(w['max_num_seqs'], w['step_time_s'], w['max_num_seqs']):,.0f} tok/s at full batch); {w['prompt_len']}-token prompts; "
            "every stream starts at once. Serving CPU = proxy + ingress + replica shim + Serve controller + Ray core, per output token; "
            f"ITL = gaps between a stream's SSE reads, from its second on. Cells: median over {w['repeats']} repeat(s).", "",
            *table(["deployment", "streams × tokens", "tok/s carried", "engine alone", "serving CPU ms/token", *groups, "TTFT p50 / p99 ms",
                    "ITL p50 / p99 ms"], rows),
            "Targets (1 ingress replica, stream batching 50 ms): ≥ 10,000 output tok/s carried, ≤ 0.1 ms serving CPU per token:", "", *targets, ""]


def plot(null: dict[str, Any]) -> report.Plot:
    """Tokens/s carried against streams, a line per deployment × output length, and the null engine alone."""
    w, lens = null["workload"], sorted({p["output_len"] for v in null["variants"] for p in v["points"]})
    series = {f"{v['label']}, {n} tok": [(s, m["output_tok_s"]) for (s, n2), m in _median_points(v).items() if n2 == n] for v in null["variants"] for n in lens}
    streams = sorted({p["streams"] for v in null["variants"] for p in v["points"]})
    return report.lines("What the Serve path carries (null engine)", "concurrent streams", "output tokens/s carried",
                        {**series, "null engine alone": [(s, engine_rate(s, w["step_time_s"], w["max_num_seqs"])) for s in streams]})
