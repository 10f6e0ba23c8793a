"""W4 prefix routing (docs/benchmarks.md): prefix-aware vs `kv_aware`, pow2, round robin and Ray's router
(loadtest/ray_prefix_router.py) on the workloads of loadtest/prefix_workloads.py, replayed closed loop through the
handle of 2 replicas with the text (Ray's router reads it) and the token ids (ours hashes them); seeds pooled.

    make bench-prefix                                     # reports/prefix_routing.* (--quick: build/bench-prefix-quick/)
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import time
from pathlib import Path
from typing import Any

from loadtest import prefix_workloads as pw
from loadtest import report, server
from loadtest.bench_routing import request_router, two_replicas
from loadtest.report import num, table
from loadtest.stats import percentile, ratio
from serve_app.input_processor import InputProcessor
from serve_app.types import GenerateRequest, SamplingParams
from tests.replica_probe import read_probes

ROUTERS = ("prefix_aware", "kv_aware", "pow2", "round_robin", "ray_prefix")
WORKLOADS = ("shared", "chat", "hot", "w3", "evict")
TARGETS = (  # (workload, metric, router, the router it is divided by or None (absolute), bound, "<=" / ">=")
    ("shared", "hit_ratio_vs_ideal", "prefix_aware", None, 0.95, ">="), ("shared", "ttft_p50_s", "prefix_aware", "kv_aware", 0.5, "<="),
    ("shared", "ttft_p50_s", "prefix_aware", "ray_prefix", 1.1, "<="), ("chat", "hit_ratio_vs_ideal", "prefix_aware", None, 0.95, ">="),
    ("chat", "ttft_p50_s", "prefix_aware", "kv_aware", 0.5, "<="), ("chat", "ttft_p50_s", "prefix_aware", "ray_prefix", 1.1, "<="),
    ("evict", "cached_tokens", "prefix_aware", "ray_prefix", 1.2, ">="), ("hot", "requests_per_s", "prefix_aware", "ray_prefix", 1.3, ">="),
    ("hot", "ttft_p99_s", "prefix_aware", "round_robin", 1.1, "<="), ("w3", "ttft_p50_s", "prefix_aware", "kv_aware", 1.1, "<="),
    ("w3", "ttft_p99_s", "prefix_aware", "kv_aware", 1.1, "<="), ("w3", "ttft_p99_s", "prefix_aware", "ray_prefix", 0.7, "<="),
)


async def run_script(handle: Any, tokenizer: Any, script: pw.Script, tag: str, index: int, order: list[int]) -> list[dict[str, Any]]:
    """A script's steps in turn; a chat re-sends its history with each reply."""
    loop, out, history, previous = asyncio.get_running_loop(), [], [], None
    for turn, step in enumerate(script.steps):
        request_id, params = f"{tag}-{index}-{turn}", SamplingParams(max_tokens=step.max_tokens, temperature=0.0, ignore_eos=True)
        if script.system is not None:
            history.append({"role": "user", "content": step.question})
            messages = ({"role": "system", "content": script.system}, *history)
            ids = list(tokenizer.process(GenerateRequest(request_id, messages=messages)).prompt_token_ids)
            request = GenerateRequest(request_id, messages=messages, prompt_token_ids=tuple(ids), sampling_params=params)
        else:
            ids = list(tokenizer.tokenize(step.prompt))
            request = GenerateRequest(request_id, prompt=step.prompt, prompt_token_ids=tuple(ids), sampling_params=params)
        row = {"request_id": request_id, "script": index, "turn": turn, "start_rank": len(order), "group": script.group, "prompt_ids": ids,
               "prompt_tokens": len(ids), "ttft_s": None, "e2e_s": None, "output_ids": [], "cached_tokens": 0, "error": None}
        order.append(index)  # arrival order across the workload (the ideal's "first of its group")
        start, text = loop.time(), []
        try:
            async for chunk in handle.options(stream=True).generate.remote(request):
                row["ttft_s"] = loop.time() - start if chunk.token_ids and row["ttft_s"] is None else row["ttft_s"]
                row["output_ids"] += chunk.token_ids
                text.append(chunk.text)
                row["cached_tokens"] = chunk.num_cached_tokens if chunk.finished else row["cached_tokens"]
            row["e2e_s"] = loop.time() - start
            row["error"] = None if len(row["output_ids"]) == step.max_tokens else f"{len(row['output_ids'])} tokens"
        except Exception as exc:  # noqa: BLE001 - recorded, the run goes on
            row["error"] = type(exc).__name__
        if previous is not None:  # chat: what the engine holds of the previous turn (prompt + reply, last token not computed)
            held = previous["prompt_ids"] + previous["output_ids"][:-1]
            row["ideal_cached"] = min(pw.common_blocks(held, ids), pw.cacheable(ids)) * pw.BLOCK
            row["reproduces_history"] = ids[:len(held)] == held
        out.append(row)
        previous = row
        if script.system is not None:
            history.append({"role": "assistant", "content": "".join(text)})
    return out


