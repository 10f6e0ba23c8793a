"""Summary and plots of a Locust run of loadtest/locustfile.py (what `make loadtest` writes).

Inputs: the per-request records (`--records`, JSON lines written by the locustfile; exact timings)
and Locust's CSV (`--csv-prefix`: `<prefix>_stats.csv`, `<prefix>_failures.csv`).
Outputs: a Markdown summary (TTFT / TPOT / e2e p50, p90, p99, request and output-token throughput,
failures, Locust's own rows for comparison) and two PNGs: the TTFT CDF per request class, and
throughput and latency over time.

    .venv/bin/python loadtest/loadtest_report.py --records reports/loadtest/records.jsonl \\
        --csv-prefix reports/loadtest/locust --out-md reports/loadtest.md --png-prefix reports/loadtest
"""

from __future__ import annotations

import argparse
import csv
import glob
import json
import math
from pathlib import Path
from typing import Any

QUANTILES = (0.5, 0.9, 0.99)


# ---- data ------------------------------------------------------------------------------------------
def load_records(path: str) -> list[dict]:
    """Records of `path` and of its per-worker siblings (`path.<pid>`, distributed runs)."""
    records = []
    for name in sorted({*glob.glob(path), *glob.glob(path + ".*")}):
        with open(name) as f:
            records.extend(json.loads(line) for line in f if line.strip())
    return sorted(records, key=lambda r: r["start_time"])


