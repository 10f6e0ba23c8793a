"""Reading a Grafana dashboard JSON outside Grafana: its panels, their PromQL targets with template
variables substituted, and the metric names each query uses.

Used by the PNG renderer (`dashboards/render_panels.py`) and by the tests that run every panel
against a real Prometheus. Grafana's own variables are replaced the way Grafana would for a
Prometheus datasource: `$__rate_interval` and `$__interval` by a fixed range, multi-value variables
by a regex alternation.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from serve_app.metrics import names

DASHBOARD = Path(__file__).resolve().parents[2] / "dashboards" / "llm-serving.json"

_VAR = re.compile(r"\$\{(\w+)(?::\w+)?\}|\[\[(\w+)\]\]|\$(\w+)")
_LABEL_VALUES = re.compile(r"^\s*label_values\((?:(?P<sel>.+),\s*)?(?P<label>\w+)\)\s*$")
# a PromQL identifier followed by a selector, a range or a space/paren/end: candidates for metric names
_IDENT = re.compile(r"(?<![\w\"'.:$])([a-zA-Z_:][a-zA-Z0-9_:]*)(?=\s*[{\[)\s,]|\s*$)")
_PROMQL_WORDS = {
    "sum", "min", "max", "avg", "count", "stddev", "stdvar", "topk", "bottomk", "quantile", "group",
    "count_values", "by", "without", "on", "ignoring", "group_left", "group_right", "and", "or", "unless",
    "bool", "offset", "le", "inf", "nan", "vector", "scalar", "time",
}


@dataclass(frozen=True)
class PanelTarget:
    panel_id: int
    panel_title: str
    panel_type: str
    ref_id: str
    expr: str  # as written in the dashboard (variables not substituted)
    legend: str
    format: str  # "time_series" or "heatmap"


def load(path: str | Path = DASHBOARD) -> dict[str, Any]:
    return json.loads(Path(path).read_text())


def iter_panels(dashboard: Mapping[str, Any]) -> Iterator[dict[str, Any]]:
    """Every panel, rows included, with panels nested in collapsed rows."""
    for panel in dashboard.get("panels", []):
        yield panel
        yield from panel.get("panels", [])


def targets(dashboard: Mapping[str, Any]) -> list[PanelTarget]:
    out = []
    for panel in iter_panels(dashboard):
        for t in panel.get("targets", []):
            if t.get("expr"):
                out.append(PanelTarget(panel["id"], panel.get("title", ""), panel.get("type", ""), t.get("refId", ""),
                                       t["expr"], t.get("legendFormat", ""), t.get("format", "time_series")))
    return out


def variables(dashboard: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    return {v["name"]: v for v in dashboard.get("templating", {}).get("list", [])}


def variable_query(variable: Mapping[str, Any]) -> str:
    query = variable.get("query", "")
    return query.get("query", "") if isinstance(query, dict) else str(query)


def parse_label_values(query: str) -> tuple[str | None, str]:
    """`label_values(selector, label)` → (selector or None, label)."""
    m = _LABEL_VALUES.match(query)
    if m is None:
        raise ValueError(f"not a label_values() query: {query!r}")
    return m.group("sel"), m.group("label")


def regex_value(values: list[str] | str) -> str:
    """What Grafana puts in `=~"$var"` for a (multi-)selection: an escaped alternation."""
    if isinstance(values, str):
        return values
    escaped = [re.sub(r"([\\.+*?()|\[\]{}^$])", r"\\\\\1", v) for v in values]
    return escaped[0] if len(escaped) == 1 else "(" + "|".join(escaped) + ")"


def substitute(expr: str, values: Mapping[str, str], rate_interval: str = "1m", interval: str = "15s") -> str:
    """Replace `$var`, `${var}`, `${var:fmt}` and `[[var]]`; an unknown variable raises KeyError."""
    builtins = {"__rate_interval": rate_interval, "__interval": interval, "__range": rate_interval}

    def repl(m: re.Match) -> str:
        name = m.group(1) or m.group(2) or m.group(3)
        if name in builtins:
            return builtins[name]
        if name not in values:
            raise KeyError(f"template variable ${name} has no value")
        return values[name]

    return _VAR.sub(repl, expr)


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression reads (identifiers that are not functions, keywords or
    label names inside selectors)."""
    without_strings = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    without_selectors = re.sub(r"\{[^}]*\}", "{}", without_strings)
    without_groupings = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", r"\1", without_selectors)
    found = set()
    for m in _IDENT.finditer(without_groupings):
        ident = m.group(1)
        rest = without_groupings[m.end():].lstrip()
        if ident.lower() in _PROMQL_WORDS or rest.startswith("(") or ident.startswith("$"):
            continue
        found.add(ident)
    return found


def unknown_metrics(expr: str) -> set[str]:
    """Metric names in `expr` that are not this service's (`ray_` + a name in names.py, or a series
    of one)."""
    return {n for n in metric_names(expr) if not n.startswith(names.RAY_PREFIX) or names.series_to_metric(n) is None}
