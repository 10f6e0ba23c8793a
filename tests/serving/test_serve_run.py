"""`serve run configs/local.yaml` from the repository root, as the README says: the shipped config
(only the HTTP port changed, to a free one) comes up on 127.0.0.1, answers the README's curl and
`openai` examples, and Ctrl-C (SIGINT) shuts Serve and its Ray instance down."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import httpx
import openai
import pytest
import yaml

from tests.serving.conftest import MODEL_NAME, REPO, free_port, wait_for
from tests.serving.serve_process import start_serve_run, stop_serve_run, wait_until_answering

pytestmark = pytest.mark.startup(reason="starts `serve run` (a Ray cluster and the app) in a subprocess within a bound")


def test_makefile_serve_target_runs_the_local_config():
    out = subprocess.run(["make", "-n", "serve"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "serve run configs/local.yaml" in out.stdout


@pytest.fixture()
def local_config(tmp_path) -> tuple[Path, int]:
    config = yaml.safe_load((REPO / "configs" / "local.yaml").read_text())
    port = free_port()
    config["http_options"]["port"] = port
    path = tmp_path / "local.yaml"
    path.write_text(yaml.safe_dump(config))
    return path, port


def test_serve_run_local_config(local_config, tmp_path):
    config_path, port = local_config
    base = f"http://127.0.0.1:{port}"
    log_path = tmp_path / "serve.log"
    start = time.monotonic()
    proc = start_serve_run(config_path, REPO, log_path, SERVE_APP_API_KEY="")  # the open API the README shows
    try:
        wait_until_answering(proc, f"{base}/v1/models", log_path)
        ready_s = time.monotonic() - start
        print(f"serve run configs/local.yaml ready in {ready_s:.1f} s")

        # README: curl
        r = httpx.post(f"{base}/v1/chat/completions", timeout=60, json={
            "model": MODEL_NAME, "messages": [{"role": "user", "content": "What is the capital of France?"}],
            "max_tokens": 32, "temperature": 0})
        assert r.status_code == 200, r.text
        assert "Paris" in r.json()["choices"][0]["message"]["content"]
        # README: openai client, streamed
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=60)
        stream = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "Say hello."}],
                                                max_tokens=16, stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        assert httpx.get(f"{base}/health", timeout=10).json()["status"] == "ok"
        assert "OpenAI-compatible API ready" in log_path.read_text()
        # the API answers once one replica is up; the second one follows
        wait_for(lambda: log_path.read_text().count("LLMServer replica ready") >= 2, 120, message="both replicas")
        print(f"both replicas ready after {time.monotonic() - start:.1f} s")
    finally:
        stop_serve_run(proc)
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"{base}/v1/models", timeout=5)