async def replay(handle: Any, tokenizer: Any, spec: pw.WorkloadSpec, tag: str) -> tuple[list[dict[str, Any]], float]:
    """`spec.concurrency` scripts in flight until all are done."""
    loop, semaphore, order = asyncio.get_running_loop(), asyncio.Semaphore(spec.concurrency), []

    async def one(index: int, script: pw.Script) -> list[dict[str, Any]]:
        async with semaphore:
            return await run_script(handle, tokenizer, script, tag, index, order)

    start = loop.time()
    rows = [r for rs in await asyncio.gather(*(one(i, s) for i, s in enumerate(spec.scripts))) for r in rs]
    return rows, loop.time() - start


def ideal_hits(name: str, rows: list[dict[str, Any]], cache_tokens: int, concurrency: int) -> int:
    """The ideal cached tokens (loadtest/prefix_workloads.py) of `rows`, one seed's replay of workload `name`."""
    if name == "chat":
        return sum(r.get("ideal_cached", 0) for r in rows)
    by_start = sorted(rows, key=lambda r: r["start_rank"])
    hits = pw.group_ideal_hits([(r["group"], r["prompt_ids"]) for r in by_start])
    if name != "evict":
        return sum(hits.values())
    sizes = {r["group"]: r["prompt_tokens"] for r in reversed(by_start)}  # each group's first request's
    return pw.best_static_partition({g: (h, min(sizes[g], cache_tokens)) for g, h in hits.items()}, cache_tokens, 2,
                                 reserve_tokens=concurrency * 64)[0]


def summarize(spec: pw.WorkloadSpec, rows: list[dict[str, Any]], wall_s: float, cache_tokens: int,
              errors: list[tuple[int, int, int]], per_replica: dict[str, int]) -> dict[str, Any]:
    ok = [r for r in rows if r["error"] is None and r["ttft_s"] is not None]
    ttft, hits = [r["ttft_s"] for r in ok], sum(r["cached_tokens"] for r in ok)
    # per seed (each seed's groups are numbered from 0), then summed
    ideal = sum(ideal_hits(spec.name, [r for r in rows if r["seed"] == seed], cache_tokens, spec.concurrency) for seed in {r["seed"] for r in rows})
    out = {"num_requests": len(rows), "num_errors": len(rows) - len(ok), "ttft_p50_s": percentile(ttft, 0.5), "ttft_p99_s": percentile(ttft, 0.99),
           "e2e_p99_s": percentile([r["e2e_s"] for r in ok], 0.99), "wall_s": wall_s, "requests_per_s": ratio(len(ok), wall_s),
           "output_tok_s": ratio(sum(len(r["output_ids"]) for r in ok), wall_s), "prompt_tokens": sum(r["prompt_tokens"] for r in ok),
           "cached_tokens": hits, "ideal_cached_tokens": ideal, "hit_ratio_vs_ideal": ratio(hits, ideal), "per_replica": per_replica}
    if later := [r["reproduces_history"] for r in rows if "reproduces_history" in r]:
        out["history_reproduced"] = sum(later) / len(later)
    if errors:  # (predicted, actual, prompt tokens) per request the prefix-aware router matched
        mae = sum(abs(p - a) for p, a, _ in errors) / len(errors)
        out["prediction"] = {"n": len(errors), "mean_abs_error_tokens": mae, "exact": sum(p == a for p, a, _ in errors) / len(errors),
                             "mean_abs_error_share": mae / max(sum(n for _, _, n in errors) / len(errors), 1)}
    return out


