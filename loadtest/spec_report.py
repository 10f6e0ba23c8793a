"""W5 report: speculative.json (everything), speculative.md (tables), speculative.png (speedup over the
same engine without speculation, vs concurrency, per workload: the headline picture)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def _fmt(value: Any, spec: str = ".2f") -> str:
    return "–" if value is None else format(value, spec)


def markdown(report: dict[str, Any]) -> str:
    m = report["machine"]
    lines = [
        "# W5: speculative decoding (native n-gram fixed k / adaptive k vs vLLM-CPU n-gram)", "",
        f"Command: `{report['command']}`  ",
        f"Machine: {m['cpu']}, {m['logical_cores']} cores, torch {m['torch']}, vLLM {m['vllm']}, git {m['git']}  ",
        f"Load average at start {m['load_avg_at_start']}, at end {m.get('load_avg_at_end')} "
        "(other work on the machine makes every number noisy; compare ratios within this run).  ",
        f"Options: {json.dumps(report['options'])}", "",
        "Speedup = output tok/s over the same engine without speculation at the same concurrency "
        "(mean of repeats; min-max in brackets). Identical = every output token-identical to that baseline. "
        "Acceptance = accepted / proposed tokens; mean k = proposed tokens per decoding request-step (native).", "",
    ]
    for workload in sorted({r["workload"] for r in report["rows"]}):
        lines += [f"## {workload}", "",
                  "| concurrency | setting | output tok/s [min-max] | speedup [min-max] | TPOT p50 / p99 ms | acceptance | mean k | identical |",
                  "|---:|---|---:|---:|---:|---:|---:|:---:|"]
        for r in (r for r in report["rows"] if r["workload"] == workload):
            speedup = "–" if r["speedup"] is None else f"{r['speedup']:.2f}x [{r['speedup_min']:.2f}-{r['speedup_max']:.2f}]"
            ident = "–" if r["identical"] is None else ("yes" if r["identical"] else "NO")
            lines.append(f"| {r['concurrency']} | {r['setting']} | {r['tok_s']:.1f} [{r['tok_s_min']:.1f}-{r['tok_s_max']:.1f}] | "
                         f"{speedup} | {_fmt(r['tpot_p50_ms'], '.1f')} / {_fmt(r['tpot_p99_ms'], '.1f')} | "
                         f"{_fmt(r['acceptance'])} | {_fmt(r['mean_k'])} | {ident} |")
        lines.append("")
    lines += target_lines(report["rows"])
    if report["notes"]:
        lines += ["## Notes", ""] + [f"- {k}: {v}" for k, v in report["notes"].items()] + [""]
    return "\n".join(lines)


def targets(rows: list[dict[str, Any]]) -> list[tuple[str, str, bool | None]]:
    """(target, measured, met) for W5's three targets, from this run's rows (None: not measured)."""
    def row(workload: str, c: int, setting: str) -> dict[str, Any] | None:
        return next((r for r in rows if (r["workload"], r["concurrency"], r["setting"]) == (workload, c, setting)), None)

    out: list[tuple[str, str, bool | None]] = []
    levels = sorted({r["concurrency"] for r in rows})
    if not levels:
        return out
    ours, theirs = row("grounded", levels[0], "native adaptive"), row("grounded", levels[0], "vLLM ngram k=4")
    if ours and theirs and ours["speedup"] and theirs["speedup"]:
        out.append((f"grounded, concurrency {levels[0]}: adaptive's speedup over off >= vLLM n-gram's over its off",
                    f"{ours['speedup']:.2f}x vs {theirs['speedup']:.2f}x", ours["speedup"] >= theirs["speedup"]))
    top = row("grounded", levels[-1], "native adaptive")
    if top and top["speedup"]:
        out.append((f"grounded, concurrency {levels[-1]}: adaptive >= 0.97x off", f"{top['speedup']:.2f}x", top["speedup"] >= 0.97))
    for workload in sorted({r["workload"] for r in rows}):
        for c in levels:
            adaptive = row(workload, c, "native adaptive")
            fixed = [r for k in ("native k=2", "native k=4") if (r := row(workload, c, k))]
            if adaptive and fixed:
                best = max(fixed, key=lambda r: r["tok_s"])
                ratio = adaptive["tok_s"] / best["tok_s"]
                out.append((f"{workload}, concurrency {c}: adaptive within 5% of the best fixed k ({best['setting']})",
                            f"{ratio:.2f}x (adaptive {adaptive['tok_s_min']:.1f}-{adaptive['tok_s_max']:.1f}, best fixed "
                            f"{best['tok_s_min']:.1f}-{best['tok_s_max']:.1f} tok/s over repeats)", ratio >= 0.95))
    return out


def target_lines(rows: list[dict[str, Any]]) -> list[str]:
    found = targets(rows)
    if not found:
        return []
    lines = ["## Targets", "", "| target | measured | met |", "|---|---|:---:|"]
    lines += [f"| {t} | {m} | {'yes' if met else 'no'} |" for t, m, met in found]
    return lines + [""]


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = sorted({r["workload"] for r in report["rows"]})
    fig, axes = plt.subplots(1, len(workloads), figsize=(6 * len(workloads), 4.5), squeeze=False)
    for ax, workload in zip(axes[0], workloads, strict=True):
        rows = [r for r in report["rows"] if r["workload"] == workload and r["speedup"] is not None]
        for setting in dict.fromkeys(r["setting"] for r in rows):
            if setting in ("native off", "vLLM off"):
                continue
            pts = sorted((r["concurrency"], r["speedup"], r["speedup_min"], r["speedup_max"]) for r in rows if r["setting"] == setting)
            xs = [p[0] for p in pts]
            ax.errorbar(xs, [p[1] for p in pts], yerr=[[p[1] - p[2] for p in pts], [p[3] - p[1] for p in pts]],
                        marker="o", capsize=3, label=setting, linestyle="--" if setting.startswith("vLLM") else "-")
        ax.axhline(1.0, color="grey", linewidth=1)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrency (requests in flight)")
        ax.set_ylabel("speedup over the same engine without speculation")
        ax.set_title(f"W5 {workload}")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    fig.suptitle(f"Speculative decoding speedup vs concurrency (load avg at start {report['machine']['load_avg_at_start'][0]})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_report(report: dict[str, Any], out: Path) -> None:
    (out / "speculative.json").write_text(json.dumps(report, indent=1) + "\n")
    (out / "speculative.md").write_text(markdown(report))
    if report["rows"]:
        plot(report, out / "speculative.png")
