"""`serve deploy` onto a real 2-node Ray cluster on this machine, then lose a node under load.

Two raylets on 127.0.0.1 (tests/router/ray_helpers.TwoNodeCluster: a head running Ray's dashboard and
a worker node, 1 CPU each). The app is configs/local.yaml, deployed with the `serve` CLI against the
head's dashboard address exactly as against a remote cluster, with test-sized overrides: one LLMServer
replica per node (`max_replicas_per_node: 1`), the KV-aware router, and the ingress pinned to the head
(a `deployments` override in the Serve config) so that losing the worker node loses one LLMServer
replica and nothing else (in production: `ingress_num_replicas` >= 2 and a proxy on every node).

1. Both replicas run, one per node, and requests through the router succeed.
2. Bounded closed-loop load (a few clients, short requests, each retried on 503 + Retry-After as an
   OpenAI client does): midway, the worker node dies (its raylet and every process under it get
   SIGKILL). Every request is still answered; the only errors on the way are the retriable 503s of
   requests that were on the lost replica; the head's replica serves what follows.
3. The worker node comes back (`ray start` again, a new node): Serve places the missing replica there
   and both replicas serve again.

Teardown ends this cluster's processes only (found by its private temp dir; the replicas end with
their raylets): `ray stop --force` would also end the other Ray instances on the machine.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
import yaml

from tests.replica_probe import FACTORY, PROBE_DIR_ENV
from tests.router.ray_helpers import REPO, TwoNodeCluster, served_by, wait_for
from tests.serving.conftest import APP_NAME, MODEL_NAME, free_port

pytestmark = pytest.mark.timeout(480)

SERVE = Path(sys.executable).parent / "serve"
HEAD_RESOURCE, WORKER_RESOURCE = TwoNodeCluster.NODE_RESOURCES
NUM_CLIENTS = 3
KILL_AFTER_S = 8.0  # load before the worker node dies
LOAD_AFTER_KILL_S = 15.0  # load after it died
MAX_ATTEMPTS = 6  # per request: the first try + retries after 503 (Retry-After)


def deploy_config(model_dir: str, http_port: int) -> dict[str, Any]:
    """configs/local.yaml with test-sized overrides (see the module docstring)."""
    shipped = yaml.safe_load((REPO / "configs" / "local.yaml").read_text())
    (app,) = shipped["applications"]
    engine = {k: v for k, v in app["args"]["engine"].items() if k != "kv_cache_memory_gib"}
    engine.update(num_blocks=256, max_num_seqs=16)
    args = {**app["args"], "model": model_dir, "num_replicas": 2, "max_replicas_per_node": 1, "router": "kv_aware",
            "torch_num_threads": 1, "max_ongoing_requests": 16, "request_routing_stats_period_s": 0.2,
            "health_check_period_s": 1.0, "api_key_env": "", "stat_logger_factories": [FACTORY], "engine": engine}
    ingress = {"name": "OpenAIIngress", "ray_actor_options": {"num_cpus": 0.1, "resources": {HEAD_RESOURCE: 0.01}}}
    return {**shipped, "proxy_location": "HeadOnly", "http_options": {"host": "127.0.0.1", "port": http_port},
            "applications": [{**app, "name": APP_NAME, "args": args, "deployments": [ingress]}]}


def serve_cli(cluster: TwoNodeCluster, *args: str, timeout_s: float = 120) -> str:
    done = subprocess.run([str(SERVE), *args, "-a", cluster.dashboard_address], env=cluster.env, cwd=REPO,
                          capture_output=True, text=True, timeout=timeout_s)
    assert done.returncode == 0, f"serve {args[0]} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done.stdout


def serve_details(cluster: TwoNodeCluster) -> dict[str, Any]:
    """Serve's REST API on the dashboard (what `serve status` reads), with this cluster's token."""
    response = httpx.get(f"{cluster.dashboard_address}/api/serve/applications/", timeout=10,
                         headers={"Authorization": f"Bearer {cluster.env['RAY_AUTH_TOKEN']}"})
    response.raise_for_status()
    return response.json()


def app_details(cluster: TwoNodeCluster) -> dict[str, Any]:
    """The app's entry in Serve's details; {} while it does not exist or the dashboard is busy."""
    try:
        return (serve_details(cluster).get("applications") or {}).get(APP_NAME) or {}
    except httpx.HTTPError:
        return {}


def running_llm_replicas(cluster: TwoNodeCluster) -> list[dict[str, Any]]:
    replicas = ((app_details(cluster).get("deployments") or {}).get("LLMServer") or {}).get("replicas") or []
    return [r for r in replicas if r["state"] == "RUNNING"]


def replicas_on_two_nodes(cluster: TwoNodeCluster, exclude_node: str = "") -> list[dict[str, Any]] | None:
    replicas = running_llm_replicas(cluster)
    nodes = {r["node_id"] for r in replicas}
    return replicas if len(replicas) == 2 and len(nodes) == 2 and exclude_node not in nodes else None


def kill_node_of(replica: dict[str, Any]) -> list[int]:
    """SIGKILL the raylet that runs this replica and every process under it (a node crash)."""
    raylet = next(p for p in psutil.Process(replica["pid"]).parents() if p.name() == "raylet")
    victims = [raylet, *raylet.children(recursive=True)]
    for proc in victims:
        with contextlib.suppress(psutil.Error):
            proc.send_signal(signal.SIGKILL)
    _, alive = psutil.wait_procs(victims, timeout=15)
    assert not alive, f"still alive after SIGKILL: {alive}"
    return [p.pid for p in victims]


@dataclass
class Outcome:
    started: float
    finished: float = 0.0
    statuses: list[Any] = field(default_factory=list)  # HTTP status or exception name, per attempt
    request_id: str = ""  # engine request id of the answered attempt

    @property
    def ok(self) -> bool:
        return bool(self.statuses) and self.statuses[-1] == 200


async def one_request(client: httpx.AsyncClient, base_url: str, prompt: list[int]) -> Outcome:
    """A short completion, retried on 503 (after Retry-After) or a dropped connection."""
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    outcome = Outcome(started=time.monotonic())
    for _ in range(MAX_ATTEMPTS):
        try:
            response = await client.post(f"{base_url}/v1/completions", json=body)
        except httpx.TransportError as exc:
            outcome.statuses.append(type(exc).__name__)
            await asyncio.sleep(1.0)
            continue
        outcome.statuses.append(response.status_code)
        if response.status_code == 200:
            outcome.request_id = f"{response.json()['id']}-0-0"
            break
        if response.status_code != 503:
            break
        await asyncio.sleep(float(response.headers.get("Retry-After", "1")))
    outcome.finished = time.monotonic()
    return outcome


def run_requests(base_url: str, num: int, seed: int) -> list[Outcome]:
    """`num` requests at once."""
    rng = random.Random(seed)

    async def main() -> list[Outcome]:
        async with httpx.AsyncClient(timeout=120) as client:
            prompts = [[rng.randrange(1000, 40000) for _ in range(24)] for _ in range(num)]
            return list(await asyncio.gather(*(one_request(client, base_url, p) for p in prompts)))

    return asyncio.run(main())


class ClosedLoopLoad(threading.Thread):
    """NUM_CLIENTS clients, each sending its next request when the previous one is answered, until
    `stop()`; then every request in flight completes (bounded by MAX_ATTEMPTS and the client timeout)."""

    def __init__(self, base_url: str) -> None:
        super().__init__(daemon=True)
        self.base_url = base_url
        self.outcomes: list[Outcome] = []
        self._stopping = threading.Event()
        self._rng = random.Random(7)

    def stop(self) -> list[Outcome]:
        self._stopping.set()
        self.join(timeout=180)
        assert not self.is_alive(), "the load did not finish"
        return sorted(self.outcomes, key=lambda o: o.started)

    def run(self) -> None:
        async def client_loop(client: httpx.AsyncClient) -> None:
            while not self._stopping.is_set():
                prompt = [self._rng.randrange(1000, 40000) for _ in range(24)]
                self.outcomes.append(await one_request(client, self.base_url, prompt))

        async def main() -> None:
            async with httpx.AsyncClient(timeout=60) as client:
                await asyncio.gather(*(client_loop(client) for _ in range(NUM_CLIENTS)))

        asyncio.run(main())


def test_serve_deploy_on_two_nodes_survives_losing_a_node(model_dir, tmp_path):
    probe_dir = tmp_path / "probes"
    config_path = tmp_path / "serve-two-nodes.yaml"
    http_port = free_port()
    base_url = f"http://127.0.0.1:{http_port}"
    config_path.write_text(yaml.safe_dump(deploy_config(model_dir, http_port), sort_keys=False))
    cluster = TwoNodeCluster(dashboard_port=free_port(), env={
        PROBE_DIR_ENV: str(probe_dir), "PYTHONPATH": str(REPO),  # replicas import tests.replica_probe
        # the GCS declares a node whose raylet is gone dead after ~5 s (default ~15 s); a live raylet
        # slowed by a busy machine still has 5 s per check, so the head is never declared dead
        "RAY_health_check_period_ms": "1000", "RAY_health_check_timeout_ms": "5000",
        "RAY_health_check_failure_threshold": "5"})
    started = time.monotonic()
    passed = False
    try:
        cluster.start()
        print(f"\n[deploy] 2-node cluster up in {time.monotonic() - started:.1f} s; dashboard {cluster.dashboard_address}")

        # 1. serve deploy against the dashboard address; one LLMServer replica per node
        serve_cli(cluster, "deploy", str(config_path))
        replicas = wait_for(lambda: replicas_on_two_nodes(cluster), 240, interval_s=1.0,
                            message="2 RUNNING LLMServer replicas on 2 nodes")
        wait_for(lambda: app_details(cluster).get("status") == "RUNNING", 60, interval_s=1.0, message="the app RUNNING")
        details = serve_details(cluster)
        head_node = details["controller_info"]["node_id"]
        ingress = details["applications"][APP_NAME]["deployments"]["OpenAIIngress"]["replicas"]
        assert {r["node_id"] for r in ingress} == {head_node}, "the ingress override pins it to the head"
        on_head = next(r for r in replicas if r["node_id"] == head_node)
        on_worker = next(r for r in replicas if r["node_id"] != head_node)
        print(f"[deploy] app RUNNING {time.monotonic() - started:.1f} s after start "
              f"(LLMServer on head {on_head['replica_id']}, on worker {on_worker['replica_id']})")
        warmup = run_requests(base_url, 6, seed=1)
        assert all(o.statuses == [200] for o in warmup), [o.statuses for o in warmup]

        # 2. bounded load; the worker node dies midway
        load = ClosedLoopLoad(base_url)
        load.start()
        time.sleep(KILL_AFTER_S)
        killed_at = time.monotonic()
        killed = kill_node_of(on_worker)
        print(f"[deploy] killed the worker node ({len(killed)} processes) at t={killed_at - started:.1f} s")
        time.sleep(LOAD_AFTER_KILL_S)
        outcomes = load.stop()

        served = served_by(probe_dir, [o.request_id for o in outcomes if o.ok])
        before = [o for o in outcomes if o.finished < killed_at]
        after = [o for o in outcomes if o.started > killed_at + 5.0]  # the loss is known by then
        retried = [o for o in outcomes if len(o.statuses) > 1]
        print(f"[deploy] load: {len(outcomes)} requests ({len(before)} done before the kill, {len(after)} started "
              f">5 s after it), {len(retried)} retried: {[o.statuses for o in retried]}")
        assert all(o.ok for o in outcomes), f"unanswered: {[o.statuses for o in outcomes if not o.ok]}"
        assert all(set(o.statuses) <= {200, 503} for o in outcomes), "only retriable 503s on the way"
        assert {served.get(o.request_id) for o in before} == {on_head["replica_id"], on_worker["replica_id"]}, \
            "before the kill both nodes served the load"
        assert len(after) >= 3 and all(served.get(o.request_id) == on_head["replica_id"] for o in after), \
            "after the loss the head's replica serves"

        # 3. the node comes back; Serve puts the missing replica there
        recovering = time.monotonic()
        cluster.start_worker()
        replicas = wait_for(lambda: replicas_on_two_nodes(cluster, exclude_node=on_worker["node_id"]), 240,
                            interval_s=1.0, message="2 RUNNING LLMServer replicas again, one on the new node")
        new = next(r for r in replicas if r["node_id"] != head_node)
        print(f"[deploy] replica {new['replica_id']} RUNNING on the new node {time.monotonic() - recovering:.1f} s "
              "after it started")
        for seed in range(3):
            burst = run_requests(base_url, 6, seed=10 + seed)
            assert all(o.statuses == [200] for o in burst), [o.statuses for o in burst]
            served = served_by(probe_dir, [o.request_id for o in burst])
            if any(served.get(o.request_id) == new["replica_id"] for o in burst):
                break
        else:
            pytest.fail("the replica on the restarted node served none of 18 requests")
        print(f"[deploy] recovered; whole test {time.monotonic() - started:.1f} s")
        passed = True
    finally:
        if not passed:  # keep Ray's and Serve's logs of a failed run
            with contextlib.suppress(Exception):
                shutil.copytree(Path(cluster.temp_dir) / "session_latest" / "logs", tmp_path / "ray-logs",
                                ignore_dangling_symlinks=True)
                print(f"[deploy] Ray logs kept in {tmp_path / 'ray-logs'}")
        cluster.stop()  # every process of this cluster (replicas end with their raylet)
