"""`make serve SERVE_PROFILE=direct`: Ray Serve's throughput settings with direct ingress, where the
ingress replica answers HTTP on its own port instead of behind Serve's proxy. The API key, the
OpenAI error bodies and streaming must hold on that port exactly as through the proxy (whose port
keeps serving). The shipped configs/local.yaml runs under `serve run` with the environment the
Makefile sets (only the ports changed, to free ones) and the API key set."""

from __future__ import annotations

import shlex
import subprocess

import httpx
import openai
import pytest
import yaml

from tests.serving.conftest import MODEL_NAME, REPO, assert_error_body, free_port
from tests.serving.serve_process import start_serve_run, stop_serve_run, wait_until_answering

pytestmark = pytest.mark.startup(reason="starts `serve run` (a Ray cluster and the app) in a subprocess within a bound")

KEY = "sk-direct-7d41"
AUTH = {"Authorization": f"Bearer {KEY}"}


def direct_profile_env() -> dict[str, str]:
    """The RAY_SERVE_* variables `make serve SERVE_PROFILE=direct` puts on `serve run`."""
    out = subprocess.run(["make", "-n", "serve", "SERVE_PROFILE=direct"], cwd=REPO, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    line = next(line for line in out.stdout.splitlines() if "serve run" in line)
    env = dict(word.split("=", 1) for word in shlex.split(line) if word.startswith("RAY_SERVE_"))
    assert env["RAY_SERVE_ENABLE_DIRECT_INGRESS"] == "1" and env["RAY_SERVE_THROUGHPUT_OPTIMIZED"] == "1", env
    return env


@pytest.fixture(scope="module")
def urls(tmp_path_factory):
    """(direct ingress URL, proxy URL) of a running `serve run configs/local.yaml`."""
    tmp = tmp_path_factory.mktemp("direct")
    config = yaml.safe_load((REPO / "configs" / "local.yaml").read_text())
    proxy_port, direct_port, grpc_port = free_port(), free_port(), free_port()
    config["http_options"]["port"] = proxy_port
    config_path = tmp / "local.yaml"
    config_path.write_text(yaml.safe_dump(config))
    env = direct_profile_env()
    # one ingress replica: one free port in each range (Serve's ranges exclude their MAX)
    env.update(RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT=str(direct_port), RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT=str(direct_port + 1),
               RAY_SERVE_DIRECT_INGRESS_MIN_GRPC_PORT=str(grpc_port), RAY_SERVE_DIRECT_INGRESS_MAX_GRPC_PORT=str(grpc_port + 1))
    log_path = tmp / "serve.log"
    proc = start_serve_run(config_path, REPO, log_path, SERVE_APP_API_KEY=KEY, **env)
    try:
        direct, proxy = f"http://127.0.0.1:{direct_port}", f"http://127.0.0.1:{proxy_port}"
        wait_until_answering(proc, f"{direct}/health", log_path)
        yield direct, proxy
    finally:
        stop_serve_run(proc)


def test_the_ingress_port_needs_the_key(urls):
    direct, _ = urls
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


def test_the_key_opens_the_ingress_port(urls):
    direct, _ = urls
    with httpx.Client(base_url=direct, timeout=60, headers=AUTH) as http:
        assert http.get("/v1/models").json()["data"][0]["id"] == MODEL_NAME
        assert_error_body(http.post("/v1/completions", json={"model": "nope", "prompt": "Hi"}), 404, code="model_not_found")
        too_big = {"model": MODEL_NAME, "prompt": "x" * (1 << 20)}  # over max_request_bytes (1 MiB)
        assert_error_body(http.post("/v1/completions", json=too_big), 413)
    client = openai.OpenAI(base_url=f"{direct}/v1", api_key=KEY, max_retries=0, timeout=60)
    stream = client.completions.create(model=MODEL_NAME, prompt="The capital of France is", max_tokens=4, stream=True,
                                       temperature=0)
    assert "".join(c.choices[0].text for c in stream if c.choices).strip()


def test_the_proxy_port_still_serves_and_needs_the_key(urls):
    _, proxy = urls
    with httpx.Client(base_url=proxy, timeout=60) as http:
        assert_error_body(http.get("/v1/models"), 401, code="invalid_api_key")
        assert http.get("/v1/models", headers=AUTH).json()["data"][0]["id"] == MODEL_NAME
