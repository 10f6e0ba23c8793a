"""W4 prefix routing benchmark: the prefix-aware router vs occupancy-only, power of two, round robin and
Ray's `PrefixCacheAffinityRouter`, on the same workloads (loadtest/prefix_workloads.py).

One Ray instance on 127.0.0.1, one run. For each router the app is deployed with 2 LLMServer replicas
(small KV caches, one torch thread each), and every workload is replayed from this process through a
DeploymentHandle (it runs the deployment's router, as the ingress's handle does). Requests carry what
the ingress would send: the text (`prompt`, or chat `messages`, which Ray's router reads) and the token
ids tokenized once here with the engine's `InputProcessor` (which our router hashes). Workloads are
closed loops (a fixed number of scripts in flight, the shape of the hold-out measurements), one replay
per seed, seeds pooled. Measured per workload and router: TTFT p50/p99, e2e p99, throughput, prompt
tokens served from the prefix cache (from each response) vs the ideal, the prefix-aware router's
predicted − actual cached tokens (from its own reports), requests per replica (replica probe).
Routers run one after another on a shared machine: read ratios within the run.

    make bench-prefix                                        # reports/prefix_routing.{json,md,png}
    .venv/bin/python loadtest/bench_prefix.py --quick        # one seed, fewer requests (a few minutes)
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

from loadtest.bench_routing import _free_port, _git_commit, _request_router, probe_snapshot, wait_idle  # noqa: E402
from loadtest.prefix_workloads import (  # noqa: E402
    BLOCK,
    Script,
    WorkloadSpec,
    best_static_partition,
    cacheable,
    common_blocks,
    group_ideal_hits,
    make_workloads,
)
from loadtest.replica_probe import FACTORY, PROBE_DIR_ENV, serve_replicas  # noqa: E402
from loadtest.routing_trace import pct  # noqa: E402

ROUTERS = ("prefix_aware", "kv_aware", "pow2", "round_robin", "ray_prefix")
RAY_ROUTER = "loadtest.ray_prefix_router:RayPrefixCacheAffinityRouter"
WORKLOADS = ("shared", "chat", "hot", "w3", "evict")
APP = "bench-prefix"


def app_args(router: str, opts: argparse.Namespace) -> dict[str, Any]:
    args = {
        "model": str(REPO / "models" / "smollm2-135m-instruct"), "num_replicas": 2, "num_cpus_per_replica": 0.5,
        "torch_num_threads": 1, "max_ongoing_requests": 32, "max_queued_requests": -1,
        "request_routing_stats_period_s": 0.2, "health_check_period_s": 2.0, "api_key_env": "",
        "stat_logger_factories": [FACTORY],
        "engine": {"dtype": "bfloat16", "num_blocks": opts.num_blocks, "max_num_seqs": 16},
    }
    if router == "ray_prefix":
        args["request_router_class"] = RAY_ROUTER
    else:
        args["router"] = router
    if opts.router_kwargs and router in ("prefix_aware", "kv_aware"):
        args["router_kwargs"] = json.loads(opts.router_kwargs)
    return args


# ---- one request, one script, one workload ---------------------------------------------------------------
async def generate(handle: Any, request: Any, start: float) -> dict[str, Any]:
    loop = asyncio.get_running_loop()
    ttft, out_ids, text, cached = None, [], [], 0
    async for chunk in handle.options(stream=True).generate.remote(request):
        if chunk.token_ids and ttft is None:
            ttft = loop.time() - start
        out_ids += chunk.token_ids
        text.append(chunk.text)
        if chunk.finished:
            cached = chunk.num_cached_tokens
    return {"ttft_s": ttft, "e2e_s": loop.time() - start, "output_ids": out_ids, "text": "".join(text), "cached_tokens": cached}


async def run_script(handle: Any, tokenizer: Any, script: Script, tag: str, index: int, order: list[int]) -> list[dict[str, Any]]:
    """Run a script's steps in turn; a chat re-sends its history with each reply."""
    from serve_app.types import GenerateRequest, SamplingParams

    loop = asyncio.get_running_loop()
    out, history, previous = [], [], None
    for turn, step in enumerate(script.steps):
        request_id = f"{tag}-{index}-{turn}"
        params = SamplingParams(max_tokens=step.max_tokens, temperature=0.0, ignore_eos=True)
        if script.system is not None:
            history.append({"role": "user", "content": step.question})
            messages = ({"role": "system", "content": script.system}, *history)
            ids = tokenizer.process(GenerateRequest(request_id, messages=messages)).prompt_token_ids
            request = GenerateRequest(request_id, messages=messages, prompt_token_ids=tuple(ids), sampling_params=params)
        else:
            ids = tokenizer.tokenize(step.prompt)
            request = GenerateRequest(request_id, prompt=step.prompt, prompt_token_ids=tuple(ids), sampling_params=params)
        rank = len(order)  # arrival order across the workload (the ideal's "first of its group")
        order.append(index)
        start = loop.time()
        try:
            result = await generate(handle, request, start)
            error = None if len(result["output_ids"]) == step.max_tokens else f"{len(result['output_ids'])} tokens"
        except Exception as exc:  # noqa: BLE001 - recorded, the run goes on
            result, error = {"ttft_s": None, "e2e_s": None, "output_ids": [], "text": "", "cached_tokens": 0}, type(exc).__name__
        row = {"request_id": request_id, "script": index, "turn": turn, "start_rank": rank, "group": script.group, "prompt_ids": ids,
               "prompt_tokens": len(ids), "error": error, **{k: v for k, v in result.items() if k != "text"}}
        if previous is not None:  # chat: what the engine holds of the previous turn (prompt + reply, last token not computed)
            held = previous["prompt_ids"] + previous["output_ids"][:-1]
            row["ideal_cached"] = min(common_blocks(held, ids), cacheable(ids)) * BLOCK
            row["reproduces_history"] = ids[: len(held)] == held
        out.append(row)
        previous = row
        if script.system is not None:
            history.append({"role": "assistant", "content": result["text"]})
    return out


