"""Summaries and reports for the W1 engine benchmark (loadtest/bench_engine.py).

`summarize(results)` adds per-run throughputs, min/median/max over repeats, paired ratios against
the baseline engine and a token-agreement sanity check, and drops the raw token ids.
`write_reports(results, out_dir)` writes engine_throughput.{json,md,png}.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

TARGET_RATIO = 3.0  # target: native >= 3x HF static output tok/s


def spread(values: list[float]) -> dict[str, float] | None:
    if not values:
        return None
    return {"min": min(values), "median": statistics.median(values), "max": max(values), "n": len(values)}


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def agreement(tokens: list[list[int]], reference: list[list[int]]) -> dict[str, float]:
    """How far two engines' greedy outputs agree (a sanity check: bf16 may legitimately diverge)."""
    prefixes = [_common_prefix(a, b) for a, b in zip(tokens, reference, strict=True)]
    return {
        "first_token_match": sum(p >= 1 for p in prefixes) / len(prefixes),
        "exact_match": sum(a == b for a, b in zip(tokens, reference, strict=True)) / len(prefixes),
        "mean_common_prefix_tokens": statistics.fmean(prefixes),
    }


def summarize(results: dict[str, Any]) -> None:
    w = results["workload"]
    expected = w["num_requests"] * w["output_len"]
    prompt_tokens = w["num_requests"] * w["prompt_len"]
    engines = results["engines"]
    for e in engines.values():
        for run in e["runs"]:
            out = sum(len(t) for t in run["token_ids"])
            run["output_tokens"] = out
            run["prompt_tokens"] = prompt_tokens
            run["output_tok_s"] = out / run["elapsed_s"]
            run["total_tok_s"] = (out + prompt_tokens) / run["elapsed_s"]
            if out != expected:
                e.setdefault("warnings", []).append(f"repeat {run['repeat']}: {out} output tokens, expected {expected}")
        e["output_tok_s"] = spread([r["output_tok_s"] for r in e["runs"]])
        e["total_tok_s"] = spread([r["total_tok_s"] for r in e["runs"]])
        e["elapsed_s"] = spread([r["elapsed_s"] for r in e["runs"]])
        if "kv_cache_bytes" in e.get("info", {}):
            e["kv_cache_mib"] = e["info"]["kv_cache_bytes"] / 2**20
    base_name = results["settings"]["baseline"]
    base = engines.get(base_name)
    if base and base["runs"]:
        base_by_rep = {r["repeat"]: r for r in base["runs"]}
        for name, e in engines.items():
            if name == base_name or not e["runs"]:
                continue
            paired = [r["output_tok_s"] / base_by_rep[r["repeat"]]["output_tok_s"] for r in e["runs"] if r["repeat"] in base_by_rep]
            e["ratio_vs_baseline"] = spread(paired)
            last = max(r["repeat"] for r in e["runs"])
            if last in base_by_rep:
                e["agreement_vs_baseline"] = agreement(
                    next(r["token_ids"] for r in e["runs"] if r["repeat"] == last), base_by_rep[last]["token_ids"]
                )
    for e in engines.values():
        for run in e["runs"]:
            run.pop("token_ids", None)
        e["floor_share"] = spread([r["output_tok_s"] / r["floor_output_tok_s"] for r in e["runs"] if r.get("floor_output_tok_s")])
    measured = [f for f in results.get("compute_floors", []) if "error" not in f]
    if measured:  # the floors measured before each run: their spread, W1's FLOPs (the same in each)
        results["compute_floor"] = {
            **{k: measured[0][k] for k in ("prefill_flops", "decode_flops", "prefill_rows", "decode_rows")},
            **{k: spread([f[k] for f in measured]) for k in ("floor_output_tok_s", "decode_tflop_s", "prefill_tflop_s")},
        }
    elif results.get("compute_floors"):
        results["compute_floor"] = {"error": results["compute_floors"][0]["error"]}
    native = engines.get("native", {})
    ratio = native.get("ratio_vs_baseline")
    if ratio and base_name == "hf":
        results["target"] = {
            "goal": f"native >= {TARGET_RATIO:g}x HF static output tok/s",
            "measured_median_ratio": ratio["median"],
            "met": ratio["median"] >= TARGET_RATIO,
        }


def _fmt(s: dict[str, float] | None, digits: int = 1) -> str:
    if not s:
        return "–"
    if s["n"] == 1:
        return f"{s['median']:.{digits}f}"
    return f"{s['median']:.{digits}f} ({s['min']:.{digits}f}–{s['max']:.{digits}f})"


