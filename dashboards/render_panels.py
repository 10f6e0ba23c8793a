"""Render Grafana dashboard panels to PNG without Grafana: each panel's PromQL targets (template
variables substituted) are run against Prometheus's HTTP API and drawn with matplotlib.

    make dashboard-png                       # key panels, last 30 minutes, http://127.0.0.1:9090
    python dashboards/render_panels.py --all --minutes 10 --var model=smollm2-135m-instruct \
        --prometheus-url http://127.0.0.1:9090 --out reports/dashboard

Writes one PNG per panel, `overview.png` (all of them on one page) and `panels.json` (per target:
the substituted query, series and points found) into `--out`. Exit status 1 with `--strict` when a
rendered target returned no data.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import time
from pathlib import Path
from typing import Any

from serve_app.metrics import dashboard as dash
from serve_app.metrics.prom_api import PrometheusAPI

KEY_PANELS = (
    "Request rate by finish reason",
    "Token throughput",
    "Time to first token",
    "End-to-end request latency",
    "Step batch size (heatmap)",
    "Step batch size",
    "KV-cache usage per replica",
    "Running and waiting requests per replica",
)
_LEGEND = re.compile(r"\{\{\s*(\w+)\s*\}\}")


def slug(title: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", title.lower()).strip("-")


def legend(fmt: str, labels: dict[str, str], fallback: str) -> str:
    if not fmt:
        return ", ".join(f"{k}={v}" for k, v in sorted(labels.items()) if k != "__name__") or fallback
    return _LEGEND.sub(lambda m: labels.get(m.group(1), ""), fmt)


def fetch(api: PrometheusAPI, panel: dict[str, Any], values: dict[str, str], start: float, end: float,
          step: float, rate_interval: str) -> list[dict[str, Any]]:
    """Run every target of a panel; one entry per target with its series."""
    results = []
    for target in panel.get("targets", []):
        if not target.get("expr"):
            continue
        expr = dash.substitute(target["expr"], values, rate_interval=rate_interval)
        series = api.query_range(expr, start, end, step)
        points = [[(float(t), float(v)) for t, v in s["values"]] for s in series]
        results.append({
            "ref_id": target.get("refId", ""), "expr": expr, "legend_format": target.get("legendFormat", ""),
            "format": target.get("format", "time_series"),
            "series": [{"labels": s["metric"], "points": p} for s, p in zip(series, points, strict=True)],
            "num_series": len(series),
            "num_finite_points": sum(1 for p in points for _, v in p if math.isfinite(v)),
        })
    return results


def _scale(unit: str) -> tuple[float, str]:
    return {"percentunit": (100.0, "%"), "s": (1.0, "seconds"), "reqps": (1.0, "requests/s"),
            "short": (1.0, "")}.get(unit, (1.0, unit or ""))


def draw_timeseries(ax: Any, panel: dict[str, Any], results: list[dict[str, Any]], t0: float) -> None:
    factor, ylabel = _scale(panel.get("fieldConfig", {}).get("defaults", {}).get("unit", ""))
    for result in results:
        for s in result["series"]:
            xs = [(t - t0) / 60 for t, v in s["points"] if math.isfinite(v)]
            ys = [v * factor for _, v in s["points"] if math.isfinite(v)]
            if xs:
                ax.plot(xs, ys, label=legend(result["legend_format"], s["labels"], result["ref_id"]), linewidth=1.2)
    ax.set_ylabel(ylabel)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7, loc="upper left")


def draw_heatmap(ax: Any, results: list[dict[str, Any]], t0: float) -> None:
    """Series per `le` bucket (cumulative counts per interval) → counts per bucket over time."""
    import numpy as np

    series = [s for r in results for s in r["series"] if "le" in s["labels"]]
    if not series:
        return
    series.sort(key=lambda s: float(s["labels"]["le"]))
    times = sorted({t for s in series for t, _ in s["points"]})
    index = {t: i for i, t in enumerate(times)}
    cumulative = np.zeros((len(series), len(times)))
    for row, s in enumerate(series):
        for t, v in s["points"]:
            cumulative[row, index[t]] = v if math.isfinite(v) else 0.0
    counts = np.diff(cumulative, axis=0, prepend=0.0).clip(min=0.0)
    x = [(t - t0) / 60 for t in times]
    mesh = ax.pcolormesh(x, np.arange(len(series)), counts, shading="nearest", cmap="Oranges")
    ax.set_yticks(range(len(series)), [s["labels"]["le"] for s in series], fontsize=7)
    ax.set_ylabel("bucket (le)")
    ax.figure.colorbar(mesh, ax=ax, label="steps per interval")


def draw(ax: Any, panel: dict[str, Any], results: list[dict[str, Any]], t0: float) -> None:
    if panel.get("type") == "heatmap":
        draw_heatmap(ax, results, t0)
    else:
        draw_timeseries(ax, panel, results, t0)
    ax.set_title(panel.get("title", ""), fontsize=10)
    ax.set_xlabel("minutes")
    ax.grid(alpha=0.3)
    if not any(r["num_finite_points"] for r in results):
        ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes, color="grey")


def render(api: PrometheusAPI, dashboard: dict[str, Any], out_dir: Path, titles: list[str] | None,
           values: dict[str, str], start: float, end: float, step: float | None = None,
           rate_interval: str = "1m") -> dict[str, Any]:
    """Render the chosen panels (None: every panel); returns the summary written to panels.json."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [p for p in dash.iter_panels(dashboard) if p.get("targets")]
    if titles is not None:
        by_title = {p["title"]: p for p in panels}
        missing = [t for t in titles if t not in by_title]
        if missing:
            raise SystemExit(f"no such panel(s): {missing}; panels: {sorted(by_title)}")
        panels = [by_title[t] for t in titles]
    step = step or max(1.0, (end - start) / 240)
    out_dir.mkdir(parents=True, exist_ok=True)
    summary: dict[str, Any] = {"prometheus": api.url, "start": start, "end": end, "step": step,
                               "variables": values, "panels": []}
    fetched = []
    for panel in panels:
        results = fetch(api, panel, values, start, end, step, rate_interval)
        fetched.append((panel, results))
        fig, ax = plt.subplots(figsize=(8, 4), layout="constrained")
        draw(ax, panel, results, start)
        path = out_dir / f"{slug(panel['title'])}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        summary["panels"].append({"id": panel["id"], "title": panel["title"], "png": path.name,
                                  "targets": [{k: r[k] for k in ("ref_id", "expr", "num_series", "num_finite_points")}
                                              for r in results]})
    cols = 2
    rows = max(1, math.ceil(len(fetched) / cols))
    fig, axes = plt.subplots(rows, cols, figsize=(8 * cols, 3.6 * rows), layout="constrained", squeeze=False)
    for ax, (panel, results) in zip(axes.flat, fetched, strict=False):
        draw(ax, panel, results, start)
    for ax in list(axes.flat)[len(fetched):]:
        ax.axis("off")
    fig.suptitle(f"{dashboard.get('title', '')} — {time.strftime('%Y-%m-%d %H:%M', time.localtime(start))} "
                 f"+{(end - start) / 60:.1f} min", fontsize=12)
    fig.savefig(out_dir / "overview.png", dpi=90)
    plt.close(fig)
    (out_dir / "panels.json").write_text(json.dumps(summary, indent=2))
    return summary