async def replay(handle: Any, tokenizer: Any, spec: WorkloadSpec, tag: str) -> tuple[list[dict[str, Any]], float]:
    loop = asyncio.get_running_loop()
    semaphore = asyncio.Semaphore(spec.concurrency)
    order: list[int] = []

    async def one(index: int, script: Script) -> list[dict[str, Any]]:
        async with semaphore:
            return await run_script(handle, tokenizer, script, tag, index, order)

    start = loop.time()
    rows = [r for rs in await asyncio.gather(*(one(i, s) for i, s in enumerate(spec.scripts))) for r in rs]
    return rows, loop.time() - start


def ideal_hits(spec: WorkloadSpec, rows: list[dict[str, Any]], cache_tokens: int) -> int:
    if spec.name == "chat":
        return sum(r.get("ideal_cached", 0) for r in rows)
    by_start = sorted(rows, key=lambda r: r["start_rank"])
    hits = group_ideal_hits([(r["group"], r["prompt_ids"]) for r in by_start])
    if spec.name != "evict":
        return sum(hits.values())
    sizes = {}
    for r in by_start:
        sizes.setdefault(r["group"], r["prompt_tokens"])
    groups = {g: (h, min(sizes[g], cache_tokens)) for g, h in hits.items()}
    return best_static_partition(groups, cache_tokens, 2, reserve_tokens=spec.concurrency * 64)[0]


