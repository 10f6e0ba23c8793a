"""End to end with real components: a Ray Serve deployment of the app (2 LLMServer replicas), a real
Prometheus (Debian's package) scraping Ray's metrics endpoints through the shipped config (Ray's
service-discovery file, loopback relabel, the shipped rules), a short bounded load through the
OpenAI API, then:

- the traffic is in Prometheus exactly (requests, generated tokens), from both replicas;
- every panel target of dashboards/llm-serving.json, with its template variables resolved the way
  Grafana would (label_values() through Prometheus's API), returns data over the load window;
- the recording rules evaluate and the replica-down alert's inputs exist (and it does not fire);
- the PNG renderer draws the key panels from the same Prometheus.

Ray gets its own temp dir (its service-discovery file is per temp dir), ports and a 1 s metrics
report interval; Prometheus scrapes every 2 s (`serve_app.metrics.local_stack`). Both are stopped
at the end.
"""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from serve_app.metrics import dashboard as dash
from serve_app.metrics import local_stack, names
from serve_app.metrics.prom_api import PrometheusAPI
from tests.conftest import REPO
from tests.polling import wait_for  # noqa: F401 (also re-exported to test modules)

MODEL_NAME = "smollm2-135m-instruct"
NUM_REPLICAS = 2
NUM_REQUESTS, MAX_TOKENS, CONCURRENCY = 12, 12, 6
RATE_INTERVAL = "30s"

pytestmark = [pytest.mark.prometheus, pytest.mark.timeout(480), pytest.mark.startup(reason="starts Ray, Serve and a Prometheus server, and waits for its first scrapes")]




@pytest.fixture(scope="module")
def served(model_dir):
    """A private Ray instance (own temp dir and ports, dashboard on for the discovery file) + the app."""
    from ray import serve

    from serve_app.serving.app import build_app

    args = {
        "model": model_dir, "num_replicas": NUM_REPLICAS, "num_cpus_per_replica": 0.5,
        "torch_num_threads": 1,  # a shared 2-core machine: one thread per replica
        "max_ongoing_requests": 32, "request_routing_stats_period_s": 0.5, "health_check_period_s": 2.0,
        "api_key_env": "", "engine": {"dtype": "float32", "num_blocks": 128, "max_num_seqs": 16,
                                         "speculative": {"method": "ngram", "k": 2}},  # the speculation panels' data
        "router": "prefix_aware",  # records the router metrics (RouterMetrics.for_ray), the routing row's included
    }
    started = time.monotonic()
    with local_stack.ray_instance(metrics_report_interval_ms=1000, namespace="metrics-e2e") as instance:
        http_port = local_stack.free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": http_port})
        serve.run(build_app(args), name="llm", route_prefix="/")
        print(f"\n[e2e] Ray + Serve app ready in {time.monotonic() - started:.1f} s")
        yield {"base_url": f"http://127.0.0.1:{http_port}", "sd_file": instance.sd_file}


@pytest.fixture(scope="module")
def prometheus(served, tmp_path_factory):
    """Prometheus with the shipped config and rules, pointed at this Ray's discovery file, scraping
    every 2 s (a loaded 2-core machine can take over a second to answer a scrape)."""
    if shutil.which("prometheus") is None:
        pytest.fail("prometheus not found: run `make system-deps` (Debian's prometheus package)")
    config = local_stack.prometheus_config(served["sd_file"], scrape_interval="2s")
    with local_stack.prometheus_server(config, tmp_path_factory.mktemp("prometheus")) as api:
        yield api