def run_router(router: str, opts: argparse.Namespace, tokenizer: Any, probe_dir: Path, loop) -> dict[str, Any]:
    args = two_replicas(opts.num_blocks, **({"request_router_class": "loadtest.ray_prefix_router:RayPrefixCacheAffinityRouter"}
                                            if router == "ray_prefix" else {"router": router}))
    args["engine"]["core_process"] = opts.engine_process
    cache_tokens = opts.num_blocks * pw.BLOCK
    with server.deployed(args, f"bench-prefix-{router}") as app:
        out: dict[str, Any] = {"router": router, "deploy_s": app.startup_s, "workloads": {}}
        for workload in WORKLOADS:
            pooled, errors, wall, per_replica = [], [], 0.0, {}
            for seed in opts.seeds:
                spec = pw.make_workloads(cache_tokens, seed, opts.scale, prefix_words=opts.prefix_words)[workload]
                server.wait_idle(app.name)
                tag = f"{router}-{workload}-s{seed}"
                rows, seed_wall = loop.run_until_complete(replay(app.handle, tokenizer, spec, tag))
                time.sleep(1.5)  # the probes' last writes; the replicas' cached-token reports reach the router
                matched = getattr(request_router(app.handle), "matched_predictions", {})  # prefix_aware only
                errors += [matched[r["request_id"]] for r in rows if r["request_id"] in matched]
                for rid, state in read_probes(probe_dir).items():
                    if mine := sum(r.startswith(tag + "-") for r in state["request_ids"]):
                        per_replica[rid] = per_replica.get(rid, 0) + mine
                pooled, wall = pooled + [{**r, "seed": seed} for r in rows], wall + seed_wall
                print(f"[bench-prefix] {router} {workload} seed {seed}: {len(rows)} requests in {seed_wall:.1f} s", flush=True)
            out["workloads"][workload] = summarize(spec, pooled, wall, cache_tokens, errors, per_replica)
    return out


def targets(results: dict[str, Any]) -> list[dict[str, Any]]:
    def value(router: str, workload: str, key: str) -> float | None:
        return results["routers"].get(router, {}).get("workloads", {}).get(workload, {}).get(key)

    rows = []
    for workload, key, a, b, bound, op in TARGETS:
        v = value(a, workload, key) if b is None else ratio(value(a, workload, key), value(b, workload, key))
        rows.append({"workload": workload, "metric": key, "ratio": f"{a} ÷ {b}" if b else a, "value": v, "target": f"{op} {bound}",
                     "met": None if v is None else (v <= bound if op == "<=" else v >= bound)})
    shares = [w["prediction"]["mean_abs_error_share"] for w in results["routers"].get("prefix_aware", {}).get("workloads", {}).values() if "prediction" in w]
    worst = max(shares, default=None)
    return rows + [{"workload": "all", "metric": "mean abs(predicted − actual) ÷ prompt tokens", "ratio": "prefix_aware (worst workload)",
                    "value": worst, "target": "<= 0.05", "met": None if worst is None else worst <= 0.05}]


