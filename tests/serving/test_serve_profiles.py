"""`make serve`'s profiles other than Serve's classic proxy, under `serve run` of the shipped
configs/local.yaml with the environment the Makefile sets (only the ports changed, to free ones, and
HAProxy's files in a directory of their own) and the API key set:

- `haproxy` (the default): Ray's HAProxy on the HTTP port in front of the ingress replicas' own
  HTTP servers;
- `direct`: the ingress replica answers on its own port; Serve's proxy keeps its port.

On the port clients use, the API key, the OpenAI error bodies, the body limit and streaming must hold
exactly as through the proxy, and a client that leaves must stop its request in the engine."""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest
import yaml

from serve_app.serving.haproxy_env import STATE_DIR, haproxy_env, wait_for_haproxy
from tests.polling import wait_for
from tests.serving.conftest import MODEL_NAME, REPO, assert_error_body, free_port
from tests.serving.serve_process import start_serve_run, stop_serve_run, wait_until_answering

pytestmark = pytest.mark.startup(reason="starts `serve run` (a Ray cluster and the app) in a subprocess within a bound")

KEY = "sk-direct-7d41"
AUTH = {"Authorization": f"Bearer {KEY}"}


def profile_env(profile: str) -> dict[str, str]:
    """The RAY_SERVE_* variables `make serve SERVE_PROFILE=<profile>` puts on `serve run`."""
    out = subprocess.run(["make", "-n", "serve", f"SERVE_PROFILE={profile}"], cwd=REPO, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    line = next(line for line in out.stdout.splitlines() if "serve run" in line)
    env = dict(word.split("=", 1) for word in shlex.split(line) if word.startswith(("RAY_SERVE_", "RAY_worker_niceness")))
    assert env["RAY_SERVE_ENABLE_DIRECT_INGRESS"] == "1" and env["RAY_SERVE_THROUGHPUT_OPTIMIZED"] == "1", env
    assert (env.get("RAY_SERVE_ENABLE_HA_PROXY") == "1") == (profile == "haproxy"), env
    assert env["RAY_SERVE_LOG_TO_STDERR"] == "1", env  # the replicas' log lines (the ready line too) in the terminal
    assert env["RAY_worker_niceness"] == "0", env  # Ray's default, 15, puts the engines below every other process
    return env


def test_haproxy_is_make_serves_default_profile():
    out = subprocess.run(["make", "-n", "serve"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert "RAY_SERVE_ENABLE_HA_PROXY=1" in out.stdout, out.stdout


@dataclass(frozen=True)
class Served:
    url: str  # where clients go: HAProxy's port, or the direct-ingress replica's
    proxy: str | None  # Serve's proxy, where it keeps a port of its own
    log: Path


@pytest.fixture(scope="module", params=["haproxy", "direct"])
def served(request, tmp_path_factory):
    """A running `serve run configs/local.yaml` under the profile's environment."""
    profile = request.param
    tmp = tmp_path_factory.mktemp(profile)
    config = yaml.safe_load((REPO / "configs" / "local.yaml").read_text())
    http_port, direct_port, grpc_port = free_port(), free_port(), free_port()
    config["http_options"]["port"] = http_port
    config["applications"][0]["args"]["log_requests"] = True  # the replica logs each request's end
    config_path = tmp / "local.yaml"
    config_path.write_text(yaml.safe_dump(config))
    env = profile_env(profile)
    # one ingress replica: one free port in each range (Serve's ranges exclude their MAX)
    env.update(RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT=str(direct_port), RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT=str(direct_port + 1),
               RAY_SERVE_DIRECT_INGRESS_MIN_GRPC_PORT=str(grpc_port), RAY_SERVE_DIRECT_INGRESS_MAX_GRPC_PORT=str(grpc_port + 1))
    if profile == "haproxy":
        env.update(haproxy_env())  # its files and stats ports apart from any other HAProxy on this machine
    log_path = tmp / "serve.log"
    proc = start_serve_run(config_path, REPO, log_path, SERVE_APP_API_KEY=KEY, **env)
    try:
        http, direct = f"http://127.0.0.1:{http_port}", f"http://127.0.0.1:{direct_port}"
        if profile == "haproxy":
            wait_until_answering(proc, f"{http}/health", log_path)
            wait_for_haproxy(Path(env[STATE_DIR]))
            yield Served(http, None, log_path)
        else:
            wait_until_answering(proc, f"{direct}/health", log_path)
            yield Served(direct, http, log_path)
    finally:
        stop_serve_run(proc)
        if STATE_DIR in env:
            shutil.rmtree(env[STATE_DIR], ignore_errors=True)


def test_the_engine_replicas_run_at_normal_priority(served):
    """Started as `make serve` starts Ray, the engine replicas run at niceness 0 and say so (at Ray's
    default, 15, they would warn)."""
    log = wait_for(lambda: (text := served.log.read_text()).count("LLMServer replica ready") >= 2 and text, 30,
                   message="both replicas' ready lines")
    assert re.findall(r"LLMServer replica ready: .*, niceness (\d+)", log) == ["0", "0"], log[-3000:]
    assert "runs at niceness" not in log


def test_the_port_needs_the_key(served):
    direct = served.url
    with httpx.Client(base_url=direct, timeout=60) as http:
        assert_error_body(http.get("/v1/models"), 401, code="invalid_api_key", type_="authentication_error")
        for stream in (False, True):
            body = {"model": MODEL_NAME, "prompt": "Hi", "max_tokens": 2, "stream": stream}
            assert_error_body(http.post("/v1/completions", json=body), 401, code="invalid_api_key")
            r = http.post("/v1/completions", json=body, headers={"Authorization": "Bearer sk-wrong"})
            assert_error_body(r, 401, code="invalid_api_key")
            assert r.headers["www-authenticate"] == "Bearer"
        assert http.get("/health").json()["status"] == "ok"  # probes need no key
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{direct}/v1", api_key="sk-wrong", max_retries=0).models.list()


def test_the_key_opens_the_port(served):
    direct = served.url
    with httpx.Client(base_url=direct, timeout=60, headers=AUTH) as http:
        assert http.get("/v1/models").json()["data"][0]["id"] == MODEL_NAME
        assert_error_body(http.post("/v1/completions", json={"model": "nope", "prompt": "Hi"}), 404, code="model_not_found")
        too_big = {"model": MODEL_NAME, "prompt": "x" * (1 << 20)}  # over max_request_bytes (1 MiB)
        assert_error_body(http.post("/v1/completions", json=too_big), 413)
    client = openai.OpenAI(base_url=f"{direct}/v1", api_key=KEY, max_retries=0, timeout=60)
    stream = client.completions.create(model=MODEL_NAME, prompt="The capital of France is", max_tokens=4, stream=True,
                                       temperature=0)
    assert "".join(c.choices[0].text for c in stream if c.choices).strip()


def test_the_proxy_port_still_serves_and_needs_the_key(served):
    if served.proxy is None:
        pytest.skip("HAProxy holds the HTTP port: Serve's proxy is only its backup server")
    proxy = served.proxy
    with httpx.Client(base_url=proxy, timeout=60) as http:
        assert_error_body(http.get("/v1/models"), 401, code="invalid_api_key")
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
