"""Router-test fixtures: a local Ray (integration) and a two-node Ray cluster on this machine
(multi-node), each with the replica probe (`tests.replica_probe`) writing into a fresh directory."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.ray_start import init_local_ray
from tests.router.ray_helpers import PROBE_DIR_ENV, REPO, TwoNodeCluster, refresh_ray_settings


@contextlib.contextmanager
def _environment(**values: str) -> Iterator[None]:
    """Set environment variables (and the repo root as cwd: replicas import `loadtest` from the
    driver's working directory) for the lifetime of a Ray instance; restore them afterwards."""
    before = {k: os.environ.get(k) for k in values}
    cwd = os.getcwd()
    os.environ.update(values)
    os.chdir(REPO)
    try:
        yield
    finally:
        os.chdir(cwd)
        for key, value in before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _stop_ray() -> None:
    import ray
    from ray import serve

    if ray.is_initialized():
        with contextlib.suppress(Exception):
            serve.shutdown()
        ray.shutdown()


@pytest.fixture(scope="module")
def probe_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("probes")


@pytest.fixture(scope="module")
def local_ray(model_dir, probe_dir):
    """A single-node Ray on the loopback address, 2 CPUs."""
    import ray

    _stop_ray()  # pragma: no cover - another module left one
    with _environment(**{PROBE_DIR_ENV: str(probe_dir), "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}):
        init_local_ray(num_cpus=2, include_dashboard=False, log_to_driver=False, namespace="router-tests")
        try:
            yield ray
        finally:
            _stop_ray()


@pytest.fixture(scope="module")
def two_node_ray(model_dir, probe_dir):
    """Two raylets on 127.0.0.1 (a head and a worker node, 1 CPU each); this process is its driver."""
    _stop_ray()
    cluster = TwoNodeCluster(env={PROBE_DIR_ENV: str(probe_dir)})
    keys = {k: cluster.env[k] for k in ("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN")}
    try:
        cluster.start()
        with _environment(**keys, **{PROBE_DIR_ENV: str(probe_dir)}):
            cluster.connect()
            try:
                yield cluster
            finally:
                _stop_ray()
        refresh_ray_settings()  # back to this process's own environment
    finally:
        print(f"\n[two-node cluster] {cluster.temp_dir}: ended {cluster.stop()} processes")
