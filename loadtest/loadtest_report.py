"""The report of a Locust run of loadtest/locustfile.py (`make loadtest`, docs/loadtest.md) from its per-request
records (`--records`: exact timings; Locust's own CSV and HTML stay beside them).

    .venv/bin/python -m loadtest.loadtest_report --records reports/loadtest/records.jsonl
"""

from __future__ import annotations

import collections
import functools
import glob
import json
import math
from pathlib import Path
from typing import Any

from loadtest import report
from loadtest.report import num, table
from loadtest.stats import percentile


def load_records(path: str) -> list[dict]:
    """The records of `path` and of its per-worker siblings (`path.<pid>`, distributed runs), by start."""
    records = [json.loads(line) for name in sorted({*glob.glob(path), *glob.glob(path + ".*")})
               for line in Path(name).read_text().splitlines() if line.strip()]
    return sorted(records, key=lambda r: r["start_time"])


def dist(values: list[float]) -> dict[str, float | None]:
    return {"p50": percentile(values, 0.5), "p90": percentile(values, 0.9), "p99": percentile(values, 0.99),
            "mean": sum(values) / len(values) if values else None, "n": len(values)}


def summarize(records: list[dict]) -> dict[str, Any]:
    """Latency distributions (seconds) and throughput over the window first request sent → last finished."""
    ok = [r for r in records if r["ok"]]
    window = max(r["end_time"] for r in records) - min(r["start_time"] for r in records) if records else 0.0
    tokens, errors = sum(r["output_tokens"] for r in ok), collections.Counter(r["error"] for r in records if not r["ok"])

    def latencies(rows: list[dict]) -> dict[str, Any]:
        return {k: dist([r[k] for r in rows if r[k] is not None]) for k in ("ttft_s", "tpot_s", "e2e_s")}

    by_class = {name: {"num_requests": sum(r["name"] == name for r in records), "num_failed": sum(r["name"] == name and not r["ok"] for r in records),
                       **latencies([r for r in ok if r["name"] == name])} for name in sorted({r["name"] for r in records})}
    return {"num_requests": len(records), "num_ok": len(ok), "num_failed": len(records) - len(ok), "num_empty": sum(bool(r.get("empty")) for r in ok),
            "window_s": window, "request_throughput": len(ok) / window if window > 0 else 0.0, "output_tokens": tokens,
            "output_tok_s": tokens / window if window > 0 else 0.0, **latencies(ok),
            "output_tokens_per_request": dist([float(r["output_tokens"]) for r in ok]), "arrival_lag_s": dist([r.get("lag_s") or 0.0 for r in records]),
            "errors": dict(errors), "by_class": by_class}


def time_series(records: list[dict], bin_s: float | None = None) -> dict[str, list]:
    """Per time bin since the first request: completed requests/s and output tokens/s (a request's tokens in the
    bin it ended in), TTFT p50/p90 of the requests sent in the bin."""
    t0, end, ok = min(r["start_time"] for r in records), max(r["end_time"] for r in records), [r for r in records if r["ok"]]
    bin_s = bin_s or max(2.0, (end - t0) / 30)
    n = max(1, math.ceil((end - t0) / bin_s))

    def bins(key: str) -> list[list[dict]]:
        out: list[list[dict]] = [[] for _ in range(n)]
        for r in ok:
            out[min(n - 1, int((r[key] - t0) / bin_s))].append(r)
        return out

    ended, ttfts = bins("end_time"), [[r["ttft_s"] for r in b if r["ttft_s"] is not None] for b in bins("start_time")]
    return {"t": [(i + 0.5) * bin_s for i in range(n)], "req_s": [len(b) / bin_s for b in ended],
            "tok_s": [sum(r["output_tokens"] for r in b) / bin_s for b in ended], "ttft_p50": [percentile(t, 0.5) for t in ttfts],
            "ttft_p90": [percentile(t, 0.9) for t in ttfts]}


