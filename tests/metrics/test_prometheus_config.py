"""The shipped Prometheus files: `promtool check config`, `promtool check rules`, the rules' unit
tests (`promtool test rules`), and every metric the rules read exists."""

from __future__ import annotations

import shutil
import subprocess

import pytest
import yaml

from serve_app.metrics import dashboard as dash
from tests.conftest import REPO

PROM_DIR = REPO / "deploy" / "prometheus"
RULES = PROM_DIR / "rules" / "llm-serving.rules.yml"
# Ray Serve's own metrics and Prometheus's `up` that the alerts also read
EXTERNAL_METRICS = {"up", "ray_serve_autoscaling_target_replicas", "ray_serve_deployment_replica_healthy"}


def promtool(*args: str) -> subprocess.CompletedProcess:
    exe = shutil.which("promtool")
    if exe is None:
        pytest.fail("promtool not found: run `make system-deps` as root (Debian's prometheus package); `make test-fast` leaves these tests out")
    return subprocess.run([exe, *args], cwd=REPO, capture_output=True, text=True, timeout=120)


@pytest.mark.prometheus
def test_promtool_check_config():
    out = promtool("check", "config", str(PROM_DIR / "prometheus.yml"))
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS" in out.stdout + out.stderr


@pytest.mark.prometheus
def test_promtool_check_rules():
    out = promtool("check", "rules", str(RULES))
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.prometheus
def test_promtool_rule_unit_tests():
    """Synthetic series: which alerts fire when (sustained KV pressure, slow TTFT, a replica down)."""
    out = promtool("test", "rules", str(PROM_DIR / "tests" / "llm-serving.rules.test.yml"))
    assert out.returncode == 0, out.stdout + out.stderr


def test_rules_read_only_known_metrics():
    groups = yaml.safe_load(RULES.read_text())["groups"]
    rules = [r for g in groups for r in g["rules"]]
    recorded = {r["record"] for r in rules if "record" in r}
    alerts = {r["alert"] for r in rules if "alert" in r}
    assert {"LLMKVCacheNearlyFull", "LLMTimeToFirstTokenP99High", "LLMServerReplicaDown"} <= alerts
    for rule in rules:
        unknown = dash.unknown_metrics(rule["expr"]) - recorded - EXTERNAL_METRICS
        assert not unknown, f"{rule.get('record') or rule.get('alert')}: unknown metrics {unknown}"


def test_scrape_config_follows_rays_service_discovery_on_loopback():
    config = yaml.safe_load((PROM_DIR / "prometheus.yml").read_text())
    (job,) = config["scrape_configs"]
    assert job["file_sd_configs"][0]["files"] == ["/tmp/ray/prom_metrics_service_discovery.json"]
    rewrite = [r for r in job["relabel_configs"] if r.get("target_label") == "__address__"]
    assert rewrite and rewrite[0]["replacement"].startswith("127.0.0.1:")
