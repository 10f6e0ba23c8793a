"""Soak benchmark: does an LLMServer replica's memory plateau under sustained streamed load?

One private Ray instance on 127.0.0.1: the app (`configs/local.yaml`'s serving options, 2 LLMServer
replicas by default, no API key) behind Serve's HTTP proxy on a free loopback port. Rounds of
streamed completions (short prompts, few output tokens: what matters is the request count) are
sent through the real path (proxy → ingress → router → replica → SSE), `--concurrency` at once,
which is beyond what the deployment admits, so some answers are 503 + Retry-After as in production.
After each round (every replica idle) the resident set size of each LLMServer replica process is
read from /proc once every replica has been idle for `SETTLE_S` (long enough for its idle heap
trim). One warm-up round, then `--rounds` rounds of the same size (10× the warm-up's
requests by default); the figure of merit is each replica's RSS growth from the end of the warm-up
to the end of the run (target < 2%), with the per-request slope of a least-squares fit.

    .venv/bin/python loadtest/bench_soak.py            # writes reports/soak.{json,md,png} (≈ 10 min on 2 cores)
    .venv/bin/python loadtest/bench_soak.py --quick    # 60-request rounds into build/bench-soak-quick/
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import json
import os
import platform
import shlex
import socket
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # Ray on the loopback address only

from loadtest.replica_probe import serve_replicas  # noqa: E402

APP = "bench-soak"
TARGET_GROWTH = 0.02
SETTLE_S = 6.0  # > IdleHeapTrimmer's interval: RSS is read once each replica has been idle that long


def free_port() -> int:
    with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def app_args(opts: argparse.Namespace) -> dict[str, Any]:
    import yaml

    args = dict(yaml.safe_load((REPO / opts.config).read_text())["applications"][0]["args"])
    args.update({"model": str(REPO / "models" / "smollm2-135m-instruct"), "num_replicas": opts.replicas, "api_key_env": ""})
    return args


def replica_pids() -> dict[str, int]:
    import ray

    actors = serve_replicas(APP)
    refs = {name: actor.__ray_call__.remote(lambda _self: os.getpid()) for name, actor in actors.items()}
    return {name: ray.get(ref, timeout=60) for name, ref in refs.items()}


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def wait_idle(timeout_s: float = 120.0) -> None:
    """Every replica reports nothing running or waiting and every KV block free (bounded wait)."""
    import ray

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        stats = [ray.get(a.record_routing_stats.remote(), timeout=30) for a in serve_replicas(APP).values()]
        if all(s["num_running"] == s["num_waiting"] == 0 and s["num_free_blocks"] == s["num_total_blocks"] for s in stats):
            return
        time.sleep(0.5)
    raise RuntimeError(f"replicas not idle after {timeout_s} s")


async def run_round(base_url: str, model: str, first: int, count: int, opts: argparse.Namespace) -> collections.Counter:
    import httpx

    outcomes: collections.Counter = collections.Counter()
    limit = asyncio.Semaphore(opts.concurrency)
    async with httpx.AsyncClient(base_url=base_url, timeout=httpx.Timeout(300.0),
                                 limits=httpx.Limits(max_connections=opts.concurrency)) as client:
        async def one(i: int) -> None:
            body = {"model": model, "prompt": f"Request {i}: say hi.", "max_tokens": opts.max_tokens,
                    "ignore_eos": True, "stream": True}
            async with limit:
                try:
                    async with client.stream("POST", "/v1/completions", json=body) as r:
                        done = False
                        async for line in r.aiter_lines():
                            done |= line == "data: [DONE]"
                        outcomes[str(r.status_code) if r.status_code != 200 or done else "200-incomplete"] += 1
                except Exception as exc:  # noqa: BLE001 - counted: a transport error is a finding
                    outcomes[type(exc).__name__] += 1

        await asyncio.gather(*(one(i) for i in range(first, first + count)))
    return outcomes


def fit_slope(xs: list[float], ys: list[float]) -> float:
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    var = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / var if var else 0.0


def summarize(points: list[dict[str, Any]], warmup: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    after = [p for p in points if p["requests"] >= warmup]
    for name in points[0]["rss"]:
        base, end = after[0]["rss"][name], after[-1]["rss"][name]
        out[name] = {"rss_after_warmup_mib": base / 2**20, "rss_end_mib": end / 2**20, "growth": (end - base) / base,
                     "bytes_per_request": fit_slope([p["requests"] for p in after], [p["rss"][name] for p in after])}
    return out


def write_report(results: dict[str, Any], out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "soak.json").write_text(json.dumps(results, indent=2))
    summary = results["summary"]
    lines = [
        "# Soak: LLMServer replica memory under sustained streamed load", "",
        f"Command: `{results['command']}`  ",
        f"Machine: {results['machine']}; load average at start {results['loadavg_start']}, at end {results['loadavg_end']}  ",
        f"{results['replicas']} LLMServer replica(s); rounds of {results['round_size']} streamed completions "
        f"({results['max_tokens']} output tokens, {results['concurrency']} at once); one warm-up round, then "
        f"{results['rounds']} rounds; RSS read from /proc after each round, every replica idle.", "",
        "| replica | RSS after warm-up (MiB) | RSS at end (MiB) | growth | fitted bytes / request | target < 2% |",
        "|---|---|---|---|---|---|",
    ]
    for name, s in summary.items():
        ok = "yes" if s["growth"] < TARGET_GROWTH else "**no**"
        lines.append(f"| {name} | {s['rss_after_warmup_mib']:.1f} | {s['rss_end_mib']:.1f} | {100 * s['growth']:+.2f}% "
                     f"| {s['bytes_per_request']:.0f} | {ok} |")
    lines += ["", "| after request | outcomes of the round | " + " | ".join(f"{n} RSS (MiB)" for n in summary) + " |",
              "|---|---|" + "---|" * len(summary)]
    for p in results["points"]:
        lines.append(f"| {p['requests']} | {p.get('outcomes', {})} | " + " | ".join(f"{p['rss'][n] / 2**20:.1f}" for n in summary) + " |")
    lines += ["", "![RSS per replica against requests served](soak.png)", ""]
    (out_dir / "soak.md").write_text("\n".join(lines))
    plot(results, out_dir / "soak.png")


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for name in results["summary"]:
        xs = [p["requests"] for p in results["points"]]
        ax.plot(xs, [p["rss"][name] / 2**20 for p in results["points"]], marker="o", label=f"LLMServer {name}")
    ax.axvline(results["round_size"], color="grey", linestyle=":", label="end of warm-up")
    ax.set_xlabel("streamed requests sent")
    ax.set_ylabel("replica RSS (MiB)")
    ax.set_title(f"Soak: RSS per LLMServer replica (load average at start {results['loadavg_start']})")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/local.yaml", help="Serve config whose serving options are used")
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--round-size", type=int, default=300, help="streamed requests per round (the warm-up is one round)")
    parser.add_argument("--rounds", type=int, default=10, help="rounds after the warm-up")
    parser.add_argument("--concurrency", type=int, default=300, help="requests in flight (local.yaml admits 2 x 64 + 128 queued: some 503s)")
    parser.add_argument("--max-tokens", type=int, default=4)
    parser.add_argument("--quick", action="store_true", help="60-request rounds, into build/bench-soak-quick/")
    parser.add_argument("--out-dir", default="")
    opts = parser.parse_args()
    if opts.quick:
        opts.round_size, opts.concurrency = 60, 64
    out_dir = Path(opts.out_dir or (REPO / ("build/bench-soak-quick" if opts.quick else "reports")))
    results: dict[str, Any] = {
        "command": shlex.join([".venv/bin/python", "loadtest/bench_soak.py", *sys.argv[1:]]),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores", "loadavg_start": " ".join(f"{x:.2f}" for x in os.getloadavg()),
        "replicas": opts.replicas, "round_size": opts.round_size, "rounds": opts.rounds, "concurrency": opts.concurrency,
        "max_tokens": opts.max_tokens, "points": [],
    }
    import ray
    from ray import serve

    from serve_app.serving.app import build_app

    os.chdir(REPO)
    ray.init(include_dashboard=False, log_to_driver=False, namespace="bench-soak")
    try:
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        args = app_args(opts)
        print(f"[soak] deploying {opts.replicas} replica(s) on 127.0.0.1:{port}", flush=True)
        serve.run(build_app(args), name=APP, route_prefix="/")
        base_url, model = f"http://127.0.0.1:{port}", Path(args["model"]).name
        pids = replica_pids()
        results["points"].append({"requests": 0, "rss": {n: rss_bytes(p) for n, p in pids.items()}})
        sent = 0
        for round_index in range(opts.rounds + 1):
            started = time.monotonic()
            outcomes = asyncio.run(run_round(base_url, model, sent, opts.round_size, opts))
            sent += opts.round_size
            wait_idle()
            time.sleep(SETTLE_S)  # idle replicas give their freed heap back (serve_app.serving.heap_trim)
            assert replica_pids() == pids, "a replica was replaced during the soak"
            point = {"requests": sent, "rss": {n: rss_bytes(p) for n, p in pids.items()}, "outcomes": dict(outcomes),
                     "round_s": time.monotonic() - started}
            results["points"].append(point)
            label = "warm-up" if round_index == 0 else f"round {round_index}/{opts.rounds}"
            print(f"[soak] {label}: {sent} requests, {dict(outcomes)}, {point['round_s']:.0f} s, RSS MiB "
                  + ", ".join(f"{n}={v / 2**20:.1f}" for n, v in point["rss"].items()), flush=True)
        results["summary"] = summarize(results["points"], opts.round_size)
    finally:
        results["loadavg_end"] = " ".join(f"{x:.2f}" for x in os.getloadavg())
        with contextlib.suppress(Exception):
            serve.shutdown()
        ray.shutdown()
    write_report(results, out_dir)
    print((out_dir / "soak.md").read_text())


if __name__ == "__main__":
    main()
