"""Helpers for the router tests on a real Ray: app args, a Serve app context, requests that bypass the
router (to preload one replica), HTTP clients, and a two-node Ray cluster on one machine.

Everything stays on 127.0.0.1. The two-node cluster is two raylets started with `ray start` (a head,
then a worker joining it), each with its own custom resource, all bound to the loopback address:
`ray start` refuses a multi-node cluster in loopback mode (RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0) and
turns `--node-ip-address=127.0.0.1` into the machine's public address otherwise, so the worker is
started through a small launcher that lifts exactly those two checks in its own process. Teardown
ends only this cluster's processes (found by its private temp dir), never other Ray instances on the
machine (`ray stop --force` would end them all).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import pickle
import random
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil

from loadtest.server import serve_replicas
from tests.polling import wait_for  # noqa: F401 (also re-exported to test modules)
from tests.replica_probe import FACTORY, PROBE_DIR_ENV, read_probes, where
from tests.serving.conftest import APP_NAME, MODEL_DIR, MODEL_NAME, free_port

REPO = Path(__file__).resolve().parents[2]
RAY = Path(sys.executable).parent / "ray"

_WORKER_LAUNCHER = """
import sys
import ray._private.ray_constants as ray_constants
import ray._private.services as services
ray_constants.ENABLE_RAY_CLUSTER = True          # allow joining a cluster while in loopback mode
services.resolve_ip_for_localhost = lambda h: h  # keep --node-ip-address=127.0.0.1 as given
from ray.scripts.scripts import main
sys.argv = ["ray", *sys.argv[1:]]
main()
"""


def router_app_args(**overrides: Any) -> dict[str, Any]:
    """Two small CPU replicas (one torch thread each), KV-aware router, fresh stats, probe logger."""
    engine = {"dtype": "bfloat16", "num_blocks": 256, "max_num_seqs": 16}
    engine.update(overrides.pop("engine", {}))
    args: dict[str, Any] = {
        "model": str(MODEL_DIR), "num_replicas": 2, "num_cpus_per_replica": 0.5, "torch_num_threads": 1,
        "max_ongoing_requests": 32, "request_routing_stats_period_s": 0.2, "health_check_period_s": 2.0,
        "router": "kv_aware", "api_key_env": "", "engine": engine, "stat_logger_factories": [FACTORY],
    }
    args.update(overrides)
    return args


@contextlib.contextmanager
def serve_app(args: dict[str, Any]) -> Iterator[str]:
    """Serve (proxy on the head node only, 127.0.0.1:<free port>) running the app; yields its base URL."""
    from ray import serve

    from serve_app.serving.app import build_app

    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port}, proxy_location="HeadOnly")
    try:
        serve.run(build_app(args), name=APP_NAME, route_prefix="/")
        yield f"http://127.0.0.1:{port}"
    finally:
        with contextlib.suppress(Exception):
            serve.delete(APP_NAME)
        serve.shutdown()


def llm_replicas() -> dict[str, Any]:
    """LLMServer replica actors by replica unique id."""
    return serve_replicas(APP_NAME)


def published_stats(replicas: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Each replica's `record_routing_stats()` now."""
    import ray

    refs = {rid: actor.record_routing_stats.remote() for rid, actor in replicas.items()}
    return {rid: ray.get(ref, timeout=10) for rid, ref in refs.items()}


def random_ids(n: int, rng: random.Random) -> list[int]:
    return [rng.randrange(1000, 40000) for _ in range(n)]


