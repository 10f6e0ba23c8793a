"""dashboards/llm-serving.json sanity: ids, grid, variables, datasource, and every query names only
metrics that exist (names.py); the panels the issue asks for are there. Grafana provisioning files."""

from __future__ import annotations

import itertools

import pytest
import yaml

from serve_app.metrics import dashboard as dash
from serve_app.metrics import names
from tests.conftest import REPO


@pytest.fixture(scope="module")
def board():
    return dash.load()


def test_panel_ids_unique_and_grid_positions_valid(board):
    panels = list(dash.iter_panels(board))
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), "duplicate panel ids"
    assert all(isinstance(i, int) and i > 0 for i in ids)
    boxes = []
    for p in panels:
        g = p["gridPos"]
        assert set(g) == {"x", "y", "w", "h"}, p["title"]
        assert all(isinstance(g[k], int) for k in g), p["title"]
        assert g["x"] >= 0 and g["y"] >= 0 and g["w"] >= 1 and g["h"] >= 1 and g["x"] + g["w"] <= 24, p["title"]
        boxes.append((p["title"], g))
    for (t1, a), (t2, b) in itertools.combinations(boxes, 2):
        overlap = a["x"] < b["x"] + b["w"] and b["x"] < a["x"] + a["w"] and a["y"] < b["y"] + b["h"] and b["y"] < a["y"] + a["h"]
        assert not overlap, f"panels {t1!r} and {t2!r} overlap"


def test_variables_and_datasource(board):
    variables = dash.variables(board)
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    for name in ("model", "replica"):
        var = variables[name]
        assert var["type"] == "query" and var["includeAll"] and var["multi"] and var["allValue"] == ".*"
        selector, label = dash.parse_label_values(dash.variable_query(var))
        assert label == name
        assert not dash.unknown_metrics(selector)
    assert "$model" in dash.variable_query(variables["replica"])  # replicas of the chosen model(s)
    for panel in dash.iter_panels(board):
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == "${datasource}", panel["title"]


def test_every_query_uses_known_metrics_and_variables(board):
    targets = dash.targets(board)
    assert len(targets) >= 25
    used = set()
    for t in targets:
        found = dash.metric_names(t.expr)
        assert found, f"{t.panel_title}: no metric in {t.expr!r}"
        assert not dash.unknown_metrics(t.expr), f"{t.panel_title}: unknown metrics {dash.unknown_metrics(t.expr)}"
        used |= {names.series_to_metric(n).name for n in found}
        # the filters: every engine series is narrowed to the chosen model and replica(s); the API's
        # series come from the ingress replicas, which the engine-replica variable does not list
        assert 'model=~"$model"' in t.expr, t.panel_title
        ingress_only = {names.series_to_metric(n) for n in found} <= set(names.API_METRICS)
        assert ('replica=~"$replica"' in t.expr) != ingress_only, t.panel_title  # replica= or target_replica=
        expr = dash.substitute(t.expr, {"model": "m", "replica": ".*", "datasource": "prometheus"})
        assert "$" not in expr, expr
    assert used == {m.name for m in names.ALL_METRICS}, f"metrics without a panel: {sorted({m.name for m in names.ALL_METRICS} - used)}"


def test_the_issues_panels_are_there(board):
    by_title = {p["title"]: p for p in dash.iter_panels(board)}
    exprs = {title: " ".join(t["expr"] for t in p.get("targets", [])) for title, p in by_title.items()}
    assert by_title["Step batch size (heatmap)"]["type"] == "heatmap"
    assert by_title["Step batch size (heatmap)"]["targets"][0]["format"] == "heatmap"
    for title, quantiles in {"Step batch size": ("0.5", "0.99"), "Time to first token": ("0.5", "0.9", "0.99"),
                             "Time per output token": ("0.5", "0.99"), "End-to-end request latency": ("0.5", "0.99"),
                             "Queue time": ("0.5", "0.99"), "Step tokens": ("0.5", "0.99"),
                             "Step duration": ("0.5", "0.99")}.items():
        assert all(f"histogram_quantile({q}," in exprs[title] for q in quantiles), title
    for title in ("KV-cache usage per replica", "Running and waiting requests per replica", "Preemption rate"):
        assert "by (replica)" in exprs[title], title
    assert "by (finish_reason)" in exprs["Request rate by finish reason"]
    assert "ray_llm_prompt_tokens_total" in exprs["Token throughput"] and "ray_llm_generation_tokens_total" in exprs["Token throughput"]
    assert "ray_llm_router_stats_age_seconds" in exprs["Router stats age"]


def test_metric_name_extraction_catches_typos():
    expr = 'histogram_quantile(0.99, sum by (le, replica) (rate(ray_llm_time_to_first_token_seconds_bucket{model=~"$model", replica=~"$replica"}[$__rate_interval])))'
    assert dash.metric_names(expr) == {"ray_llm_time_to_first_token_seconds_bucket"}
    assert not dash.unknown_metrics(expr)
    assert dash.unknown_metrics(expr.replace("first_token", "first_tokens")) == {"ray_llm_time_to_first_tokens_seconds_bucket"}
    assert dash.unknown_metrics("sum(rate(llm_generation_tokens_total[1m]))") == {"llm_generation_tokens_total"}  # missing ray_
    assert dash.unknown_metrics("ray_llm_kv_cache_usage_ratio_count") == {"ray_llm_kv_cache_usage_ratio_count"}
    assert dash.metric_names('a / on (x) group_left b + max_over_time(c[5m]) > bool 0') == {"a", "b", "c"}
    with pytest.raises(KeyError):
        dash.substitute('x{model=~"$modle"}', {"model": "m"})
    assert dash.regex_value(["a.b", "c"]) == r"(a\\.b|c)"


def test_grafana_provisioning_files():
    ds = yaml.safe_load((REPO / "deploy/grafana/provisioning/datasources/prometheus.yml").read_text())
    (source,) = ds["datasources"]
    assert source["type"] == "prometheus" and source["url"].startswith("http://127.0.0.1:9090")
    prov = yaml.safe_load((REPO / "deploy/grafana/provisioning/dashboards/llm-serving.yml").read_text())
    (provider,) = prov["providers"]
    assert provider["type"] == "file" and provider["options"]["path"]
    board = dash.load()
    assert board["uid"] == "llm-serving" and "id" not in board  # uploads and provisioning match by uid
