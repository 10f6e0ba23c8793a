"""Replica failures under load, 2 LLMServer replicas streaming:
- kill one replica's actor: the other replica's requests finish, the killed replica's requests end
  with an error event (no hang), Serve brings a new replica up, and new requests succeed;
- kill one replica's *engine loop* (injected through the stat-logger hook): its requests fail with
  an engine error, the replica leaves the routing at once (requests sent right after the death all
  succeed on the other replica), Serve replaces it, the other replica keeps serving;
- hang one replica's engine step (thread alive, no step finishes): its health check fails after
  `engine_stall_timeout_s`, Serve replaces it, its clients get an error, the other keeps serving.
Each with and without stream multiplexing (there the deltas travel apart from the failing call), and
with each engine in a process of its own (`core_process`: the stat-logger faults then act in the
replica, on the thread that replays the engine's stats), where also:
- kill one replica's engine process (as the kernel's OOM killer would): its requests end with an
  engine error at once, the replica leaves the routing, Serve replaces it, the other keeps serving."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import ray
from ray import serve

from tests.serving.conftest import (
    APP_NAME,
    MODEL_NAME,
    app_args,
    replica_actors,
    replica_stats,
    serve_app,
    stream_completion,
    wait_for,
    wait_until_idle,
)
from tests.serving.faults import FAULT_FILE_ENV, HANG_PREFIX

# each test waits for Serve to start a replacement replica: ~30 s on a quiet machine, minutes on a loaded one
pytestmark = pytest.mark.startup(reason="waits for a replacement replica to start")

NUM_REQUESTS = 8
MAX_TOKENS = 48
# far above a real step of this small model, even on a loaded machine; a hung step passes it
STALL_TIMEOUT_S = 8.0


@pytest.fixture(scope="module", params=[(False, False), (True, False), (True, True)],
                ids=["per-stream", "multiplexed", "engine-process"])
def app(request, ray_cluster, model_dir):
    multiplexing, core_process = request.param
    args = app_args(num_replicas=2, max_ongoing_requests=16, health_check_period_s=1.0,
                    engine_stall_timeout_s=STALL_TIMEOUT_S, drain_timeout_s=3.0, stream_multiplexing=multiplexing,
                    stat_logger_factories=["tests.serving.faults:make_fault_logger"], engine={"core_process": core_process})
    trigger = Path(os.environ[FAULT_FILE_ENV])
    trigger.unlink(missing_ok=True)
    try:
        with serve_app(ray_cluster, args) as served:
            yield served
    finally:
        trigger.unlink(missing_ok=True)


async def stream_one(client: httpx.AsyncClient, i: int, progress: list[int] | None = None) -> dict:
    body = {"model": MODEL_NAME, "prompt": f"Story number {i}:", "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    return await stream_completion(client, body, None if progress is None else lambda n: progress.__setitem__(i, n))


def run_in_thread(coro_fn):
    """Run an asyncio workload in a background thread; returns (thread, results holder)."""
    holder: dict = {}

    def target():
        holder["results"] = asyncio.run(coro_fn())

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread, holder


def running_per_replica() -> dict[str, int]:
    return {name: s["num_running"] + s["num_waiting"] for name, s in replica_stats().items()}


@dataclass
class Load:
    """Streams running on both replicas: `victim` (the replica with fewer, ties by name) is the one to
    fail, `survivor` the other; `before`: the replicas before."""

    thread: threading.Thread
    holder: dict
    placed: dict[str, int]  # requests per replica
    before: set[str]

    @property
    def victim(self) -> str:
        return min(self.placed, key=lambda name: (self.placed[name], name))

    @property
    def survivor(self) -> str:
        return next(name for name in self.placed if name != self.victim)

    def outcomes(self, hung: str) -> tuple[list[dict], list[dict]]:
        """Once every stream ended (else fails with `hung`): (ok, failed), the survivor's requests
        all ok and the victim's all failed."""
        self.thread.join(timeout=180)
        assert not self.thread.is_alive(), hung
        results = self.holder["results"]
        ok = [r for r in results if r["error"] is None]
        failed = [r for r in results if r["error"] is not None]
        assert len(ok) == self.placed[self.survivor] and len(failed) == self.placed[self.victim], (self.placed, results)
        return ok, failed

    def wait_replaced(self, timeout_s: float = 300) -> None:
        """Serve runs 2 replicas again: the survivor and one new replica instead of the victim (a replica
        starts in ~30 s on a quiet machine, in over 100 s on a loaded one)."""

        def replaced():
            status = serve.status().applications[APP_NAME].deployments["LLMServer"]
            names = set(replica_actors())
            return status.replica_states.get("RUNNING", 0) == 2 and self.victim not in names and len(names) == 2 and names

        names = wait_for(replaced, timeout_s, interval_s=1.0, message=f"a replacement for {self.victim}")
        assert self.survivor in names and len(names - self.before) == 1


def load_both_replicas(app, num_requests: int) -> Load:
    """On idle replicas, start `num_requests` streams; return once all are streaming (a request that
    has not sent anything yet would be retried on the other replica, see test_api_unit), spread over
    both replicas."""
    wait_until_idle(2)
    before = set(replica_actors())
    assert len(before) == 2
    progress = [0] * num_requests

    async def load():
        async with httpx.AsyncClient(base_url=app.base_url, timeout=120) as client:
            tasks = []
            for i in range(num_requests):
                tasks.append(asyncio.create_task(stream_one(client, i, progress)))
                await asyncio.sleep(0.05)
            return await asyncio.gather(*tasks)

    thread, holder = run_in_thread(load)
    wait_for(lambda: min(progress) >= 2, 60, message="every stream started")

    def placed():
        counts = running_per_replica()
        return counts if sum(counts.values()) == num_requests else None

    placement = wait_for(placed, 10, message=f"{num_requests} requests running")
    assert all(n >= 1 for n in placement.values()), placement
    return Load(thread, holder, placement, before)


