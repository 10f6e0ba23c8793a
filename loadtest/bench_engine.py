"""W1 offline throughput (docs/benchmarks.md): 64 requests x 128 random prompt tokens x 128 output tokens,
greedy, ignore_eos, bf16, all at once, on each engine of loadtest/engines.py, each in a worker process (its peak
RSS its own), repeats interleaved, ratios paired; before every run, its compute floor (loadtest/compute_floor.py).

    .venv/bin/python -m loadtest.bench_engine [--quick]     # reports/engine_throughput.* (--quick: build/bench-quick/)
    .venv/bin/python -m loadtest.bench_engine --device cuda --repeats 1 --out-dir $OUT
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path
from typing import Any

from loadtest import engines, machine, report
from loadtest.report import cell, table
from loadtest.stats import interleaved, paired_ratios, spread
from loadtest.worker import Worker, WorkerError

W1 = {"num_requests": 64, "prompt_len": 128, "output_len": 128, "repeats": 3}
QUICK = {"num_requests": 8, "prompt_len": 32, "output_len": 16, "repeats": 2}
MIN_TOKEN_ID = 100  # prompts draw ids from here up: no special tokens (ids < ~20 here)
TARGET_RATIO = {"cpu": 3.0, "cuda": 5.0}  # native ÷ HF static output tok/s, at least
log = report.logger("bench-engine")


def make_prompts(num_requests: int, prompt_len: int, vocab_size: int, min_token_id: int, seed: int) -> list[list[int]]:
    """Token ids drawn uniformly from [min_token_id, vocab_size): no special tokens (ids < ~20 here)."""
    rng = random.Random(seed)
    return [[rng.randrange(min_token_id, vocab_size) for _ in range(prompt_len)] for _ in range(num_requests)]


def summarize(results: dict[str, Any]) -> None:
    """Spreads over repeats, paired ratios to the baseline, each run's share of its floor and the W1 target, into `results`."""
    w, base = results["workload"], results["settings"]["baseline"]
    per_repeat = {name: {r["repeat"]: r["output_tok_s"] for r in e["runs"]} for name, e in results["engines"].items()}
    for name, e in results["engines"].items():
        for key in ("output_tok_s", "total_tok_s", "elapsed_s"):
            e[key] = spread(r[key] for r in e["runs"])
        e["floor_share"] = spread(r["output_tok_s"] / r["floor_output_tok_s"] for r in e["runs"] if r.get("floor_output_tok_s"))
        if name != base and e["runs"]:
            e["ratio_vs_baseline"] = spread(paired_ratios(per_repeat, name, base))
        if short := [r["repeat"] for r in e["runs"] if r["output_tokens"] != w["num_requests"] * w["output_len"]]:
            e["warning"] = f"repeats {short}: fewer output tokens than {w['num_requests'] * w['output_len']}"
    if floors := [f for f in results["compute_floors"] if "error" not in f]:
        results["compute_floor"] = {**{k: floors[0][k] for k in ("prefill_flops", "decode_flops", "prefill_rows", "decode_rows")},
                                    **{k: spread(f[k] for f in floors) for k in ("floor_output_tok_s", "decode_tflop_s", "prefill_tflop_s")}}
    ratio = results["engines"].get("native", {}).get("ratio_vs_baseline")
    if ratio and base == "hf":
        goal = TARGET_RATIO["cpu" if w["device"] == "cpu" else "cuda"]
        results["target"] = {"goal": f"native >= {goal:g}x HF static output tok/s", "measured_median_ratio": ratio["median"],
                             "met": ratio["median"] >= goal}


