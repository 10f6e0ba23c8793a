"""The Makefile's observability targets: Prometheus installed idempotently before anything else,
`make monitor` runs Debian's prometheus on the shipped config, `make dashboards` uploads."""

from __future__ import annotations

import subprocess

from tests.conftest import REPO


def dry_run(target: str, **variables: str) -> str:
    args = ["make", "-n", target, *(f"{k}={v}" for k, v in variables.items())]
    out = subprocess.run(args, cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_install_depends_on_system_deps_which_is_idempotent():
    out = dry_run("install")
    assert "command -v promtool" in out and "apt-get install -y" in out and "prometheus" in out
    assert out.index("command -v promtool") < out.index("apt-get update")  # only when missing
    # already installed here: running it does nothing (and succeeds)
    real = subprocess.run(["make", "system-deps"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert real.returncode == 0 and "installing" not in real.stdout


def test_monitor_runs_prometheus_on_the_shipped_config():
    out = dry_run("monitor", PROMETHEUS_PORT="9191")
    assert "promtool check config deploy/prometheus/prometheus.yml" in out
    assert "prometheus --config.file=deploy/prometheus/prometheus.yml" in out
    assert "--web.listen-address=127.0.0.1:9191" in out


def test_dashboard_targets():
    assert "dashboards/upload.py" in dry_run("dashboards")
    assert "dashboards/render_panels.py" in dry_run("dashboard-png") and "reports/dashboard" in dry_run("dashboard-png")
