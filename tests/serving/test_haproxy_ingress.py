"""The prototype of serve_app/serving/haproxy_ingress.py under `serve run`: HAProxy on the HTTP port,
our LLMServer replica as the HTTP ingress, our ingress request router picking it. A streamed
completion must carry the same tokens as the non-streamed one, every POST must have been routed by
our router, and the API key, the OpenAI error bodies and the field-naming 400 must hold as through
OpenAIIngress, and a client that leaves must stop its request in the engine. One replica, one `serve run`, clients on 127.0.0.1 only (HAProxy binds it; Serve
binds the replica's own port on all interfaces, which is why the app must have a key)."""

from __future__ import annotations

import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest
import yaml

from serve_app.serving.haproxy_env import STATE_DIR, haproxy_env
from tests.polling import wait_for
from tests.serving.conftest import MODEL_NAME, REPO, assert_error_body, free_port
from tests.serving.serve_process import READY_TIMEOUT_S, start_serve_run, stop_serve_run, wait_until_answering

pytestmark = pytest.mark.startup(reason="starts `serve run` (a Ray cluster, HAProxy and the app) in a subprocess within a bound")

KEY = "sk-haproxy-51c2"
AUTH = {"Authorization": f"Bearer {KEY}"}
PROMPT = "The capital of France is"
# Serve's access-log line of the router replica, one per routed POST (a deployment without a route
# prefix logs its route as `__call__`)
ROUTED = "llm_IngressRouter", "POST __call__ 200"


@dataclass(frozen=True)
class Served:
    url: str
    log: Path

    def routed(self) -> int:
        return sum(all(part in line for part in ROUTED) for line in self.log.read_text().splitlines())


def router_in_haproxy(log: str) -> bool:
    """HAProxy reloaded after its backend config first listed a router server (HAProxyManager's log)."""
    listed = log.find("ingress_request_router_servers=[ServerConfig")
    return listed >= 0 and "Successfully performed graceful HAProxy reload" in log[listed:]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A running `serve run` of `build_haproxy_app` (configs/local.yaml's args, one replica)."""
    tmp = tmp_path_factory.mktemp("haproxy")
    config = yaml.safe_load((REPO / "configs" / "local.yaml").read_text())
    port = free_port()
    config["http_options"]["port"] = port
    app = config["applications"][0]
    app["import_path"] = "serve_app.serving.haproxy_ingress:build_haproxy_app"
    app["args"].update(num_replicas=1, torch_num_threads=0, log_requests=True)  # the replica logs each request's end
    config_path = tmp / "haproxy.yaml"
    config_path.write_text(yaml.safe_dump(config))
    env = {**haproxy_env(), "RAY_SERVE_INGRESS_REQUEST_ROUTER_FORWARD_BODY": "1",
           "PYTHONPATH": str(REPO), "SERVE_APP_API_KEY": KEY}  # PYTHONPATH: this checkout's serve_app in every process
    log_path = tmp / "serve.log"
    proc = start_serve_run(config_path, REPO, log_path, **env)
    try:
        wait_until_answering(proc, f"http://127.0.0.1:{port}/health", log_path)
        # until HAProxy runs a config with the router's server it balances POSTs itself: wait for it
        wait_for(lambda: router_in_haproxy(log_path.read_text()), READY_TIMEOUT_S, interval_s=0.5,
                 message="HAProxy to reload with the ingress request router")
        yield Served(f"http://127.0.0.1:{port}", log_path)
    finally:
        stop_serve_run(proc)
        shutil.rmtree(env[STATE_DIR], ignore_errors=True)


def test_a_streamed_completion_routed_by_our_router_matches_the_whole_one(served):
    before = served.routed()
    client = openai.OpenAI(base_url=f"{served.url}/v1", api_key=KEY, max_retries=0, timeout=60)
    whole = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=8, temperature=0)
    assert whole.usage.completion_tokens == 8
    events = list(client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=8, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert len([e for e in events if e.choices]) >= 2  # streamed, not one event
    assert "".join(e.choices[0].text for e in events if e.choices) == whole.choices[0].text
    assert events[-1].usage.completion_tokens == 8
    wait_for(lambda: served.routed() >= before + 2, 30, interval_s=0.5, message="both POSTs in the router's log")


def test_the_key_and_the_error_bodies_hold_behind_haproxy(served):
    with httpx.Client(base_url=served.url, timeout=60) as http:
        body = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 2, "stream": True}
        assert_error_body(http.post("/v1/completions", json=body), 401, code="invalid_api_key")
        assert_error_body(http.post("/v1/completions", json={**body, "max_tokens": -1}, headers=AUTH), 400,
                          param="max_tokens")
        assert_error_body(http.post("/v1/completions", json={**body, "model": "nope"}, headers=AUTH), 404,
                          code="model_not_found")
        assert http.get("/v1/models", headers=AUTH).json()["data"][0]["id"] == MODEL_NAME


def test_a_client_that_leaves_stops_its_request(served):
    """1,500 tokens take over a minute here; the replica's log line for the request comes well before,
    with a few tokens, once the client has closed the connection after three events."""
    prompt = "Count slowly: one, two,"
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 1500, "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=served.url, timeout=60, headers=AUTH) as http, \
            http.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        events = (line for line in r.iter_lines() if line.startswith("data: "))
        for _ in range(3):
            next(events)
    ended = re.compile(rf"request cmpl-\S+: prompt '{re.escape(prompt)}' → (\d+) tokens")
    match = wait_for(lambda: ended.search(served.log.read_text()), 45, interval_s=0.5,
                     message="the replica to end the request")
    assert 3 <= int(match.group(1)) < 1500
