"""Soak (docs/operations.md#memory-under-sustained-load): the app (`--config`'s options, 2 replicas) in a private Ray,
rounds of streamed completions through the proxy, `--concurrency` at once (some 503s), each replica's RSS after every
round once idle for SETTLE_S; one warm-up round, then `--rounds`: the growth after it (target < 2%), bytes per request.

    .venv/bin/python -m loadtest.bench_soak [--quick]   # reports/soak.* (--quick: 60-request rounds → build/bench-soak-quick/)
"""

from __future__ import annotations

import asyncio
import collections
import os
import time
from pathlib import Path
from statistics import linear_regression
from typing import Any

from loadtest import machine, report, server
from loadtest.client import Completions
from loadtest.report import table

APP = "bench-soak"
TARGET_GROWTH = 0.02
SETTLE_S = 6.0  # > IdleHeapTrimmer's interval


def rss(pids: dict[str, int]) -> dict[str, int]:  # each replica's resident set in bytes
    return {name: machine.rss_bytes(machine.tree(pid)[:1]) for name, pid in pids.items()}


def replica_pids() -> dict[str, int]:
    import ray

    refs = {name: actor.__ray_call__.remote(lambda _self: os.getpid()) for name, actor in server.serve_replicas(APP).items()}
    return {name: ray.get(ref, timeout=60) for name, ref in refs.items()}


async def run_round(client: Completions, first: int, count: int, concurrency: int, max_tokens: int) -> collections.Counter:
    limit, outcomes = asyncio.Semaphore(concurrency), collections.Counter()

    async def one(i: int) -> None:
        async with limit:
            s = await client.stream(f"Request {i}: say hi.", max_tokens)
        outcomes[str(s.status) if s.status not in (None, 200) else s.error or ("200" if s.done else "200-incomplete")] += 1

    await asyncio.gather(*(one(i) for i in range(first, first + count)))
    return outcomes


def body(results: dict[str, Any]) -> list[str]:
    summary = results["summary"]
    return [f"{results['replicas']} LLMServer replica(s); rounds of {results['round_size']} streamed completions ({results['max_tokens']} "
            f"output tokens, {results['concurrency']} at once); one warm-up round, then {results['rounds']} rounds; RSS read from /proc "
            "after each round, every replica idle.", ""] + table(
        ["replica", "RSS after warm-up (MiB)", "RSS at end (MiB)", "growth", "fitted bytes / request", f"target < {TARGET_GROWTH:.0%}"],
        [[n, f"{s['rss_after_warmup_mib']:.1f}", f"{s['rss_end_mib']:.1f}", f"{100 * s['growth']:+.2f}%", f"{s['bytes_per_request']:.0f}",
          "yes" if s["growth"] < TARGET_GROWTH else "**no**"] for n, s in summary.items()]) + table(
        ["after request", "outcomes of the round", *(f"{n} RSS (MiB)" for n in summary)],
        [[p["requests"], p.get("outcomes", {}), *(f"{p['rss'][n] / 2**20:.1f}" for n in summary)] for p in results["points"]])


def main() -> None:
    parser = report.Parser(__doc__, "build/bench-soak-quick", round_size=60, concurrency=64)
    parser.options({"config": "Serve config whose serving options are used", "round_size": "streamed requests per round (the warm-up is one round)",
                    "rounds": "rounds after the warm-up", "concurrency": "requests in flight (local.yaml admits 2 x 64 + 128 queued: some 503s)"},
                   config="configs/local.yaml", replicas=2, round_size=300, rounds=10, concurrency=300, max_tokens=4)
    opts = parser.parse_args()
    args, results = server.config_args(opts.config, num_replicas=opts.replicas), report.start("bench_soak")
    results.update({k: getattr(opts, k) for k in ("replicas", "round_size", "rounds", "concurrency", "max_tokens")}, points=[])
    with server.ray_started(APP), server.serve_http() as base_url, server.deployed(args, APP):
        client, loop, pids, sent = Completions(base_url, Path(args["model"]).name), asyncio.new_event_loop(), replica_pids(), 0
        results["points"].append({"requests": 0, "rss": rss(pids)})
        for round_index in range(opts.rounds + 1):
            started = time.monotonic()
            outcomes = loop.run_until_complete(run_round(client, sent, opts.round_size, opts.concurrency, opts.max_tokens))
            sent += opts.round_size
            server.wait_idle(APP)
            time.sleep(SETTLE_S)  # idle replicas give their freed heap back (serve_app.serving.heap_trim)
            assert replica_pids() == pids, "a replica was replaced during the soak"
            results["points"].append({"requests": sent, "rss": rss(pids), "outcomes": dict(outcomes), "round_s": time.monotonic() - started})
            print(f"[soak] {'warm-up' if round_index == 0 else f'round {round_index}/{opts.rounds}'}: {sent} requests, {dict(outcomes)}, RSS MiB "
                  + ", ".join(f"{n}={v / 2**20:.1f}" for n, v in results["points"][-1]["rss"].items()), flush=True)
        loop.run_until_complete(client.aclose())
    after = [p for p in results["points"] if p["requests"] >= opts.round_size]  # from the end of the warm-up on
    results["summary"] = {name: {"rss_after_warmup_mib": after[0]["rss"][name] / 2**20, "rss_end_mib": after[-1]["rss"][name] / 2**20,
                                 "growth": after[-1]["rss"][name] / after[0]["rss"][name] - 1,
                                 "bytes_per_request": linear_regression([p["requests"] for p in after], [p["rss"][name] for p in after]).slope
                                 if len(after) > 1 else 0.0} for name in results["points"][0]["rss"]}
    paths = report.write(results, opts.out_dir, "soak",
                         "Soak: LLMServer replica memory under sustained streamed load", body(results), {"soak": report.lines(
                             f"RSS per LLMServer replica (the warm-up ends at {opts.round_size} requests)", "streamed requests sent", "RSS (MiB)",
                             {n: [(p["requests"], p["rss"][n] / 2**20) for p in results["points"]] for n in results["summary"]})})
    print(paths[1].read_text())


if __name__ == "__main__":
    main()