def default_values(dashboard: dict[str, Any]) -> dict[str, str]:
    """Every template variable at "All" (its allValue, else .*); the datasource is not used here."""
    values = {}
    for name, var in dash.variables(dashboard).items():
        values[name] = "prometheus" if var.get("type") == "datasource" else var.get("allValue") or ".*"
    return values


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prometheus-url", default=os.environ.get("PROMETHEUS_URL", "http://127.0.0.1:9090"))
    parser.add_argument("--dashboard", type=Path, default=dash.DASHBOARD)
    parser.add_argument("--out", type=Path, default=Path("reports/dashboard"))
    parser.add_argument("--minutes", type=float, default=30.0, help="time range ending now")
    parser.add_argument("--start", type=float, help="range start (unix seconds; overrides --minutes)")
    parser.add_argument("--end", type=float, help="range end (unix seconds; default now)")
    parser.add_argument("--step", type=float, help="query resolution in seconds (default: range / 240)")
    parser.add_argument("--rate-interval", default="1m", help="what $__rate_interval becomes")
    parser.add_argument("--var", action="append", default=[], metavar="NAME=VALUE",
                        help="template variable value (regex; default: All)")
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--panels", help="comma-separated panel titles (default: the key panels)")
    group.add_argument("--all", action="store_true", help="every panel")
    parser.add_argument("--strict", action="store_true", help="exit 1 when a target returned no data")
    args = parser.parse_args(argv)

    dashboard = dash.load(args.dashboard)
    values = default_values(dashboard)
    for item in args.var:
        name, sep, value = item.partition("=")
        if not sep or name not in values:
            parser.error(f"--var {item!r}: expected NAME=VALUE with NAME one of {sorted(values)}")
        values[name] = value
    end = args.end or time.time()
    start = args.start or end - args.minutes * 60
    titles = None if args.all else ([t.strip() for t in args.panels.split(",")] if args.panels else list(KEY_PANELS))
    api = PrometheusAPI(args.prometheus_url)
    if not api.ready():
        print(f"Prometheus is not answering at {args.prometheus_url} (start it with `make monitor`)", file=sys.stderr)
        return 2
    summary = render(api, dashboard, args.out, titles, values, start, end, args.step, args.rate_interval)
    empty = [f"{p['title']} [{t['ref_id']}]" for p in summary["panels"] for t in p["targets"] if not t["num_finite_points"]]
    print(f"wrote {len(summary['panels'])} panel PNGs + overview.png to {args.out}")
    if empty:
        print("no data for: " + "; ".join(empty), file=sys.stderr)
    return 1 if (empty and args.strict) else 0


if __name__ == "__main__":
    sys.exit(main())