@pytest.fixture(scope="module")
def load(served, prometheus):
    """A short bounded load: 12 completions (ignore_eos, 12 tokens each), 6 at a time; the prompts
    share a long prefix so the prefix cache gets hits. Each wave adds one chat constrained by a JSON
    schema of its own (the grammar metrics' data: two compiles; the same chat, so the prefix-aware
    router sends both to one replica and its histograms grow between scrapes)."""
    shared = "You are a concise assistant. Answer in one short sentence, without preamble or lists. " * 3
    topics = ["the sea", "the moon", "a cat", "Paris", "rain", "coffee"]

    def scraping():  # every target scraped, both replicas' series stored (counters at 0 before the load)
        targets = {t["scrapeUrl"]: (t["health"], t.get("lastError")) for t in prometheus.targets()}
        ever_up = {s["metric"]["instance"] for s in prometheus.query('max_over_time(up{job="ray"}[5m]) == 1')}
        kv = prometheus.query("ray_llm_kv_cache_usage_ratio")
        ok = targets and len(ever_up) == len(targets) and len(kv) == NUM_REPLICAS
        return True if ok else (targets, sorted(ever_up), len(kv))

    last: list = []
    try:
        wait_for(lambda: last.append(scraping()) or last[-1] is True, 90, message="Prometheus scraping every Ray target")
    except AssertionError as exc:
        raise AssertionError(f"{exc}; targets, instances ever up, replicas with series: {last[-1]}") from None
    time.sleep(4)  # a couple of samples before the load starts
    start = time.time()

    def one(i: int) -> dict:
        body = {"model": MODEL_NAME, "prompt": f"{shared}Tell me about {topics[i % len(topics)]} ({i}).",
                "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
        r = httpx.post(f"{served['base_url']}/v1/completions", json=body, timeout=300)
        assert r.status_code == 200, r.text
        return r.json()

    def constrained(wave: int) -> dict:
        schema = {"type": "object", "properties": {"animal": {"enum": [f"cat{wave}", f"dog{wave}"]}},
                  "required": ["animal"], "additionalProperties": False}
        body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Name an animal as JSON."}],
                "max_tokens": 40, "temperature": 0,
                "response_format": {"type": "json_schema", "json_schema": {"name": f"pet{wave}", "schema": schema}}}
        r = httpx.post(f"{served['base_url']}/v1/chat/completions", json=body, timeout=300)
        assert r.status_code == 200, r.text
        reply = r.json()
        assert json.loads(reply["choices"][0]["message"]["content"])["animal"] in (f"cat{wave}", f"dog{wave}")
        return reply

    # two waves a few scrapes apart: a histogram series is born with its first report, so traffic that
    # all lands within one scrape interval (a fast machine) would give rate() no increase to see
    replies, structured = [], []
    for wave in (range(NUM_REQUESTS // 2), range(NUM_REQUESTS // 2, NUM_REQUESTS)):
        with ThreadPoolExecutor(CONCURRENCY) as pool:
            pending = pool.submit(constrained, wave.start)
            replies += list(pool.map(one, wave))
            structured.append(pending.result())
        if wave.start == 0:
            time.sleep(5)
    end = time.time()
    print(f"[e2e] load: {NUM_REQUESTS} requests x {MAX_TOKENS} tokens in {end - start:.1f} s")
    assert all(r["usage"]["completion_tokens"] == MAX_TOKENS for r in replies)
    assert all(r["choices"][0]["finish_reason"] == "length" for r in replies)
    # Ray reports every second, Prometheus scrapes every second: wait until the counts are complete
    wait_for(lambda: _scalar(prometheus, "sum(ray_llm_request_success_total)") == NUM_REQUESTS + len(structured),
             90, message="all requests counted in Prometheus")
    time.sleep(4)  # and a couple after it
    return {"start": start, "end": time.time(), "structured": structured}


def _scalar(api: PrometheusAPI, expr: str) -> float | None:
    result = api.query(expr)
    return float(result[0]["value"][1]) if result else None


def test_scrape_targets_are_rays_endpoints_on_loopback(prometheus, load):
    targets = prometheus.targets()
    assert len(targets) >= 2, targets  # the node's metrics agent + the dashboard (+ autoscaler)
    ever_up = {s["metric"]["instance"] for s in prometheus.query('max_over_time(up{job="ray"}[5m]) == 1')}
    for t in targets:
        assert t["scrapeUrl"].startswith("http://127.0.0.1:"), t["scrapeUrl"]
        assert t["labels"]["job"] == "ray"
        # scraped successfully (a single slow scrape on a loaded machine is not a failure here)
        assert t["labels"]["instance"] in ever_up, (t["scrapeUrl"], t["health"], t.get("lastError"))


def test_known_traffic_reaches_prometheus_exactly(prometheus, load):
    structured = load["structured"]
    total = NUM_REQUESTS + len(structured)
    cut = sum(r["choices"][0]["finish_reason"] == "length" for r in structured)
    assert _scalar(prometheus, 'sum(ray_llm_request_success_total{finish_reason="length"})') == NUM_REQUESTS + cut
    assert _scalar(prometheus, "sum(ray_llm_generation_tokens_total)") == (
        NUM_REQUESTS * MAX_TOKENS + sum(r["usage"]["completion_tokens"] for r in structured))
    assert _scalar(prometheus, "sum(ray_llm_time_to_first_token_seconds_count)") == total
    assert _scalar(prometheus, "sum(ray_llm_e2e_request_latency_seconds_count)") == total
    assert _scalar(prometheus, "sum(ray_llm_grammar_compile_seconds_count)") == len(structured)  # two schemas
    assert _scalar(prometheus, "sum(ray_llm_grammar_mask_seconds_count)") > 0
    assert _scalar(prometheus, "sum(ray_llm_prefix_cache_hits_total)") > 0
    # every engine metric is exported by every replica, with Serve's labels and ours
    exported = set(prometheus.metric_names())
    for spec in names.ENGINE_METRICS:
        for series in spec.series_names(names.RAY_PREFIX):
            assert series in exported, f"{series} not in Prometheus"
    kv = prometheus.query("ray_llm_kv_cache_usage_ratio")
    assert len({s["metric"]["replica"] for s in kv}) == NUM_REPLICAS
    assert all(s["metric"]["model"] == MODEL_NAME and s["metric"]["deployment"] == "LLMServer"
               and s["metric"]["application"] == "llm" for s in kv)
    # idle again: the KV caches are empty
    wait_for(lambda: _scalar(prometheus, "max(ray_llm_kv_cache_usage_ratio)") == 0, 30, message="KV usage back to 0")
    assert _scalar(prometheus, "sum(ray_llm_num_requests_running)") == 0


def test_every_dashboard_panel_returns_data(served, prometheus, load):
    board = dash.load()
    variables = dash.variables(board)
    values = {"datasource": "prometheus"}
    # resolve the variables like Grafana: label_values(selector, label) through Prometheus's API
    for name in ("model", "replica"):
        selector, label = dash.parse_label_values(dash.variable_query(variables[name]))
        options = prometheus.label_values(label, dash.substitute(selector, values) if selector else None)
        assert options, f"variable ${name}: no values"
        values[name] = dash.regex_value(sorted(options))
        if name == "model":
            assert options == [MODEL_NAME]
        else:
            assert len(options) == NUM_REPLICAS

    def empty_targets() -> list[str]:
        empty = []
        for t in dash.targets(board):
            expr = dash.substitute(t.expr, values, rate_interval=RATE_INTERVAL)
            series = prometheus.query_range(expr, load["start"] - 5, time.time(), 1.0)
            if not [float(v) for s in series for _, v in s["values"] if math.isfinite(float(v))]:
                empty.append(f"{t.panel_title} [{t.ref_id}]: {expr}")
        return empty

    # a loaded machine reports and scrapes late: give the last samples time to arrive before failing
    deadline = time.time() + 30
    while (empty := empty_targets()) and time.time() < deadline:
        time.sleep(2)
    checked = len(dash.targets(board))
    print(f"[e2e] {checked} panel targets returned data")
    if empty:  # context for the failure: what Prometheus holds over the window
        now = time.time()
        raw = prometheus.query_range('sum(ray_llm_request_success_total{finish_reason="length"})', load["start"] - 5, now, 1.0)
        up = prometheus.query_range("up", load["start"] - 5, now, 1.0)
        durations = prometheus.query("scrape_duration_seconds")
        pytest.fail("panel targets without data:\n" + "\n".join(empty) + f"\nwindow {load['start'] - 5:.0f}..{now:.0f}"
                    f"\nsuccess counter samples: {raw}\nup: {up}\nscrape durations: {durations}")
    # the router's view lines up with the replicas' own: same replica ids
    routed = prometheus.query("sum by (target_replica) (ray_llm_router_routed_requests_total)")
    assert {s["metric"]["target_replica"] for s in routed} == set(values["replica"].strip("()").split("|"))
    assert sum(float(s["value"][1]) for s in routed) >= NUM_REQUESTS  # + the ingress's model_info() calls


def test_rules_evaluate_and_replica_down_alert_is_wired(prometheus, load):
    groups = prometheus.rule_groups()
    rules = [r for g in groups for r in g["rules"]]
    assert {r["name"] for r in rules if r["type"] == "alerting"} >= {"LLMKVCacheNearlyFull", "LLMTimeToFirstTokenP99High", "LLMServerReplicaDown"}
    wait_for(lambda: all(r["health"] == "ok" for g in prometheus.rule_groups() for r in g["rules"]), 30,
             message="every rule evaluated without error")
    for rule in (r for r in rules if r["type"] == "recording"):
        assert prometheus.query(rule["name"]), f"recording rule {rule['name']} has no data"
    # the replica-down alert reads Serve's controller metrics: they must exist, and agree (2 of 2)
    target = prometheus.query('max by (application, deployment) (ray_serve_autoscaling_target_replicas{deployment="LLMServer"})')
    healthy = prometheus.query('sum by (application, deployment) (ray_serve_deployment_replica_healthy{deployment="LLMServer"})')
    assert [float(s["value"][1]) for s in target] == [NUM_REPLICAS]
    assert [float(s["value"][1]) for s in healthy] == [NUM_REPLICAS]
    firing = [a for a in prometheus.alerts() if a["labels"]["alertname"] == "LLMServerReplicaDown"]
    assert not firing, firing


def test_render_key_panels_to_png(prometheus, load, tmp_path):
    out = tmp_path / "png"
    proc = subprocess.run([sys.executable, "dashboards/render_panels.py", "--prometheus-url", prometheus.url,
                           "--out", str(out), "--start", f"{load['start'] - 5:.0f}", "--step", "1",
                           "--rate-interval", RATE_INTERVAL, "--strict"],
                          cwd=REPO, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = json.loads((out / "panels.json").read_text())
    assert len(summary["panels"]) >= 8
    for panel in summary["panels"]:
        png = out / panel["png"]
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5_000, panel["title"]
        assert all(t["num_finite_points"] > 0 for t in panel["targets"]), panel
    assert (out / "overview.png").stat().st_size > 50_000


def test_idle_replicas_keep_reporting_their_gauges(prometheus, load):
    """Ray drops a gauge that is not set again within seconds; the exporters re-publish theirs, so an
    idle replica still reports an empty KV cache (not "no data") long after its last step."""
    idle_since = load["end"]
    time.sleep(max(0.0, idle_since + 20 - time.time()))
    counts = prometheus.query_range("count(ray_llm_kv_cache_usage_ratio == 0)", idle_since + 2, time.time(), 1.0)
    assert counts, "no KV usage series while idle"
    values = [float(v) for _, v in counts[0]["values"]]
    assert len(values) >= 15 and set(values) == {NUM_REPLICAS}, values
    ages = prometheus.query("count(ray_llm_router_stats_age_seconds)")
    assert ages and float(ages[0]["value"][1]) >= 1  # replicas the router has sent requests to
