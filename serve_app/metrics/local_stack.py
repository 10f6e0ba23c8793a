"""A private local monitoring stack: a Ray instance and a Prometheus server that scrapes it with the
shipped config (deploy/prometheus). Used by the end-to-end metrics test and `dashboards/demo.py`.

Isolation from other Ray instances on the same machine: Ray gets its own temp dir (so its own
service-discovery file), free ports for its node metrics, dashboard and autoscaler metrics (the last
two default to fixed ports 44227 / 44217, which another instance may hold), and loopback only.
Everything started here is stopped on exit.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import yaml

from serve_app.metrics.prom_api import PrometheusAPI

REPO = Path(__file__).resolve().parents[2]
PROMETHEUS_DIR = REPO / "deploy" / "prometheus"


def free_port() -> int:
    with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class RayInstance:
    temp_dir: str

    @property
    def sd_file(self) -> str:
        """Ray's Prometheus service-discovery file (written by its dashboard process)."""
        return str(Path(self.temp_dir) / "prom_metrics_service_discovery.json")


@contextlib.contextmanager
def ray_instance(num_cpus: int = 2, metrics_report_interval_ms: int = 1000, namespace: str = "metrics") -> Iterator[RayInstance]:
    """`ray.init` of a fresh local instance with the dashboard on (it writes the discovery file);
    on exit Serve (if started) and Ray are shut down and leftover processes of this instance killed."""
    import psutil
    import ray

    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # Ray's own traffic on loopback
    if ray.is_initialized():
        ray.shutdown()
    temp_dir = tempfile.mkdtemp(prefix="raym", dir="/tmp")  # short: Ray's socket paths live under it
    env_keys = ("DASHBOARD_METRIC_PORT", "AUTOSCALER_METRIC_PORT")
    env_before = {k: os.environ.get(k) for k in env_keys}
    os.environ.update({k: str(free_port()) for k in env_keys})
    try:
        ray.init(address="local", num_cpus=num_cpus, include_dashboard=True, dashboard_host="127.0.0.1",
                 dashboard_port=free_port(), _metrics_export_port=free_port(), _temp_dir=temp_dir,
                 _system_config={"metrics_report_interval_ms": metrics_report_interval_ms},
                 log_to_driver=False, namespace=namespace)
        yield RayInstance(temp_dir)
    finally:
        from ray import serve

        with contextlib.suppress(Exception):
            serve.shutdown()
        ray.shutdown()
        for proc in psutil.process_iter(["pid", "cmdline"]):  # only this instance's (named by its temp dir)
            with contextlib.suppress(psutil.Error):
                if proc.pid != os.getpid() and any(temp_dir in part for part in (proc.info["cmdline"] or [])):
                    proc.kill()
        shutil.rmtree(temp_dir, ignore_errors=True)
        for key, value in env_before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def prometheus_config(sd_file: str, scrape_interval: str = "2s", evaluation_interval: str = "1s") -> dict:
    """deploy/prometheus/prometheus.yml pointed at `sd_file`, rules by absolute path, faster intervals."""
    config = yaml.safe_load((PROMETHEUS_DIR / "prometheus.yml").read_text())
    config["global"].update(scrape_interval=scrape_interval, scrape_timeout=scrape_interval,
                            evaluation_interval=evaluation_interval)
    config["rule_files"] = [str(PROMETHEUS_DIR / f) for f in config["rule_files"]]
    (job,) = config["scrape_configs"]
    job["file_sd_configs"][0].update(files=[sd_file], refresh_interval="1s")
    return config


@contextlib.contextmanager
def prometheus_server(config: dict, work_dir: str | Path | None = None, port: int = 0,
                      ready_timeout_s: float = 60.0) -> Iterator[PrometheusAPI]:
    """Debian's `prometheus` on 127.0.0.1 with `config`; terminated on exit."""
    exe = shutil.which("prometheus")
    if exe is None:
        raise RuntimeError("prometheus not found: run `make system-deps` (Debian's prometheus package)")
    own_dir = work_dir is None
    work = Path(work_dir or tempfile.mkdtemp(prefix="prometheus"))
    work.mkdir(parents=True, exist_ok=True)
    (work / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = port or free_port()
    log_path = work / "prometheus.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen([exe, f"--config.file={work / 'prometheus.yml'}", f"--storage.tsdb.path={work / 'data'}",
                                 f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
                                stdout=log, stderr=subprocess.STDOUT)
    api = PrometheusAPI(f"http://127.0.0.1:{port}", timeout_s=20)
    try:
        deadline = time.monotonic() + ready_timeout_s
        while not api.ready():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"Prometheus did not start:\n{log_path.read_text()[-3000:]}")
            time.sleep(0.3)
        yield api
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
        if own_dir:
            shutil.rmtree(work, ignore_errors=True)