def markdown(results: dict[str, Any]) -> tuple[str, str]:
    """Returns (the whole report, the headline table alone)."""
    w, m, s = results["workload"], results["machine"], results["settings"]
    base = s["baseline"]
    rows = [
        "| engine | output tok/s | total tok/s | time per run (s) | peak RSS (MiB) | KV cache (MiB) | output tok/s vs "
        + base
        + " |",
        "|---|---|---|---|---|---|---|",
    ]
    notes: list[str] = []
    for name, e in results["engines"].items():
        if "skipped" in e:
            rows.append(f"| {e['label']} | skipped | | | | | |")
            notes.append(f"- **{name}** skipped: {e['skipped']}.")
            continue
        if "error" in e and not e["runs"]:
            rows.append(f"| {e['label']} | FAILED | | | | | |")
        ratio = "1 (baseline)" if name == base else (_fmt(e.get("ratio_vs_baseline"), 2) + "×" if e.get("ratio_vs_baseline") else "–")
        kv = f"{e['kv_cache_mib']:.0f}" if "kv_cache_mib" in e else "–"
        rss = f"{e['peak_rss_mib']:.0f}" if "peak_rss_mib" in e else "–"
        if e["runs"]:
            rows.append(f"| {e['label']} | {_fmt(e['output_tok_s'])} | {_fmt(e['total_tok_s'])} | {_fmt(e['elapsed_s'])} | {rss} | {kv} | {ratio} |")
        if "error" in e:
            first = e["error"].strip().splitlines()[-1]
            notes.append(f"- **{name}** failed: `{first}` (full traceback in the JSON).")
        for warning in e.get("warnings", []):
            notes.append(f"- **{name}**: {warning}.")
        if "agreement_vs_baseline" in e:
            a = e["agreement_vs_baseline"]
            notes.append(
                f"- **{name}** vs {base}, greedy tokens (last repeat): first token equal for {a['first_token_match']:.0%} of "
                f"requests, all {w['output_len']} equal for {a['exact_match']:.0%}, mean common prefix "
                f"{a['mean_common_prefix_tokens']:.1f} tokens ({w['dtype']}: rounding can flip near-ties, then outputs diverge)."
            )
        extras = [r["extra"] for r in e["runs"] if r.get("extra")]
        if extras and "cached_prompt_tokens" in extras[0]:
            notes.append(
                f"- **{name}**: prefix cache reset before each run; cached prompt tokens per run "
                f"{[x['cached_prompt_tokens'] for x in extras]}, preemptions {[x['preemptions'] for x in extras]}, "
                f"engine steps {[x['engine_steps'] for x in extras]}."
            )
        gpu = [r["peak_gpu_allocated_mib"] for r in e["runs"] if "peak_gpu_allocated_mib" in r]
        if gpu:
            notes.append(f"- **{name}**: peak GPU memory allocated {max(gpu):.0f} MiB.")
    floor = results.get("compute_floor")
    if floor and "error" not in floor:
        def cell(v: dict[str, float], fmt: str) -> str:
            return f"{v['median']:{fmt}} ({v['min']:{fmt}}–{v['max']:{fmt}})"

        shares = ", ".join(f"{name} {cell(e['floor_share'], '.0%')}" for name, e in results["engines"].items() if e.get("floor_share"))
        notes.append(
            f"- **compute floor** (loadtest/compute_floor.py, measured right before each of the {floor['floor_output_tok_s']['n']} "
            f"runs): {cell(floor['floor_output_tok_s'], '.0f')} output tok/s = W1's {floor['prefill_flops'] / 1e9:.0f} GFLOP prefill at "
            f"{cell(floor['prefill_tflop_s'], '.2f')} TFLOP/s ({floor['prefill_rows']}-row matmuls) + {floor['decode_flops'] / 1e9:.0f} "
            f"GFLOP decode at {cell(floor['decode_tflop_s'], '.2f')} TFLOP/s ({floor['decode_rows']}-row matmuls). Share of the floor, "
            f"each run against the floor measured just before it: {shares}."
        )
    elif floor:
        notes.append(f"- **compute floor**: not measured ({floor['error']}).")
    table = "\n".join(rows)
    target = results.get("target")
    headline = ""
    if target:
        verdict = "met" if target["met"] else "**not met**"
        headline = f"Target ({target['goal']}): measured median paired ratio {target['measured_median_ratio']:.2f}× → {verdict}.\n\n"
    noise = []
    for name, e in results["engines"].items():
        for r in e["runs"]:
            noise.append((name, r["repeat"], r["other_cpu_cores"]))
    busiest = max((n[2] for n in noise), default=0.0)
    per_run = ["| repeat | engine | time (s) | output tok/s | total tok/s | other processes' CPU (cores) |", "|---|---|---|---|---|---|"]
    runs = sorted(((r["repeat"], name, r) for name, e in results["engines"].items() for r in e["runs"]), key=lambda x: x[0])
    for rep, name, r in runs:
        per_run.append(f"| {rep + 1} | {name} | {r['elapsed_s']:.1f} | {r['output_tok_s']:.1f} | {r['total_tok_s']:.1f} | {r['other_cpu_cores']:.2f} |")
    info_lines = []
    for name, e in results["engines"].items():
        if e.get("info"):
            info_lines.append(f"- {name}: " + ", ".join(f"{k}={v}" for k, v in e["info"].items() if k != "kv_cache_bytes")
                              + (f"; load {e['load_s']:.1f} s, warm-up {e['warmup_s']:.1f} s" if "load_s" in e else ""))
    doc = f"""# W1 engine throughput

{results['date']} · {m['device']} · `{results['command']}`

Workload W1 (docs/benchmarks.md): {w['num_requests']} requests × {w['prompt_len']} random prompt tokens (ids uniform in
[{w['min_token_id']}, {w['vocab_size']}), seed {w['seed']}) × {w['output_len']} output tokens, greedy, ignore_eos,
{w['dtype']}, all requests submitted at once; model `{w['model']}`. Each engine runs in its own process, is
warmed up once, and the {s['repeats']} repeat(s) are interleaved (engine order rotated per repeat).
Cells: median (min–max) over repeats; the ratio is paired per repeat (native run / {base} run of the same repeat).
Total tok/s = (prompt + output tokens) / time. Peak RSS: the worker's process tree, sampled by psutil.

{headline}{table}

{chr(10).join(notes)}

Machine: {m['cpu']}, {m['logical_cores']} logical cores ({m['physical_cores']} physical), {m['memory_gib']} GiB;
Python {m['python']}, torch {m['torch']}, transformers {m['transformers']}{', vllm ' + m['vllm'] if m.get('vllm') else ''};
git {m['git']}; load average at start {m['load_avg_at_start']}, at end {m.get('load_avg_at_end')}; benchmark took {results['duration_s']:.0f} s.
Settings: native max_num_seqs={s['max_num_seqs']}, max_num_batched_tokens={s['max_num_batched_tokens']},
kv_cache_memory_gib={s['kv_cache_gib']}; HF batch size {s['hf_batch_size']}; torch threads {s['threads'] or 'default'}.
{chr(10).join(info_lines)}

## Every run

{chr(10).join(per_run)}

"Other processes' CPU" is the machine's busy CPU time during the run minus this benchmark's own, in cores
(busiest run: {busiest:.2f} of {m['logical_cores']}). Well above 0, the absolute numbers are depressed and noisy;
compare the paired ratios, and regenerate on a quiet machine with the command above.
"""
    return doc, (headline + table)