def body(s: dict[str, Any], settings: str) -> list[str]:
    ms = functools.partial(num, digits=0, scale=1000)

    def row(label: str, d: dict) -> list[str]:
        return [label, ms(d["p50"]), ms(d["p90"]), ms(d["p99"]), ms(d["mean"]), d["n"]]

    lines = [f"- settings: {settings}", f"- requests: {s['num_requests']} sent, {s['num_ok']} ok, **{s['num_failed']} failed**"
             + (f"; {s['num_empty']} of the ok ones were empty replies (the model stopped at once: no TTFT)" if s["num_empty"] else ""),
             f"- throughput over {s['window_s']:.1f} s (first request sent → last finished): **{s['request_throughput']:.2f} req/s**, "
             f"**{s['output_tok_s']:.1f} output tok/s** ({s['output_tokens']} output tokens)"]
    if s["arrival_lag_s"]["p99"]:
        lines.append(f"- open loop: arrivals sent late by p50 {ms(s['arrival_lag_s']['p50'])} ms, p99 {ms(s['arrival_lag_s']['p99'])} ms (raise -u if large)")
    lines += ["", "## Latency (ms, from the per-request records)", ""] + table(
        ["metric", "p50", "p90", "p99", "mean", "n"], [row("TTFT (send → first token)", s["ttft_s"]),
                                                      row("TPOT (per output token after the first)", s["tpot_s"]), row("e2e (send → end of stream)", s["e2e_s"])])
    lines += ["## By request class", ""] + table(
        ["request", "n", "failed", "TTFT p50", "TTFT p99", "TPOT p50", "e2e p50", "e2e p99"],
        [[f"`{n}`", c["num_requests"], c["num_failed"], ms(c["ttft_s"]["p50"]), ms(c["ttft_s"]["p99"]), ms(c["tpot_s"]["p50"]), ms(c["e2e_s"]["p50"]),
          ms(c["e2e_s"]["p99"])] for n, c in s["by_class"].items()])
    return lines + ((["## Failures", ""] + table(["error", "count"], sorted(s["errors"].items(), key=lambda kv: -kv[1]))) if s["errors"] else [])


def plots(records: list[dict]) -> dict[str, report.Plot]:
    """The TTFT CDF (all requests, and per class when there are several), throughput and TTFT over time."""
    ok = [r for r in records if r["ok"] and r["ttft_s"] is not None]
    names = sorted({r["name"] for r in ok})
    groups = {"all requests": ok, **({n: [r for r in ok if r["name"] == n] for n in names} if len(names) > 1 else {})}
    cdf = {f"{k} (n={len(rows)})": [(t, (i + 1) / len(rows)) for i, t in enumerate(sorted(r["ttft_s"] for r in rows))] for k, rows in groups.items()}
    if not ok:
        return {}
    series = time_series(records)
    return {"loadtest_ttft_cdf": report.lines("TTFT CDF", "time to first token (s)", "fraction of requests", cdf),
            "loadtest_timeseries": report.lines("Over time (per bin; latencies of the requests sent in it)", "time since the first request (s)",
                                                "output tok/s, completed req/s ×100, TTFT p50/p90 ms", {
                "output tok/s": list(zip(series["t"], series["tok_s"], strict=True)),
                "completed req/s ×100": [(t, 100 * v) for t, v in zip(series["t"], series["req_s"], strict=True)],
                **{f"{k.replace('_', ' ')} (ms)": [(t, 1000 * v) for t, v in zip(series["t"], series[k], strict=True) if v is not None]
                   for k in ("ttft_p50", "ttft_p90")}})}


def main(argv: list[str] | None = None) -> int:
    p = report.Parser(__doc__)
    p.add_argument("--records", required=True, help="JSON lines from the locustfile's --records")
    p.options({"command": "what produced the run (default: this command)", "load_before": "the load average when the run started (else: now)"},
              title="Locust", command="", settings="", load_before="")
    args = p.parse_args(argv)
    records, results = load_records(args.records), report.start("loadtest_report")
    if args.load_before:
        results["machine"]["load_avg_before"] = [float(x) for x in args.load_before.split()]
    results.update(command=args.command or results["command"], settings=args.settings, summary=summarize(records))
    report.write(results, args.out_dir, "loadtest", f"Load test: {args.title}", body(results["summary"], args.settings), plots(records))
    s = results["summary"]
    print(f"[loadtest] {s['num_requests']} requests, {s['num_failed']} failed; {s['request_throughput']:.2f} req/s, {s['output_tok_s']:.1f} output "
          f"tok/s; TTFT p50 {num(s['ttft_s']['p50'], 0, 1000)} ms → {args.out_dir}/loadtest.md")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
