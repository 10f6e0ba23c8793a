"""The test tiers' rule (tests/tiers.py), on a synthetic suite run by a real pytest in a subprocess:
a test that starts Ray in its body or through any fixture leaves the fast tier by itself; one that
starts it some way the collection cannot see fails when it runs in the fast tier."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests import tiers
from tests.conftest import REPO

SUITE = '''
import pytest
import ray
from ray import serve


@pytest.fixture(scope="module")
def cluster():
    ray.init(num_cpus=1, include_dashboard=False)
    yield
    ray.shutdown()


@pytest.fixture
def via_cluster(cluster):
    return "two fixtures away from ray.init"


def start_quietly():
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)


def test_unit():
    assert ray.is_initialized() is False


def test_body_starts_serve():
    serve.run(None)


def test_uses_a_cluster_fixture(via_cluster):
    assert via_cluster


@pytest.mark.cluster
def test_marked_by_hand():
    start_quietly()


def test_starts_ray_out_of_sight():
    start_quietly()
'''


def run_suite(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    (tmp_path / "test_synthetic.py").write_text(SUITE)
    env = {**os.environ, "PYTHONPATH": str(REPO), "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "tests.tiers", "-p", "no:cacheprovider", "-q",
                           "-m", tiers.FAST_MARKEXPR, "-W", "ignore::pytest.PytestUnknownMarkWarning", *args],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)


def test_starting_a_cluster_in_a_test_or_its_fixtures_leaves_the_fast_tier(tmp_path):
    out = run_suite(tmp_path, "--collect-only")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    selected = sorted(line.split("::")[1] for line in out.stdout.splitlines() if "::" in line)
    assert selected == ["test_starts_ray_out_of_sight", "test_unit"], out.stdout


@pytest.mark.cluster
def test_a_fast_tier_test_that_starts_ray_fails(tmp_path):
    out = run_suite(tmp_path)
    assert out.returncode == 1, out.stdout[-3000:]
    assert "test_synthetic.py::test_starts_ray_out_of_sight started Ray but is not marked cluster" in out.stdout, out.stdout[-3000:]
    assert "1 failed, 1 passed, 3 deselected" in out.stdout, out.stdout[-3000:]


def test_starter_calls_are_read_from_the_body():
    from tests.serving import test_serve_run
    from tests.serving.conftest import ray_cluster

    assert tiers.starter_call(test_serve_run.test_serve_run_local_config) == "start_serve_run"
    assert tiers.starter_call(getattr(ray_cluster, "__wrapped__", ray_cluster)) == "init_local_ray"
    assert tiers.starter_call(test_starter_calls_are_read_from_the_body) is None