def _xlabel(label: str, e: dict[str, Any], base: str) -> str:
    text = label.replace(" (", "\n(")
    if e.get("ratio_vs_baseline"):
        text += f"\n{e['ratio_vs_baseline']['median']:.2f}× {base} (output)"
    return text


def plot(results: dict[str, Any], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    engines = [(e["label"], e) for e in results["engines"].values() if e.get("runs")]
    if not engines:
        return False
    w, base = results["workload"], results["settings"]["baseline"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, key, title in ((axes[0], "output_tok_s", "output tokens/s"), (axes[1], "total_tok_s", "(prompt + output) tokens/s")):
        med = [e[key]["median"] for _, e in engines]
        lo = [e[key]["median"] - e[key]["min"] for _, e in engines]
        hi = [e[key]["max"] - e[key]["median"] for _, e in engines]
        bars = ax.bar(range(len(engines)), med, yerr=[lo, hi], capsize=6, color=["#4C72B0", "#DD8452", "#55A868", "#C44E52"][: len(engines)])
        for bar, value, top in zip(bars, med, [e[key]["max"] for _, e in engines], strict=True):
            ax.annotate(f"{value:.0f}", (bar.get_x() + bar.get_width() / 2, top), ha="center", va="bottom", xytext=(0, 3), textcoords="offset points")
        ax.set_xticks(range(len(engines)), [_xlabel(label, e, base) for label, e in engines], fontsize=8)
        ax.margins(y=0.12)
        ax.set_title(title)
        ax.set_ylabel("tokens/s (median; bars: min–max over repeats)")
    fig.suptitle(
        f"W1: {w['num_requests']} req × {w['prompt_len']} prompt × {w['output_len']} output tokens, {w['dtype']}, "
        f"{results['machine']['device']} ({results['machine']['logical_cores']} cores), {results['settings']['repeats']} repeat(s), "
        f"{results['date'][:10]}",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def write_reports(results: dict[str, Any], out_dir: Path) -> dict[str, Any]:
    out_dir.mkdir(parents=True, exist_ok=True)
    paths: dict[str, Any] = {"json": out_dir / "engine_throughput.json", "md": out_dir / "engine_throughput.md"}
    paths["json"].write_text(json.dumps(results, indent=1, default=str) + "\n")
    doc, table = markdown(results)
    paths["md"].write_text(doc)
    png = out_dir / "engine_throughput.png"
    if plot(results, png):
        paths["png"] = png
    paths["table"] = table
    return paths
