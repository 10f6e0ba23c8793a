"""Servers under test and their lifecycle: a private Ray with Serve on 127.0.0.1 and our app deployed in it, or a
server process (vLLM's OpenAI server); started, waited for, torn down.

    with ray_started("bench-x"), serve_http() as base_url, deployed(config_args(), "x") as app: ...
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from serve_app.metrics.local_stack import free_port
from serve_app.serving.config import WORKER_NICENESS_ENV

REPO = Path(__file__).resolve().parents[1]
MODEL = REPO / "models" / "smollm2-135m-instruct"


def config_args(config: str = "configs/local.yaml", **overrides: Any) -> dict[str, Any]:
    """The first application's args of a Serve config, with no API key and the model as an absolute path."""
    import yaml

    from serve_app.serving.app import resolve_model_path

    args = dict(yaml.safe_load((REPO / config).read_text())["applications"][0]["args"])
    return {**args, "model": resolve_model_path(args["model"]), "api_key_env": "", **overrides}


@contextlib.contextmanager
def ray_started(namespace: str, env: dict[str, str] | None = None) -> Iterator[None]:
    """A local Ray whose processes see `env` (read when a process starts) and this checkout first (replicas import
    `loadtest` and `serve_app` from it); then Serve and Ray stop, the environment and HAProxy's directory are undone."""
    saved = dict(os.environ)
    # Ray's own traffic on loopback; its workers at normal priority as `make serve` starts them (unless this
    # process's environment names another niceness)
    os.environ.update({"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", WORKER_NICENESS_ENV: os.environ.get(WORKER_NICENESS_ENV, "0"),
                       **(env or {})})
    import ray  # (after the environment: Serve reads some of it when first imported)

    from tests.ray_start import init_local_ray

    try:
        init_local_ray(include_dashboard=False, log_to_driver=False, namespace=namespace,
                       runtime_env={"env_vars": {"PYTHONPATH": str(REPO)}})
        yield
    finally:
        with contextlib.suppress(Exception):
            from ray import serve

            serve.shutdown()
        ray.shutdown()
        os.environ.clear()
        os.environ.update(saved)
        from serve_app.serving.haproxy_env import STATE_DIR

        if STATE_DIR in (env or {}):  # HAProxy's files (serving.haproxy_env: the caller removes them)
            shutil.rmtree(env[STATE_DIR], ignore_errors=True)


@contextlib.contextmanager
def probed(namespace: str) -> Iterator[Path]:
    """A private Ray with Serve's HTTP proxy whose replicas, deployed with tests/replica_probe.py's `FACTORY` in
    `stat_logger_factories`, write their engine facts into the directory yielded (removed at the end)."""
    from tests.replica_probe import PROBE_DIR_ENV

    with (tempfile.TemporaryDirectory(prefix=f"{namespace}-probes-", ignore_cleanup_errors=True) as probe_dir,
          ray_started(namespace, {PROBE_DIR_ENV: probe_dir}), serve_http()):
        yield Path(probe_dir)


@contextlib.contextmanager
def serve_http() -> Iterator[str]:
    """Serve's HTTP proxy on a free loopback port; yields its base URL."""
    from ray import serve

    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        with contextlib.suppress(Exception):
            serve.shutdown()


@dataclass(frozen=True)
class App:
    name: str
    handle: Any  # the LLMServer deployment's handle (it routes with the app's router, as the ingress's does)
    startup_s: float


@contextlib.contextmanager
def deployed(args: dict[str, Any], name: str) -> Iterator[App]:
    """Our app from `args` deployed as `name` at "/" (under HAProxy: once it routes to the ingress), until the block ends."""
    from ray import serve

    from serve_app.serving.app import build_app
    from serve_app.serving.haproxy_env import HAPROXY, STATE_DIR, wait_for_haproxy

    started = time.monotonic()
    serve.run(build_app(args), name=name, route_prefix="/")
    try:
        if os.environ.get(HAPROXY) == "1":
            wait_for_haproxy(Path(os.environ[STATE_DIR]))
        yield App(name, serve.get_deployment_handle("LLMServer", app_name=name), time.monotonic() - started)
    finally:
        with contextlib.suppress(Exception):
            serve.delete(name)


def serve_replicas(app: str, deployment: str = "LLMServer") -> dict[str, Any]:
    """The live replica actors of a Serve deployment in the connected Ray cluster, by replica id."""
    import ray

    prefix, out = f"SERVE_REPLICA::{app}#{deployment}#", {}
    for entry in ray.util.list_named_actors(all_namespaces=True):
        if entry["name"].startswith(prefix):
            with contextlib.suppress(ValueError):  # it died since it was listed
                out[entry["name"].removeprefix(prefix)] = ray.get_actor(entry["name"], namespace="serve")
    return out


def routing_stats(app: str) -> dict[str, dict[str, Any]]:
    """What each LLMServer replica of `app` publishes for routing right now, by replica id."""
    import ray

    refs = {rid: actor.record_routing_stats.remote() for rid, actor in serve_replicas(app).items()}
    return {rid: ray.get(ref, timeout=30) for rid, ref in refs.items()}


def wait_idle(app: str, timeout_s: float = 120.0) -> None:
    """Until every replica runs nothing, queues nothing and has every KV block free (blocks held by the
    prefix cache count as free)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        stats = routing_stats(app).values()
        if stats and all(s["num_running"] == s["num_waiting"] == 0 and s["num_free_blocks"] == s["num_total_blocks"] for s in stats):
            return
        time.sleep(0.5)
    raise RuntimeError(f"{app}: replicas not idle after {timeout_s:.0f} s")


def wait_ready(url: str, proc: subprocess.Popen | None = None, timeout_s: float = 600.0) -> float:
    """Seconds until GET `url` answers 200; raises if `proc` exits first or time runs out."""
    import httpx

    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode} before answering")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url, timeout=5).status_code == 200:
                return time.monotonic() - started
        time.sleep(1)
    raise RuntimeError(f"{url} did not answer within {timeout_s:.0f} s")


@contextlib.contextmanager
def server_process(cmd: list[str], ready_url: str, env: dict[str, str] | None = None) -> Iterator[subprocess.Popen]:
    """A server process (its output discarded), ready when GET `ready_url` answers; terminated at the end."""
    proc = subprocess.Popen(cmd, env={**os.environ, **(env or {})}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_ready(ready_url, proc)
        yield proc
    finally:
        proc.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(60)
        if proc.poll() is None:
            proc.kill()