def body(results: dict[str, Any]) -> list[str]:
    w = results["workload"]
    where = ", each engine in a process of its own" if w.get("core_process") else ""
    lines = [f"Per router: 2 LLMServer replicas{where}, bf16, {w['num_blocks']} KV blocks × 16 tokens each, max_num_seqs 16, 1 torch thread, "
             f"routing stats every 0.2 s. Seeds {w['seeds']} pooled, scale {w['scale']}, prefixes of {w['prefix_words']} words "
             f"(≈ {int(w['prefix_words'] * 1.55)} tokens). `ray_prefix`: Ray's `PrefixCacheAffinityRouter` with its defaults. Workloads "
             "(loadtest/prefix_workloads.py): **shared** groups sharing a system prompt (distinct prefixes ≈ 1.6× one replica's cache); "
             "**chat** 3-6-turn chats, history re-sent; **hot** one prefix carrying 5/6 of the requests; **w3** W3-like prompts sharing "
             "nothing; **evict** distinct prefixes ≈ 1.5× the cluster's cache (ideal: the best static partition).", ""]
    for workload in w["names"]:
        runs = {router: r["workloads"][workload] for router, r in results["routers"].items() if workload in r["workloads"]}
        lines += [f"## {workload}", ""] + table(
            ["router", "requests", "TTFT p50 (s)", "TTFT p99 (s)", "e2e p99 (s)", "req/s", "cached / ideal tokens", "hit ratio vs ideal",
             "requests per replica", "errors"],
            [[router, s["num_requests"], num(s["ttft_p50_s"], 3), num(s["ttft_p99_s"], 3), num(s["e2e_p99_s"]), num(s["requests_per_s"]),
              f"{s['cached_tokens']} / {s['ideal_cached_tokens']}", num(s["hit_ratio_vs_ideal"]), " / ".join(map(str, s["per_replica"].values())),
              s["num_errors"]] for router, s in runs.items()])
        if "history_reproduced" in runs.get("prefix_aware", {}):
            lines += [f"Turns whose re-rendered prompt reproduces the previous prompt + reply exactly: {runs['prefix_aware']['history_reproduced']:.0%}.", ""]
    pred = {k: s["prediction"] for k, s in results["routers"].get("prefix_aware", {}).get("workloads", {}).items() if "prediction" in s}
    lines += ["## Predicted vs actual cached tokens (prefix-aware router)", ""] + table(
        ["workload", "requests matched", "exact", "mean abs error (tokens)", "÷ mean prompt tokens"],
        [[k, p["n"], f"{p['exact']:.0%}", f"{p['mean_abs_error_tokens']:.1f}", f"{p['mean_abs_error_share']:.3f}"] for k, p in pred.items()])
    return lines + ["## Targets (ratios within this run)", ""] + table(
        ["workload", "metric", "ratio", "value", "target", "met"],
        [[t["workload"], t["metric"], t["ratio"], num(t["value"]), t["target"], {None: "n/a", True: "yes", False: "no"}[t["met"]]]
         for t in results["targets"]])


def main() -> None:
    parser = report.Parser(__doc__, "build/bench-prefix-quick", seeds=[0], scale=0.75, num_blocks=256, prefix_words=180)
    parser.options({"num_blocks": "KV blocks per replica (16 tokens each)", "scale": "multiplies request counts",
                    "prefix_words": "words per shared prefix (~1.55 tokens each)"}, num_blocks=512, scale=1.0, prefix_words=360, seeds=[0, 1])
    parser.add_argument("--routers", nargs="+", choices=ROUTERS, default=list(ROUTERS), help="the routers to run (targets need them all)")
    parser.add_argument("--engine-process", action="store_true", help="each replica's engine in a process of its own (core_process)")
    opts = parser.parse_args()
    tokenizer = InputProcessor(str(server.MODEL), 49152, 8192)  # as the ingress does
    results = report.start("bench_prefix")
    results.update(routers={}, workload={"num_blocks": opts.num_blocks, "seeds": opts.seeds, "scale": opts.scale, "names": list(WORKLOADS),
                                         "prefix_words": opts.prefix_words, "core_process": opts.engine_process})
    with server.probed("bench-prefix") as probe_dir, contextlib.closing(asyncio.new_event_loop()) as loop:
        for router in opts.routers:
            results["routers"][router] = run_router(router, opts, tokenizer, probe_dir, loop)
            results["targets"] = targets(results)  # after each router: a run cut short still leaves its results
            paths = report.write(results, opts.out_dir, "prefix_routing", "W4 prefix routing: prefix-aware vs occupancy-only, power of two, "
                                 "round robin, Ray's PrefixCacheAffinityRouter", body(results), {"prefix_routing": report.bars(
                "TTFT p50 by workload and router", "seconds", {w: {r: v["workloads"].get(w, {}).get("ttft_p50_s") for r, v in results["routers"].items()}
                                                               for w in WORKLOADS})})
    print(paths[1].read_text())


if __name__ == "__main__":
    main()
