"""Serving fixtures: one real Ray cluster per test session (loopback only), one Serve app per module.

Every network call targets 127.0.0.1: Ray is told to use the loopback address for its own traffic
(`RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`), the Serve proxy binds 127.0.0.1 on a free port, and clients
use that URL. The cluster is shut down at the end of the session (and Serve after each module).
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from loadtest.server import serve_replicas
from serve_app.metrics.local_stack import free_port
from tests.polling import wait_for  # noqa: F401 (also re-exported to test modules)
from tests.ray_start import init_local_ray

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # before Ray starts: loopback only
# fault injection (tests/serving/faults.py): replicas inherit this environment from the driver
os.environ.setdefault("SERVE_APP_TEST_FAULT_FILE", str(Path(tempfile.gettempdir()) / f"serve_app_test_fault_{os.getpid()}"))
# the API key of apps deployed with `api_key_env=API_KEY_ENV`: ingress replicas read it from their own
# environment, inherited from the driver, so it must be set before Ray starts
API_KEY_ENV = "SERVE_APP_TEST_API_KEY"
API_KEY = os.environ.setdefault(API_KEY_ENV, "sk-test-3f9c1a")
AUTH = {"Authorization": f"Bearer {API_KEY}"}

REPO = Path(__file__).resolve().parents[2]
MODEL_DIR = REPO / "models" / "smollm2-135m-instruct"
MODEL_NAME = "smollm2-135m-instruct"
APP_NAME = "llm"


@pytest.fixture(scope="session")
def model_dir() -> str:
    if not (MODEL_DIR / "model.safetensors").is_file():
        pytest.fail(f"{MODEL_DIR} is missing: run `make model` (make test does it)")
    return str(MODEL_DIR)


@pytest.fixture(scope="session")
def ray_cluster():
    """A local Ray instance for the whole session (2 CPUs' worth of fractional replicas)."""
    import ray

    if ray.is_initialized():  # pragma: no cover - another fixture left one running
        ray.shutdown()
    init_local_ray(include_dashboard=False, log_to_driver=False, namespace="serving-tests")
    try:
        yield ray
    finally:
        from ray import serve

        with contextlib.suppress(Exception):
            serve.shutdown()
        ray.shutdown()


@dataclass(frozen=True)
class ServedApp:
    base_url: str  # http://127.0.0.1:<port>[<route prefix>]
    args: dict[str, Any]

    @property
    def api_url(self) -> str:
        return f"{self.base_url}/v1"


def app_args(**overrides: Any) -> dict[str, Any]:
    """Test-sized defaults: fp32 (greedy output comparable with the offline LLM), a small KV cache."""
    engine = {"dtype": "float32", "num_blocks": 256, "max_num_seqs": 32}
    engine.update(overrides.pop("engine", {}))
    args: dict[str, Any] = {
        "model": str(MODEL_DIR),
        "num_replicas": 2,
        "num_cpus_per_replica": 0.5,
        "max_ongoing_requests": 32,
        "request_routing_stats_period_s": 0.5,
        "health_check_period_s": 1.0,
        "api_key_env": "",
        "engine": engine,
    }
    args.update(overrides)
    return args


@contextlib.contextmanager
def serve_app(ray_cluster, args: dict[str, Any], route_prefix: str = "/") -> Iterator[ServedApp]:
    """Start Serve on a free loopback port, deploy the app under `route_prefix` and wait until it is RUNNING."""
    from ray import serve

    from serve_app.serving.app import build_app

    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        serve.run(build_app(args), name=APP_NAME, route_prefix=route_prefix)
        yield ServedApp(f"http://127.0.0.1:{port}{route_prefix.rstrip('/')}", args)
    finally:
        with contextlib.suppress(Exception):
            serve.delete(APP_NAME)
        serve.shutdown()


# ---- replica probes --------------------------------------------------------------------------------
def replica_actors(deployment: str = "LLMServer") -> dict[str, Any]:
    """The live replica actors of a deployment, by replica id."""
    return serve_replicas(APP_NAME, deployment)


def replica_stats(deployment: str = "LLMServer", timeout_s: float = 10.0) -> dict[str, dict[str, Any]]:
    """What each replica's `record_routing_stats` publishes right now (the controller's own call)."""
    import ray

    actors = replica_actors(deployment)
    refs = {name: a.record_routing_stats.remote() for name, a in actors.items()}
    return {name: ray.get(ref, timeout=timeout_s) for name, ref in refs.items()}




def wait_until_idle(num_replicas: int, timeout_s: float = 20.0) -> dict[str, dict[str, Any]]:
    """Every replica reports all KV blocks free and nothing running or waiting."""

    def idle():
        stats = replica_stats()
        ok = len(stats) == num_replicas and all(
            s["num_free_blocks"] == s["num_total_blocks"] and s["num_running"] == 0 and s["num_waiting"] == 0
            for s in stats.values()
        )
        return stats if ok else None

    return wait_for(idle, timeout_s, message="idle replicas")


# ---- clients of a module's `app` (each module deploys its own `app` fixture) ----------------------
@pytest.fixture(scope="module")
def http(app):
    """Raw HTTP to the module's app."""
    import httpx

    with httpx.Client(base_url=app.base_url, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def client(app):
    """The official `openai` client of the module's app."""
    return openai_client(app)


def small_chat(**fields) -> dict:
    """A two-token chat request body ("Hi")."""
    return {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, **fields}


async def stream_completion(client, body: dict, on_chunk: Callable[[int], None] | None = None) -> dict:
    """POST `body` to /v1/completions streamed (with usage) through an httpx.AsyncClient: the status,
    the text, the events with choices (`on_chunk(count)` after each), the finish reason, the final
    usage's completion tokens, the error (an error event's, or a non-200 answer's body) and whether
    the stream ended with [DONE]."""
    out = {"status": None, "text": "", "chunks": 0, "finish_reason": None, "tokens": None, "error": None, "done": False}
    async with client.stream("POST", "/v1/completions", json={**body, "stream": True, "stream_options": {"include_usage": True}}) as r:
        out["status"] = r.status_code
        if r.status_code != 200:
            out["error"] = json.loads(await r.aread())["error"]
            return out
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[len("data: "):]
            if data == "[DONE]":
                out["done"] = True
                break
            payload = json.loads(data)
            if "error" in payload:
                out["error"] = payload["error"]
                continue
            if payload["choices"]:
                out["chunks"] += 1
                if on_chunk is not None:
                    on_chunk(out["chunks"])
                out["text"] += payload["choices"][0]["text"]
                out["finish_reason"] = payload["choices"][0]["finish_reason"] or out["finish_reason"]
            if payload.get("usage"):
                out["tokens"] = payload["usage"]["completion_tokens"]
    return out


def openai_client(app: ServedApp, api_key: str = "unused", **kwargs):
    import openai

    return openai.OpenAI(base_url=app.api_url, api_key=api_key, max_retries=0, timeout=kwargs.pop("timeout", 120), **kwargs)


def async_openai_client(app: ServedApp, api_key: str = "unused", **kwargs):
    import openai

    return openai.AsyncOpenAI(base_url=app.api_url, api_key=api_key, max_retries=0, timeout=kwargs.pop("timeout", 120), **kwargs)


def assert_error_body(response, status: int, *, param: Any = "any", code: Any = "any", type_: str | None = None) -> dict:
    """The response has `status` and an OpenAI error body {"error": {"message", "type", "param", "code"}}."""
    assert response.status_code == status, (response.status_code, response.text)
    body = response.json()
    assert set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"], error
    assert isinstance(error["type"], str) and error["type"], error
    if param != "any":
        assert error["param"] == param, error
    if code != "any":
        assert error["code"] == code, error
    if type_ is not None:
        assert error["type"] == type_, error
    assert "Traceback" not in error["message"]
    return error