def send_direct(actor: Any, request_id: str, prompt: list[int], max_tokens: int) -> Any:
    """Run `LLMServer.generate` on this replica without going through any router (the way a
    DeploymentHandle's transport calls it). Returns the streaming generator (cancel it to abort)."""
    from ray.serve._private.common import RequestMetadata

    from serve_app.types import GenerateRequest, SamplingParams

    request = GenerateRequest(request_id, prompt=prompt,
                              sampling_params=SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    meta = RequestMetadata(request_id=request_id, internal_request_id=request_id, call_method="generate",
                           is_streaming=True, app_name=APP_NAME)
    return actor.handle_request_streaming.options(num_returns="streaming").remote(pickle.dumps(meta), request)


async def complete(client: Any, base_url: str, prompt: list[int], max_tokens: int) -> str:
    """POST /v1/completions; returns the engine request id (`<response id>-0-0`)."""
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    response = await client.post(f"{base_url}/v1/completions", json=body)
    response.raise_for_status()
    return f"{response.json()['id']}-0-0"


def send_waves(base_url: str, prompts: list[list[int]], max_tokens: int, wave: int) -> list[str]:
    """Send the prompts `wave` at a time (each wave concurrently); engine request ids in order."""
    import httpx

    async def main() -> list[str]:
        ids: list[str] = []
        async with httpx.AsyncClient(timeout=120) as client:
            for start in range(0, len(prompts), wave):
                batch = prompts[start:start + wave]
                ids += await asyncio.gather(*(complete(client, base_url, p, max_tokens) for p in batch))
        return ids

    return asyncio.run(main())


def served_by(probe_dir: Path, request_ids: list[str], timeout_s: float = 10.0) -> dict[str, str]:
    """engine request id → replica id, from the replicas' probe files (waits until all appear)."""
    deadline = time.monotonic() + timeout_s
    while True:
        located = where(read_probes(probe_dir))
        found = {rid: located[rid] for rid in request_ids if rid in located}
        if len(found) == len(request_ids) or time.monotonic() > deadline:
            return found
        time.sleep(0.2)




def cancel_all(generators: list[Any]) -> None:
    import ray

    for gen in generators:
        with contextlib.suppress(Exception):
            ray.cancel(gen)


def shorts_after_preload(base_url: str, replicas: dict[str, Any], loaded: str, other: str, probe_dir: Path,
                         rng: random.Random, num_short: int) -> tuple[dict, dict, dict[str, str]]:
    """Preload `loaded` with two long requests (900-token prompts) and `other` with two thin ones, both
    sent to the replicas directly (no router); once all four run and the router holds a sample of it,
    send `num_short` short requests through the HTTP API, 4 at a time. Returns the published stats
    before and after the short requests, and which replica served each of them."""
    preload = [send_direct(replicas[loaded], f"long-{i}", random_ids(900, rng), 600) for i in range(2)]
    preload += [send_direct(replicas[other], f"thin-{i}", random_ids(16, rng), 600) for i in range(2)]
    try:
        def both_loaded():
            stats = published_stats(replicas)
            ok = stats[loaded]["kv_cache_usage"] >= 0.4 and stats[loaded]["num_running"] == 2 \
                and stats[other]["num_running"] == 2
            return stats if ok else None

        before = wait_for(both_loaded, 90, message="the preloaded requests running")
        time.sleep(1.0)  # > 2 routing-stats periods (0.2 s): the router holds a sample with that load
        ids = send_waves(base_url, [random_ids(24, rng) for _ in range(num_short)], max_tokens=4, wave=4)
        after = published_stats(replicas)
    finally:
        cancel_all(preload)
    return before, after, served_by(probe_dir, ids)


def refresh_ray_settings() -> None:
    """Make this process's Ray follow the current environment again: Ray reads its settings when it is
    imported, maybe before a test set them. Loopback mode (else ray.init turns 127.0.0.1 into the
    machine's public address), then the auth mode and token (refreshed the way Ray's own token setup
    does it)."""
    import ray._private.ray_constants as ray_constants
    from ray._raylet import AuthenticationTokenLoader, Config

    ray_constants.ENABLE_RAY_CLUSTER = os.environ.get("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "1") != "0"
    Config.initialize("")
    AuthenticationTokenLoader.instance().reset_cache()


# ---- processes of one Ray instance ------------------------------------------------------------------
def processes_of(marker: str) -> list[psutil.Process]:
    """Processes whose command line names `marker` (this cluster's private temp dir)."""
    procs = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        with contextlib.suppress(psutil.Error):
            if p.pid != os.getpid() and any(marker in part for part in (p.info["cmdline"] or [])):
                procs.append(p)
    return procs


def end_processes(marker: str, grace_s: float = 10.0) -> int:
    """SIGTERM, then after `grace_s` SIGKILL, every process of that Ray instance; returns how many."""
    procs = processes_of(marker)
    for p in procs:
        with contextlib.suppress(psutil.Error):
            p.terminate()
    _, alive = psutil.wait_procs(procs, timeout=grace_s)
    for p in alive:
        with contextlib.suppress(psutil.Error):
            p.kill()
    psutil.wait_procs(alive, timeout=5)
    return len(procs)


class TwoNodeCluster:
    """A Ray head and one worker node on this machine, each with 1 CPU and its own custom resource."""

    NODE_RESOURCES = ("router_test_head", "router_test_worker")

    def __init__(self, env: dict[str, str] | None = None, dashboard_port: int = 0) -> None:
        self.temp_dir = tempfile.mkdtemp(prefix="rayroute", dir="/tmp")  # short: Ray's socket paths live under it
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        # > 0: the head runs Ray's dashboard on 127.0.0.1:<dashboard_port> (Serve's REST API, `serve deploy`)
        self.dashboard_port = dashboard_port
        # a private auth token for this cluster (Ray enables token auth by default)
        self.env = {**os.environ, **(env or {}), "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
                    "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(16)}
        self._common = ["--node-ip-address=127.0.0.1", "--num-cpus=1", f"--temp-dir={self.temp_dir}", "--disable-usage-stats"]

    @property
    def dashboard_address(self) -> str:
        return f"http://127.0.0.1:{self.dashboard_port}"

    def start(self) -> None:
        dashboard = (["--include-dashboard=true", "--dashboard-host=127.0.0.1", f"--dashboard-port={self.dashboard_port}"]
                     if self.dashboard_port
                     else ["--include-dashboard=false"])
        self._run([str(RAY), "start", "--head", f"--port={self.port}", *dashboard,
                   f"--resources={json.dumps({self.NODE_RESOURCES[0]: 1})}", *self._common])
        self.start_worker()

    def start_worker(self) -> None:
        """Start the worker node (again, after it was killed: it joins as a new node)."""
        self._run([sys.executable, "-c", _WORKER_LAUNCHER, "start", f"--address={self.address}",
                   f"--resources={json.dumps({self.NODE_RESOURCES[1]: 1})}", *self._common])

    def _run(self, cmd: list[str]) -> None:
        done = subprocess.run(cmd, env=self.env, cwd=REPO, capture_output=True, text=True, timeout=180)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd[:3])} failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")

    def connect(self) -> Any:
        """ray.init in this process against the cluster (the caller sets this cluster's auth
        environment, `self.env`, in this process first)."""
        import ray

        refresh_ray_settings()
        ray.init(address=self.address, log_to_driver=False, namespace="router-multinode")
        wait_for(lambda: sum(n["Alive"] for n in ray.nodes()) == 2, 60, message="2 live nodes")
        return ray

    def node_of_resource(self) -> dict[str, str]:
        """custom resource name → node id."""
        import ray

        out = {}
        for node in ray.nodes():
            for name in self.NODE_RESOURCES:
                if node["Alive"] and name in node["Resources"]:
                    out[name] = node["NodeID"]
        return out

    def stop(self) -> int:
        """End this cluster's processes; returns how many there were."""
        num = end_processes(self.temp_dir)
        shutil.rmtree(self.temp_dir, ignore_errors=True)
        return num


__all__ = ["PROBE_DIR_ENV", "TwoNodeCluster", "cancel_all", "end_processes", "llm_replicas", "published_stats",
           "random_ids", "read_probes", "router_app_args", "send_direct", "send_waves", "serve_app", "served_by",
           "wait_for"]