def body(results: dict[str, Any]) -> list[str]:
    w, s = results["workload"], results["settings"]
    lines = [f"W1: {w['num_requests']} requests × {w['prompt_len']} random prompt tokens (seed {w['seed']}) × {w['output_len']} output "
             f"tokens, greedy, ignore_eos, {w['dtype']} on {w['device']}, all at once; model `{w['model']}`. Each engine in its own "
             f"process, warmed up once, {s['repeats']} interleaved repeats; cells: median (min–max) over repeats; the ratio is paired "
             f"per repeat; total tok/s counts prompt + output tokens; peak RSS: the worker's process tree.", ""]
    if t := results.get("target"):
        lines += [f"Target ({t['goal']}): {t['measured_median_ratio']:.2f}× → {'met' if t['met'] else '**not met**'}.", ""]
    rows, notes = [], []
    for name, e in results["engines"].items():
        if not e["runs"]:
            rows.append([e["label"], "skipped" if "skipped" in e else "FAILED", "", "", "", "", ""])
        else:
            ratio = "1 (baseline)" if name == s["baseline"] else cell(e.get("ratio_vs_baseline"), digits=2) + "×"
            kv = e.get("info", {}).get("kv_cache_bytes")
            rows.append([e["label"], cell(e["output_tok_s"]), cell(e["total_tok_s"]), cell(e["elapsed_s"]),
                         f"{e['peak_rss_mib']:,.0f}", "–" if kv is None else f"{kv / 2**20:,.0f}", ratio])
        notes += [f"- **{name}**: {e[k]}" for k in ("skipped", "warning") if k in e]
        if "error" in e:
            notes.append(f"- **{name}** failed: `{e['error'].splitlines()[0]}` (traceback in the JSON)")
        if extras := [r["extra"] for r in e["runs"] if r["extra"]]:
            notes.append(f"- **{name}** per run: " + "; ".join(f"{k} {[x[k] for x in extras]}" for k in extras[0]))
    if f := results.get("compute_floor"):
        shares = ", ".join(f"{name} {cell(e['floor_share'], 100, 0)}%" for name, e in results["engines"].items() if e.get("floor_share"))
        notes.append(f"- **compute floor** (loadtest/compute_floor.py, right before each of the {f['floor_output_tok_s']['n']} runs): "
                     f"{cell(f['floor_output_tok_s'], digits=0)} output tok/s = {f['prefill_flops'] / 1e9:.0f} GFLOP prefill at "
                     f"{cell(f['prefill_tflop_s'], digits=2)} TFLOP/s ({f['prefill_rows']}-row matmuls) + {f['decode_flops'] / 1e9:.0f} "
                     f"GFLOP decode at {cell(f['decode_tflop_s'], digits=2)} TFLOP/s ({f['decode_rows']}-row matmuls); each run's "
                     f"share of the floor measured just before it: {shares}")
    lines += table(["engine", "output tok/s", "total tok/s", "time per run (s)", "peak RSS (MiB)", "KV cache (MiB)",
                    f"output tok/s vs {s['baseline']}"], rows) + notes
    runs = sorted((r["repeat"], name, r) for name, e in results["engines"].items() for r in e["runs"])
    return lines + ["", "Every run (other processes' CPU: the machine's busy CPU time less this benchmark's, in cores: well above 0, the "
                    "numbers are depressed and noisy):", ""] + table(
        ["repeat", "engine", "time (s)", "output tok/s", "other processes' CPU (cores)"],
        [[rep + 1, name, f"{r['elapsed_s']:.1f}", f"{r['output_tok_s']:.1f}", f"{r['other_cpu_cores']:.2f}"] for rep, name, r in runs])