def serves_again(app) -> None:
    """Once the replicas are idle, new requests succeed."""
    wait_until_idle(2)
    with httpx.Client(base_url=app.base_url, timeout=60) as c:
        for _ in range(4):
            r = c.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "Hello", "max_tokens": 4})
            assert r.status_code == 200, r.text


def test_kill_replica_under_load(app):
    load = load_both_replicas(app, NUM_REQUESTS)
    ray.kill(replica_actors()[load.victim], no_restart=True)

    # the surviving replica's requests finish completely; the victim's end with an error event
    ok, failed = load.outcomes("requests hung after the replica died")
    for r in ok:
        assert r["status"] == 200 and r["done"] and r["finish_reason"] == "length" and r["tokens"] == MAX_TOKENS
    for r in failed:
        assert r["status"] == 200 and r["done"]  # the stream had started: error event, then [DONE]
        assert r["error"]["type"] == "server_error" and r["error"]["code"] == "replica_unavailable"
        assert set(r["error"]) == {"message", "type", "param", "code"}

    load.wait_replaced()  # Serve replaces the dead replica
    wait_until_idle(2)

    # and new requests succeed (on both replicas)
    async def after():
        async with httpx.AsyncClient(base_url=app.base_url, timeout=120) as client:
            return await asyncio.gather(*(stream_one(client, i) for i in range(6)))

    for r in asyncio.run(after()):
        assert r["status"] == 200 and r["error"] is None and r["tokens"] == MAX_TOKENS and r["done"]


def engine_dead(actor) -> bool:
    """The replica's health check fails (its engine died), or the replica is gone already."""
    try:
        ray.get(actor.check_health.remote(), timeout=10)
    except Exception:  # noqa: BLE001 - a dead engine, or the replica exited
        return True
    return False


def engine_pid(actor) -> int | None:
    """The pid of the replica's engine process (None: its engine steps in a thread)."""
    import psutil

    pid = ray.get(actor.__ray_call__.remote(lambda _: os.getpid()), timeout=10)
    children = [p for p in psutil.Process(pid).children() if "serve_app.engine.core_process" in " ".join(p.cmdline())]
    return children[0].pid if children else None


def all_served(app) -> None:
    """The dead replica left the routing at once: requests sent as soon as its engine is dead are served
    by the survivor (held, then retried), none answered 500 by the dead one."""
    with httpx.Client(base_url=app.base_url, timeout=60) as c:
        for _ in range(6):
            r = c.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "Hello", "max_tokens": 2})
            assert r.status_code == 200, r.text


def test_engine_death_fails_health_check_and_replica_is_replaced(app):
    load = load_both_replicas(app, 6)
    actors = replica_actors()
    trigger = Path(os.environ[FAULT_FILE_ENV])
    trigger.write_text(load.victim)  # the replica id: its engine loop dies at its next step
    try:
        wait_for(lambda: engine_dead(actors[load.victim]), 60, message="the victim's engine died")
        all_served(app)
        ok, failed = load.outcomes("requests hung after the engine died")
        for r in ok:
            assert r["done"] and r["tokens"] == MAX_TOKENS
        for r in failed:
            assert r["done"] and r["error"]["code"] == "engine_error" and r["error"]["type"] == "server_error"

        load.wait_replaced()  # its health check fails and Serve replaces it
    finally:
        trigger.unlink(missing_ok=True)
    serves_again(app)


def test_hung_engine_fails_health_check_and_replica_is_replaced(app):
    load = load_both_replicas(app, 6)
    trigger = Path(os.environ[FAULT_FILE_ENV])
    trigger.write_text(HANG_PREFIX + load.victim)  # its next step blocks, its thread stays alive
    try:
        load.wait_replaced()  # stalled past the bound: unhealthy, replaced
        ok, failed = load.outcomes("requests hung with the engine")
    finally:
        trigger.unlink(missing_ok=True)
    for r in ok:
        assert r["done"] and r["tokens"] == MAX_TOKENS
    for r in failed:  # the stream had started: an error event, then [DONE]
        assert r["done"] and r["error"]["type"] == "server_error" and set(r["error"]) == {"message", "type", "param", "code"}
    serves_again(app)


def test_a_killed_engine_process_fails_its_requests_and_the_replica_is_replaced(app):
    actors = replica_actors()
    if engine_pid(next(iter(actors.values()))) is None:
        pytest.skip("the engine steps in a thread of the replica here")
    load = load_both_replicas(app, 6)
    os.kill(engine_pid(actors[load.victim]), signal.SIGKILL)
    wait_for(lambda: engine_dead(actors[load.victim]), 30, message="the victim's health check to fail")
    all_served(app)
    ok, failed = load.outcomes("requests hung after the engine process was killed")
    for r in ok:
        assert r["done"] and r["tokens"] == MAX_TOKENS
    for r in failed:
        assert r["done"] and r["error"]["code"] == "engine_error"
    load.wait_replaced()
    serves_again(app)
    assert all(engine_pid(a) for a in replica_actors().values())  # the new replica has its engine process