def summarize(spec: WorkloadSpec, rows: list[dict[str, Any]], wall_s: float, cache_tokens: int,
              errors: list[tuple[int, int, int]] | None, per_replica: dict[str, int]) -> dict[str, Any]:
    ok = [r for r in rows if r["error"] is None and r["ttft_s"] is not None]
    ttft = [r["ttft_s"] for r in ok]
    hits = sum(r["cached_tokens"] for r in ok)
    # per seed (each seed's groups are its own, numbered from 0 like the others'), then summed
    ideal = sum(ideal_hits(spec, [r for r in rows if r.get("seed") == seed], cache_tokens)
                for seed in sorted({r.get("seed") for r in rows}, key=str))
    out = {"num_requests": len(rows), "num_errors": len(rows) - len(ok),
           "ttft_p50_s": pct(ttft, 0.5), "ttft_p99_s": pct(ttft, 0.99), "e2e_p99_s": pct([r["e2e_s"] for r in ok], 0.99),
           "wall_s": wall_s, "requests_per_s": len(ok) / wall_s if wall_s else None,
           "output_tok_s": sum(len(r["output_ids"]) for r in ok) / wall_s if wall_s else None,
           "prompt_tokens": sum(r["prompt_tokens"] for r in ok), "cached_tokens": hits, "ideal_cached_tokens": ideal,
           "hit_ratio_vs_ideal": hits / ideal if ideal else None, "per_replica": per_replica}
    if spec.name == "chat":
        later = [r for r in rows if "reproduces_history" in r]
        out["history_reproduced"] = sum(r["reproduces_history"] for r in later) / len(later) if later else None
    if errors:
        out["prediction"] = {"n": len(errors), "mean_abs_error_tokens": sum(abs(p - a) for p, a, _ in errors) / len(errors),
                             "mean_prompt_tokens": sum(n for _, _, n in errors) / len(errors),
                             "exact": sum(p == a for p, a, _ in errors) / len(errors)}
        out["prediction"]["mean_abs_error_share"] = out["prediction"]["mean_abs_error_tokens"] / max(out["prediction"]["mean_prompt_tokens"], 1)
    return out


# ---- one router ------------------------------------------------------------------------------------------
def run_router(router: str, opts: argparse.Namespace, tokenizer: Any, probe_dir: Path, loop: asyncio.AbstractEventLoop) -> dict[str, Any]:
    from ray import serve

    from serve_app.serving.app import build_app

    started = time.monotonic()
    app = f"{APP}-{router}"
    serve.run(build_app(app_args(router, opts)), name=app, route_prefix="/")
    handle = serve.get_deployment_handle("LLMServer", app_name=app)
    replica_ids = set(serve_replicas(app))
    out: dict[str, Any] = {"router": router, "deploy_s": time.monotonic() - started, "workloads": {}}
    print(f"[bench-prefix] {router}: deployed in {out['deploy_s']:.1f} s", flush=True)
    cache_tokens = opts.num_blocks * BLOCK
    try:
        for workload in opts.workloads:
            pooled: list[dict[str, Any]] = []
            errors: list[tuple[int, int, int]] = []
            wall = 0.0
            per_replica: dict[str, int] = {}
            for seed in opts.seeds:
                spec = make_workloads(cache_tokens, seed, opts.scale, prefix_words=opts.prefix_words)[workload]
                wait_idle(app)
                tag = f"{router}-{workload}-s{seed}"
                rows, seed_wall = loop.run_until_complete(replay(handle, tokenizer, spec, tag))
                time.sleep(1.5)  # the probes' last writes; the replicas' cached-token reports reach the router
                matched = getattr(_request_router(handle), "matched_predictions", {})  # prefix_aware only
                errors += [matched[r["request_id"]] for r in rows if r["request_id"] in matched]
                snapshot = probe_snapshot(probe_dir, replica_ids)
                for rid, state in snapshot.items():
                    per_replica[rid] = per_replica.get(rid, 0) + sum(1 for r in state["request_ids"] if r.startswith(tag + "-"))
                pooled += [{**r, "seed": seed} for r in rows]
                wall += seed_wall
                s = summarize(spec, rows, seed_wall, cache_tokens, None, {})
                print(f"[bench-prefix] {router} {workload} seed {seed}: {len(rows)} requests in {seed_wall:.1f} s, TTFT p50 "
                      f"{s['ttft_p50_s'] or 0:.3f} p99 {s['ttft_p99_s'] or 0:.3f} s, hits {s['cached_tokens']}/{s['ideal_cached_tokens']} "
                      f"ideal, errors {s['num_errors']}", flush=True)
            spec = make_workloads(cache_tokens, opts.seeds[0], opts.scale, prefix_words=opts.prefix_words)[workload]
            out["workloads"][workload] = summarize(spec, pooled, wall, cache_tokens, errors, per_replica)
    finally:
        serve.delete(app)
    return out