def quantile(values: list[float], q: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    pos = q * (len(ordered) - 1)
    lo, hi = math.floor(pos), math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def dist(values: list[float]) -> dict[str, float | None]:
    out: dict[str, float | None] = {f"p{round(q * 100)}": quantile(values, q) for q in QUANTILES}
    out["mean"] = sum(values) / len(values) if values else None
    out["n"] = len(values)
    return out


def summarize(records: list[dict]) -> dict[str, Any]:
    """Latency distributions (seconds) and throughput over the measured window
    (first request sent → last request finished)."""
    ok = [r for r in records if r["ok"]]
    failed = [r for r in records if not r["ok"]]
    if records:
        window_s = max(r["end_time"] for r in records) - min(r["start_time"] for r in records)
    else:
        window_s = 0.0
    out_tokens = sum(r["output_tokens"] for r in ok)
    summary: dict[str, Any] = {
        "num_requests": len(records),
        "num_ok": len(ok),
        "num_failed": len(failed),
        "num_empty": sum(bool(r.get("empty")) for r in ok),  # ended properly with no text: no TTFT
        "failure_ratio": len(failed) / len(records) if records else 0.0,
        "window_s": window_s,
        "request_throughput": len(ok) / window_s if window_s > 0 else 0.0,
        "output_tokens": out_tokens,
        "output_tok_s": out_tokens / window_s if window_s > 0 else 0.0,
        "ttft_s": dist([r["ttft_s"] for r in ok if r["ttft_s"] is not None]),
        "tpot_s": dist([r["tpot_s"] for r in ok if r["tpot_s"] is not None]),
        "e2e_s": dist([r["e2e_s"] for r in ok]),
        "output_tokens_per_request": dist([float(r["output_tokens"]) for r in ok]),
        "arrival_lag_s": dist([r.get("lag_s") or 0.0 for r in records]),
        "errors": {},
        "by_class": {},
    }
    for r in failed:
        summary["errors"][r["error"]] = summary["errors"].get(r["error"], 0) + 1
    for name in sorted({r["name"] for r in records}):
        rows = [r for r in ok if r["name"] == name]
        summary["by_class"][name] = {
            "num_requests": sum(r["name"] == name for r in records),
            "num_failed": sum(r["name"] == name for r in failed),
            "ttft_s": dist([r["ttft_s"] for r in rows if r["ttft_s"] is not None]),
            "tpot_s": dist([r["tpot_s"] for r in rows if r["tpot_s"] is not None]),
            "e2e_s": dist([r["e2e_s"] for r in rows]),
            "mean_output_tokens": sum(r["output_tokens"] for r in rows) / len(rows) if rows else None,
        }
    return summary


def time_series(records: list[dict], bin_s: float | None = None) -> dict[str, list[float]]:
    """Per time bin (seconds since the first request): completed requests/s, output tokens/s (each
    request's tokens spread evenly from its first token to its end), TTFT p50/p90 and e2e p50 of the
    requests sent in the bin."""
    ok = [r for r in records if r["ok"]]
    if not records:
        return {"t": [], "req_s": [], "tok_s": [], "ttft_p50": [], "ttft_p90": [], "e2e_p50": []}
    t0 = min(r["start_time"] for r in records)
    end = max(r["end_time"] for r in records) - t0
    bin_s = bin_s or max(2.0, end / 30)
    n = max(1, math.ceil(end / bin_s))
    req = [0.0] * n
    tok = [0.0] * n
    started: list[list[dict]] = [[] for _ in range(n)]
    for r in ok:
        s, e = r["start_time"] - t0, r["end_time"] - t0
        req[min(n - 1, int(e / bin_s))] += 1 / bin_s
        started[min(n - 1, int(s / bin_s))].append(r)
        first = s + (r["ttft_s"] or 0.0)
        span = max(e - first, 1e-9)
        for i in range(int(first / bin_s), min(n - 1, int(e / bin_s)) + 1):
            overlap = min(e, (i + 1) * bin_s) - max(first, i * bin_s)
            if overlap > 0:
                tok[i] += r["output_tokens"] * overlap / span / bin_s
    return {
        "t": [(i + 0.5) * bin_s for i in range(n)],
        "req_s": req,
        "tok_s": tok,
        "ttft_p50": [quantile([r["ttft_s"] for r in b if r["ttft_s"] is not None], 0.5) for b in started],
        "ttft_p90": [quantile([r["ttft_s"] for r in b if r["ttft_s"] is not None], 0.9) for b in started],
        "e2e_p50": [quantile([r["e2e_s"] for r in b], 0.5) for b in started],
    }


def read_locust_csv(prefix: str) -> dict[str, list[dict]]:
    out = {}
    for kind in ("stats", "failures"):
        path = Path(f"{prefix}_{kind}.csv")
        out[kind] = list(csv.DictReader(path.open())) if path.is_file() else []
    return out


# ---- Markdown --------------------------------------------------------------------------------------
def _ms(value: float | None) -> str:
    return "–" if value is None else f"{value * 1000:,.0f}"


def _dist_row(label: str, d: dict) -> str:
    return f"| {label} | {_ms(d['p50'])} | {_ms(d['p90'])} | {_ms(d['p99'])} | {_ms(d['mean'])} | {d['n']} |"


def render_markdown(summary: dict, locust: dict[str, list[dict]], meta: dict[str, str], png_names: list[str]) -> str:
    s = summary
    lines = [f"# Load test: {meta.get('title', 'Locust')}", ""]
    if meta.get("command"):
        lines += ["Produced by:", "", "```bash", meta["command"], "```", ""]
    for key in ("date", "target", "settings", "note"):
        if meta.get(key):
            lines.append(f"- {key}: {meta[key]}")
    lines += [
        f"- requests: {s['num_requests']} sent, {s['num_ok']} ok, **{s['num_failed']} failed** ({s['failure_ratio']:.1%})"
        + (f"; {s['num_empty']} of the ok ones were empty replies (the model stopped at once: no TTFT)" if s.get("num_empty") else ""),
        f"- measured window: {s['window_s']:.1f} s (first request sent → last one finished)",
        f"- throughput: **{s['request_throughput']:.2f} req/s**, **{s['output_tok_s']:.1f} output tok/s** "
        f"({s['output_tokens']} output tokens, {s['output_tokens_per_request']['mean'] or 0:.1f} per request)",
    ]
    lag = s["arrival_lag_s"]
    if lag["p99"]:
        lines.append(f"- open loop: arrivals sent late by p50 {_ms(lag['p50'])} ms, p99 {_ms(lag['p99'])} ms "
                     "(all users busy when due: raise -u if this is large)")
    lines += ["", "## Latency (ms, exact, from the per-request records)", "",
              "| metric | p50 | p90 | p99 | mean | n |", "|---|---:|---:|---:|---:|---:|",
              _dist_row("TTFT (send → first token)", s["ttft_s"]),
              _dist_row("TPOT (per output token after the first)", s["tpot_s"]),
              _dist_row("e2e (send → end of stream)", s["e2e_s"]), ""]
    lines += ["## By request class", "", "| request | n | failed | TTFT p50 | TTFT p99 | TPOT p50 | e2e p50 | e2e p99 | output tokens (mean) |",
              "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, c in s["by_class"].items():
        tokens = "–" if c["mean_output_tokens"] is None else f"{c['mean_output_tokens']:.1f}"
        lines.append(f"| `{name}` | {c['num_requests']} | {c['num_failed']} | {_ms(c['ttft_s']['p50'])} | {_ms(c['ttft_s']['p99'])} | "
                     f"{_ms(c['tpot_s']['p50'])} | {_ms(c['e2e_s']['p50'])} | {_ms(c['e2e_s']['p99'])} | {tokens} |")
    lines.append("")
    if s["errors"]:
        lines += ["## Failures", "", "| error | count |", "|---|---:|"]
        lines += [f"| {err} | {n} |" for err, n in sorted(s["errors"].items(), key=lambda kv: -kv[1])]
        lines.append("")
    if locust["stats"]:
        lines += ["## Locust's statistics (its CSV; percentiles rounded by Locust; `output_tokens` in tokens)", "",
                  "| type | name | requests | failures | p50 | p90 | p99 | avg | req/s |", "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
        for row in locust["stats"]:
            lines.append(f"| {row['Type']} | {row['Name']} | {row['Request Count']} | {row['Failure Count']} | {row['50%']} | "
                         f"{row['90%']} | {row['99%']} | {float(row['Average Response Time']):.0f} | {float(row['Requests/s']):.2f} |")
        lines += ["", "(The Aggregated row also counts the `LLM` metric events.)", ""]
    if locust["failures"]:
        lines += ["Locust failures:", "", "| method | name | error | occurrences |", "|---|---|---|---:|"]
        lines += [f"| {r['Method']} | {r['Name']} | {r['Error']} | {r['Occurrences']} |" for r in locust["failures"]]
        lines.append("")
    if png_names:
        lines += ["## Plots", ""] + [f"![{name}]({name})" for name in png_names] + [""]
    return "\n".join(lines)


# ---- plots -----------------------------------------------------------------------------------------
def plot_ttft_cdf(records: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in records if r["ok"] and r["ttft_s"] is not None]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    groups = {"all requests": ok}
    names = sorted({r["name"] for r in ok})
    if len(names) > 1:
        groups.update({name: [r for r in ok if r["name"] == name] for name in names})
    for label, rows in groups.items():
        values = sorted(r["ttft_s"] for r in rows)
        if values:
            ax.step([values[0], *values], [0.0] + [(i + 1) / len(values) for i in range(len(values))], where="post",
                    label=f"{label} (n={len(values)})", linewidth=2.2 if label == "all requests" else 1.2)
    ax.set_xlabel("time to first token (s)")
    ax.set_ylabel("fraction of requests")
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    ax.set_title("TTFT CDF")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_time_series(series: dict[str, list[float]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    t = series["t"]
    top.plot(t, series["tok_s"], color="tab:blue", marker=".", label="output tok/s")
    top.set_ylabel("output tokens/s", color="tab:blue")
    twin = top.twinx()
    twin.plot(t, series["req_s"], color="tab:orange", marker=".", label="completed req/s")
    twin.set_ylabel("completed requests/s", color="tab:orange")
    top.set_title("Throughput over time")
    top.grid(alpha=0.3)
    top.set_ylim(bottom=0)
    twin.set_ylim(bottom=0)

    def clean(values):
        return [math.nan if v is None else v for v in values]

    bottom.plot(t, clean(series["ttft_p50"]), marker=".", label="TTFT p50")
    bottom.plot(t, clean(series["ttft_p90"]), marker=".", label="TTFT p90")
    bottom.plot(t, clean(series["e2e_p50"]), marker=".", label="e2e p50")
    bottom.set_ylabel("seconds (requests sent in the bin)")
    bottom.set_xlabel("time since the first request (s)")
    bottom.set_title("Latency over time")
    bottom.set_ylim(bottom=0)
    bottom.grid(alpha=0.3)
    bottom.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---- entry point -----------------------------------------------------------------------------------
def write_report(records: list[dict], locust: dict[str, list[dict]], out_md: Path, png_prefix: Path | None,
                 meta: dict[str, str]) -> dict:
    summary = summarize(records)
    png_names = []
    if png_prefix is not None and records:
        png_prefix.parent.mkdir(parents=True, exist_ok=True)
        cdf, ts = Path(f"{png_prefix}_ttft_cdf.png"), Path(f"{png_prefix}_timeseries.png")
        plot_ttft_cdf(records, cdf)
        plot_time_series(time_series(records), ts)
        png_names = [_relative(p, out_md.parent) for p in (cdf, ts)]
    out_md.parent.mkdir(parents=True, exist_ok=True)
    out_md.write_text(render_markdown(summary, locust, meta, png_names))
    out_md.with_suffix(".json").write_text(json.dumps({"meta": meta, "summary": summary}, indent=2) + "\n")
    return summary


def _relative(path: Path, start: Path) -> str:
    try:
        return str(path.resolve().relative_to(start.resolve()))
    except ValueError:
        return str(path.resolve())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--records", required=True, help="JSON lines from the locustfile's --records")
    p.add_argument("--csv-prefix", default="", help="Locust's --csv prefix (optional)")
    p.add_argument("--out-md", default="reports/loadtest.md")
    p.add_argument("--png-prefix", default="reports/loadtest", help="writes <prefix>_ttft_cdf.png and <prefix>_timeseries.png")
    p.add_argument("--title", default="Locust")
    p.add_argument("--command", default="")
    p.add_argument("--target", default="")
    p.add_argument("--settings", default="")
    p.add_argument("--date", default="")
    p.add_argument("--note", default="", help="free text for the summary (e.g. the machine's load)")
    args = p.parse_args(argv)
    records = load_records(args.records)
    locust = read_locust_csv(args.csv_prefix) if args.csv_prefix else {"stats": [], "failures": []}
    meta = {k: getattr(args, k) for k in ("title", "command", "target", "settings", "date", "note")}
    summary = write_report(records, locust, Path(args.out_md), Path(args.png_prefix) if args.png_prefix else None, meta)
    print(f"[loadtest] {summary['num_requests']} requests, {summary['num_failed']} failed; "
          f"{summary['request_throughput']:.2f} req/s, {summary['output_tok_s']:.1f} output tok/s; "
          f"TTFT p50 {_ms(summary['ttft_s']['p50'])} ms, p99 {_ms(summary['ttft_s']['p99'])} ms; "
          f"TPOT p50 {_ms(summary['tpot_s']['p50'])} ms → {args.out_md}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
