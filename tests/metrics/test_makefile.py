"""The Makefile's observability and test targets: Prometheus installed idempotently, only by the
targets that need it (never by `make serve` or `make test-fast`, which need no root), `make monitor`
runs Debian's prometheus on the shipped config, `make dashboards` uploads, `make test-fast` runs the
fast tier."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from tests import tiers
from tests.conftest import REPO


def dry_run(target: str, **variables: str) -> str:
    args = ["make", "-n", target, *(f"{k}={v}" for k, v in variables.items())]
    out = subprocess.run(args, cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout


def prerequisites(target: str) -> list[str]:
    """`target`'s prerequisites as the Makefile lists them (make's database, nothing run)."""
    out = subprocess.run(["make", "-pRrq", "-f", "Makefile", "__no_such_target__"], cwd=REPO, capture_output=True, text=True, timeout=60)
    for line in out.stdout.splitlines():
        if line.startswith(f"{target}:") and not line.startswith(f"{target}:="):
            return line.split(":", 1)[1].split()
    raise AssertionError(f"no rule for {target}")


def test_only_the_prometheus_targets_need_system_deps():
    """`make serve` and `make test-fast` never need root: neither they nor `install`/`model` depend on
    system-deps; `make test` (CI, as root) and the Prometheus targets do."""
    for target in ("install", "model", "serve", "test-fast", "lint", "chat"):
        assert "system-deps" not in prerequisites(target), target
    for target in ("test", "test-all", "monitor", "dashboard-demo"):
        assert "system-deps" in prerequisites(target), target
    out = dry_run("system-deps")
    assert "command -v promtool" in out and "apt-get install -y" in out and "prometheus" in out
    assert out.index("command -v promtool") < out.index("apt-get update")  # only when missing


def test_system_deps_does_nothing_when_prometheus_is_there(tmp_path):
    """Idempotent: with promtool and prometheus on PATH it exits 0 without apt, root or sudo (whether
    or not this machine has them: the fast tier runs before anything is installed)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("promtool", "prometheus"):
        (bin_dir / tool).write_text("#!/bin/sh\nexit 0\n")
        (bin_dir / tool).chmod(0o755)
    out = subprocess.run(["env", "-i", f"PATH={bin_dir}", shutil.which("make"), "-s", "system-deps"],
                         cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout == "" and out.stderr == "", out


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None, reason="needs root to run a target as another user")
def test_system_deps_without_root_says_what_to_do(tmp_path):
    """Prometheus missing, no root and no sudo: system-deps stops at once with what to run instead."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "id").symlink_to(shutil.which("id"))  # PATH holds nothing else: no promtool, prometheus or sudo
    tmp_path.chmod(0o755)
    bin_dir.chmod(0o755)
    out = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "env", "-i", f"PATH={bin_dir}",
                          shutil.which("make"), "-s", "system-deps"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode != 0
    assert "needs root: run 'sudo make system-deps'" in out.stderr and "make test-fast do not need it" in out.stderr, out.stderr


def test_test_fast_runs_the_fast_tier():
    """`make test-fast` selects exactly the tier tests/tiers.py defines (and enforces)."""
    assert f'-m "{tiers.FAST_MARKEXPR}"' in dry_run("test-fast")


def test_monitor_runs_prometheus_on_the_shipped_config():
    out = dry_run("monitor", PROMETHEUS_PORT="9191")
    assert "promtool check config deploy/prometheus/prometheus.yml" in out
    assert "prometheus --config.file=deploy/prometheus/prometheus.yml" in out
    assert "--web.listen-address=127.0.0.1:9191" in out


def test_dashboard_targets():
    assert "dashboards/upload.py" in dry_run("dashboards")
    assert "dashboards/render_panels.py" in dry_run("dashboard-png") and "reports/dashboard" in dry_run("dashboard-png")