# ---- report ----------------------------------------------------------------------------------------------
def _f(x: float | None, digits: int = 2) -> str:
    return "–" if x is None else f"{x:.{digits}f}"


def _ratio(results: dict[str, Any], workload: str, key: str, a: str, b: str) -> float | None:
    x = results["routers"].get(a, {}).get("workloads", {}).get(workload, {}).get(key)
    y = results["routers"].get(b, {}).get("workloads", {}).get(workload, {}).get(key)
    return x / y if x is not None and y else None


TARGETS = (  # (workload, metric, numerator router, denominator router or None (absolute), bound, "<=" / ">=")
    ("shared", "hit_ratio_vs_ideal", "prefix_aware", None, 0.95, ">="),
    ("shared", "ttft_p50_s", "prefix_aware", "kv_aware", 0.5, "<="),
    ("shared", "ttft_p50_s", "prefix_aware", "ray_prefix", 1.1, "<="),
    ("chat", "hit_ratio_vs_ideal", "prefix_aware", None, 0.95, ">="),
    ("chat", "ttft_p50_s", "prefix_aware", "kv_aware", 0.5, "<="),
    ("chat", "ttft_p50_s", "prefix_aware", "ray_prefix", 1.1, "<="),
    ("evict", "cached_tokens", "prefix_aware", "ray_prefix", 1.2, ">="),
    ("hot", "requests_per_s", "prefix_aware", "ray_prefix", 1.3, ">="),
    ("hot", "ttft_p99_s", "prefix_aware", "round_robin", 1.1, "<="),
    ("w3", "ttft_p50_s", "prefix_aware", "kv_aware", 1.1, "<="),
    ("w3", "ttft_p99_s", "prefix_aware", "kv_aware", 1.1, "<="),
    ("w3", "ttft_p99_s", "prefix_aware", "ray_prefix", 0.7, "<="),
)