def plot(results: dict[str, Any]) -> report.Plot:
    ran = {e["label"]: e for e in results["engines"].values() if e["runs"]}
    return report.bars("W1 throughput (median; bars: min–max over repeats)", "tokens/s",
                       {key.replace("_", " "): {label: e[key] for label, e in ran.items()} for key in ("output_tok_s", "total_tok_s")})


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = report.Parser(__doc__, "build/bench-quick", model=True, **QUICK)
    p.options({"engines": "comma-separated, from: " + ", ".join(engines.ENGINES), "baseline": "engine the ratios divide by"},
              engines="native,hf,vllm", baseline="hf", **W1, seed=0, device="cpu", hf_batch_size=16, max_num_seqs=64,
              max_num_batched_tokens=2048, kv_cache_gib=1.0, threads=0)
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32", "float16"))
    p.add_argument("--vllm-enforce-eager", action="store_true", help="vLLM without torch.compile (starts faster)")
    args = p.parse_args(argv)
    unknown = [n for n in args.engines.split(",") if n not in engines.ENGINES]
    if unknown or min(args.repeats, args.num_requests, args.prompt_len, args.output_len, args.hf_batch_size) < 1:
        p.error(f"unknown engines {unknown}, or a count below 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    opts = {**vars(args), "min_token_id": MIN_TOKEN_ID, "vocab_size": json.loads((Path(args.model) / "config.json").read_text())["vocab_size"]}
    prompts = make_prompts(args.num_requests, args.prompt_len, opts["vocab_size"], MIN_TOKEN_ID, args.seed)
    results = report.start("bench_engine", args.device)
    results["workload"] = {k: opts[k] for k in ("num_requests", "prompt_len", "output_len", "seed", "min_token_id", "vocab_size", "dtype",
                                                "device", "model")}
    results["settings"] = {k: opts[k] for k in ("repeats", "hf_batch_size", "max_num_seqs", "max_num_batched_tokens", "kv_cache_gib",
                                                "threads", "baseline")}
    results["engines"] = {n: {"label": engines.label(n, opts), "runs": []} for n in args.engines.split(",")}
    results["compute_floors"], workers = [], {}

    def retire(name: str) -> None:
        worker = workers.pop(name)
        worker.stop()
        results["engines"][name]["peak_rss_mib"] = worker.peak_rss / 2**20

    log("compute floor: matmul rates at this run's decode and prefill shapes, measured before every run")
    floor = Worker("loadtest.compute_floor:Floor", opts)
    try:
        for name, e in results["engines"].items():
            if reason := engines.skip_reason(name):
                e["skipped"] = reason
                continue
            try:
                worker = Worker("loadtest.engines:build", {**opts, "engine": name})
                started = time.perf_counter()
                worker.call("run", prompts[:16], min(args.output_len, 16))
                e.update(load_s=worker.load_s, warmup_s=time.perf_counter() - started, info=worker.call("info"))
                workers[name] = worker
                log(f"{name}: ready (load {e['load_s']:.0f} s, warm-up {e['warmup_s']:.0f} s)")
            except WorkerError as exc:
                e["error"] = str(exc)
                log(f"{name}: FAILED to start: {exc}")
        for rep in range(args.repeats):
            for name in interleaved(list(workers), rep):
                e = results["engines"][name]
                try:
                    measured = floor.call("measure")
                except WorkerError as exc:
                    measured = {"error": str(exc)}
                results["compute_floors"].append({**measured, "repeat": rep, "engine": name})
                busy, ours, wall = machine.busy_cpu_s(), machine.own_cpu_s(), time.perf_counter()
                try:
                    res = workers[name].call("run", prompts, args.output_len)
                except WorkerError as exc:
                    e["error"] = str(exc)
                    log(f"repeat {rep + 1} {name}: FAILED: {exc}")
                    retire(name)
                    continue
                wall, other = time.perf_counter() - wall, machine.busy_cpu_s() - busy - (machine.own_cpu_s() - ours)
                out = sum(len(t) for t in res.token_ids)
                e["runs"].append({"repeat": rep, "elapsed_s": res.elapsed_s, "output_tokens": out, "output_tok_s": out / res.elapsed_s,
                                  "total_tok_s": (out + args.num_requests * args.prompt_len) / res.elapsed_s, "extra": res.extra,
                                  "other_cpu_cores": max(0.0, other / wall), "floor_output_tok_s": measured.get("floor_output_tok_s"),
                                  "peak_gpu_allocated_mib": res.peak_gpu_allocated_mib})
                log(f"repeat {rep + 1}/{args.repeats} {name}: {res.elapsed_s:.1f} s, {out / res.elapsed_s:.1f} output tok/s "
                    f"(floor {measured.get('floor_output_tok_s', float('nan')):.0f}, other processes {other / wall:.2f} cores)")
    finally:
        for name in list(workers):
            retire(name)
        floor.stop()
    summarize(results)
    paths = report.write(results, args.out_dir, "engine_throughput", "W1 engine throughput", body(results),
                         {"engine_throughput": plot(results)})
    log("wrote " + ", ".join(map(str, paths)))
    return 1 if any("error" in e for e in results["engines"].values()) else 0


if __name__ == "__main__":
    raise SystemExit(main())