def targets(results: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    for workload, key, a, b, bound, op in TARGETS:
        if b is None:
            value = results["routers"].get(a, {}).get("workloads", {}).get(workload, {}).get(key)
        else:
            value = _ratio(results, workload, key, a, b)
        met = None if value is None else (value <= bound if op == "<=" else value >= bound)
        rows.append({"workload": workload, "metric": key, "ratio": f"{a} ÷ {b}" if b else a, "value": value,
                     "target": f"{op} {bound}", "met": met})
    pred = results["routers"].get("prefix_aware", {}).get("workloads", {})
    shares = [w["prediction"]["mean_abs_error_share"] for w in pred.values() if "prediction" in w]
    value = max(shares) if shares else None
    rows.append({"workload": "all", "metric": "mean abs(predicted − actual) ÷ prompt tokens", "ratio": "prefix_aware (worst workload)",
                 "value": value, "target": "<= 0.05", "met": None if value is None else value <= 0.05})
    return rows


def write_report(results: dict[str, Any], out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    results["targets"] = targets(results)
    (out_dir / "prefix_routing.json").write_text(json.dumps(results, indent=2))
    w = results["workload"]
    lines = ["# W4 prefix routing: prefix-aware vs occupancy-only, power of two, round robin, Ray's PrefixCacheAffinityRouter", "",
             f"Generated {results['date']} (commit {results['git']}) by:", "", f"    {results['command']}", "",
             f"Machine: {results['machine']}; load average at start {results['loadavg_start']}, at end {results['loadavg_end']} "
             "(shared machine; routers ran one after another). Deployment per router: 2 LLMServer replicas, bf16, "
             f"{w['num_blocks']} KV blocks × 16 tokens = {w['num_blocks'] * 16} tokens each, max_num_seqs 16, 1 torch thread, "
             f"routing stats every 0.2 s. Seeds {w['seeds']} pooled; workload scale {w['scale']}. `ray_prefix` = "
             "`ray.serve.llm.request_router.PrefixCacheAffinityRouter` with its defaults, through "
             "`loadtest/ray_prefix_router.py` (hands it chat messages as a list).", "",
             f"Workloads (loadtest/prefix_workloads.py; closed loops; prefixes of {w['prefix_words']} words ≈ "
             f"{int(w['prefix_words'] * 1.55)} tokens): **shared** groups sharing a system prompt, "
             "distinct prefixes ≈ 1.6× one replica's cache, 4 in flight, 4 output tokens; **chat** 3-6-turn chats, history "
             "re-sent, 4 in flight, 8 tokens per reply; **hot** one prefix carrying 5/6 of the requests, 16 in flight, 32 "
             "output tokens; **w3** W3-like skewed prompts sharing nothing, 8 in flight; **evict** like shared with distinct "
             "prefixes ≈ 1.5× the cluster's cache (ideal: the best static partition, computed). Ideal hits: every request "
             "after the first of its group finds the group's prefix blocks cached.", ""]
    for workload in results["workload"]["names"]:
        lines += [f"## {workload}", "", "| router | requests | TTFT p50 (s) | TTFT p99 (s) | e2e p99 (s) | req/s | cached / ideal "
                  "tokens | hit ratio vs ideal | requests per replica | errors |", "|---|---|---|---|---|---|---|---|---|---|"]
        for router, r in results["routers"].items():
            s = r["workloads"].get(workload)
            if s is None:
                continue
            lines.append(f"| {router} | {s['num_requests']} | {_f(s['ttft_p50_s'], 3)} | {_f(s['ttft_p99_s'], 3)} | "
                         f"{_f(s['e2e_p99_s'])} | {_f(s['requests_per_s'])} | {s['cached_tokens']} / {s['ideal_cached_tokens']} | "
                         f"{_f(s['hit_ratio_vs_ideal'])} | {' / '.join(str(n) for n in s['per_replica'].values())} | {s['num_errors']} |")
        chat = results["routers"].get("prefix_aware", {}).get("workloads", {}).get(workload, {})
        if workload == "chat" and chat.get("history_reproduced") is not None:
            lines += ["", f"Turns whose re-rendered prompt reproduces the previous prompt + generated tokens exactly: "
                      f"{chat['history_reproduced']:.0%} (prefix_aware run)."]
        lines.append("")
    lines += ["## Predicted vs actual cached tokens (prefix-aware router)", "",
              "| workload | requests matched | exact | mean abs error (tokens) | ÷ mean prompt tokens |", "|---|---|---|---|---|"]
    for workload, s in results["routers"].get("prefix_aware", {}).get("workloads", {}).items():
        p = s.get("prediction")
        if p:
            lines.append(f"| {workload} | {p['n']} | {p['exact']:.0%} | {p['mean_abs_error_tokens']:.1f} | {p['mean_abs_error_share']:.3f} |")
    lines += ["", "## Targets (ratios within this run)", "", "| workload | metric | ratio | value | target | met |", "|---|---|---|---|---|---|"]
    for t in results["targets"]:
        met = "n/a" if t["met"] is None else ("yes" if t["met"] else "no")
        lines.append(f"| {t['workload']} | {t['metric']} | {t['ratio']} | {_f(t['value'])} | {t['target']} | {met} |")
    lines += ["", "One run, as measured; summaries in `prefix_routing.json`. Plot: `prefix_routing.png`.", ""]
    (out_dir / "prefix_routing.md").write_text("\n".join(lines))
    plot(results, out_dir / "prefix_routing.png")


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    routers = list(results["routers"])
    names = results["workload"]["names"]
    fig, axes = plt.subplots(1, 3, figsize=(17, 4.8))
    width = 0.8 / max(len(routers), 1)
    panels = ((axes[0], "ttft_p50_s", "TTFT p50 (s)"), (axes[1], "hit_ratio_vs_ideal", "prefix hits ÷ ideal"),
              (axes[2], "requests_per_s", "requests/s"))
    for ax, key, title in panels:
        for i, router in enumerate(routers):
            values = [results["routers"][router]["workloads"].get(n, {}).get(key) or 0 for n in names]
            ax.bar([k + i * width for k in range(len(names))], values, width, label=router)
        ax.set_xticks([k + width * (len(routers) - 1) / 2 for k in range(len(names))], names)
        ax.set_title(title)
        ax.legend(fontsize=7)
    fig.suptitle("W4 prefix routing, 2 replicas, same workloads; " + results["date"])
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---- main -------------------------------------------------------------------------------------------------
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--routers", nargs="+", default=list(ROUTERS), choices=ROUTERS)
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=WORKLOADS)
    # 512 blocks (8k tokens): a few requests in flight use a small part of a replica's cache, as in
    # production, so the prefixes (1.5-1.8x one cache) decide what fits, not the running requests
    parser.add_argument("--num-blocks", type=int, default=512, help="KV blocks per replica (16 tokens each)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--scale", type=float, default=1.0, help="multiplies request counts")
    parser.add_argument("--prefix-words", type=int, default=360, help="words per shared prefix (~1.55 tokens each)")
    parser.add_argument("--router-kwargs", default="", help='JSON settings for the KV routers, e.g. \'{"recompute_weight": 2}\'')
    parser.add_argument("--out-dir", default=None)
    parser.add_argument("--quick", action="store_true",
                        help="one seed, 256-block caches, half-length prefixes, 3/4 of the requests (a few minutes)")
    opts = parser.parse_args()
    if opts.quick:
        opts.seeds, opts.scale, opts.num_blocks, opts.prefix_words = opts.seeds[:1], 0.75, 256, 180
    out_dir = Path(opts.out_dir or (REPO / ("build/bench-prefix-quick" if opts.quick else "reports")))
    os.chdir(REPO)
    probe_dir = Path(tempfile.mkdtemp(prefix="prefix-probes-"))
    os.environ[PROBE_DIR_ENV] = str(probe_dir)

    import ray
    from ray import serve

    from serve_app.input_processor import InputProcessor

    tokenizer = InputProcessor(str(REPO / "models" / "smollm2-135m-instruct"), 49152, 8192)  # as the ingress does
    started = time.monotonic()
    results: dict[str, Any] = {
        "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "command": ".venv/bin/python loadtest/bench_prefix.py " + " ".join(shlex.quote(a) for a in sys.argv[1:]),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}",
        "git": _git_commit(), "loadavg_start": " ".join(f"{x:.2f}" for x in os.getloadavg()),
        "workload": {"num_blocks": opts.num_blocks, "seeds": opts.seeds, "scale": opts.scale, "names": opts.workloads,
                     "prefix_words": opts.prefix_words},
        "routers": {},
    }
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, namespace="bench-prefix")
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": _free_port()}, proxy_location="HeadOnly")
        for router in opts.routers:
            results["routers"][router] = run_router(router, opts, tokenizer, probe_dir, loop)
            # after each router, so that a run cut short (a busy machine, OOM) still leaves its results
            results["loadavg_end"] = " ".join(f"{x:.2f}" for x in os.getloadavg())
            write_report(results, out_dir)
    finally:
        with contextlib.suppress(Exception):
            serve.shutdown()
        ray.shutdown()
        shutil.rmtree(probe_dir, ignore_errors=True)
    results["loadavg_end"] = " ".join(f"{x:.2f}" for x in os.getloadavg())
    results["duration_s"] = time.monotonic() - started
    write_report(results, out_dir)
    print(f"[bench-prefix] {results['duration_s']:.0f} s; wrote {out_dir / 'prefix_routing.md'}")
    print((out_dir / "prefix_routing.md").read_text())


if __name__ == "__main__":
    main()
