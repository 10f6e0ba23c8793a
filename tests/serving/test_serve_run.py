"""`serve run configs/local.yaml` from the repository root, as the README says: the shipped config
(only the HTTP port changed, to a free one) comes up on 127.0.0.1, answers the README's curl and
`openai` examples, and Ctrl-C (SIGINT) shuts Serve and its Ray instance down."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import psutil
import pytest
import yaml

from tests.serving.conftest import MODEL_NAME, REPO, free_port, wait_for

SERVE_BIN = Path(sys.executable).with_name("serve")
READY_TIMEOUT_S = 180  # the README promises < 60 s on an idle 2-core machine; CI machines are noisy
pytestmark = pytest.mark.startup(reason="starts `serve run` (a Ray cluster and the app) in a subprocess within a bound")


def _stop(proc: subprocess.Popen, timeout_s: float = 60) -> None:
    """Ctrl-C first (serve run shuts Serve down and exits), then escalate, our processes only."""
    tree = [proc] + proc_children(proc)
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=30)
    deadline = time.monotonic() + 30
    leftovers = [p for p in tree[1:] if _alive(p)]
    while leftovers and time.monotonic() < deadline:
        time.sleep(0.5)
        leftovers = [p for p in leftovers if _alive(p)]
    for p in leftovers:  # Ray's own processes of this instance, if any outlived the driver
        p.kill()
    assert not leftovers, f"processes left running after Ctrl-C: {[p.pid for p in leftovers]}"


def proc_children(proc: subprocess.Popen) -> list:
    try:
        return psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def _alive(p) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


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
    # as `make serve` (loopback only, every replica's log lines shown), on a fresh Ray instance
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_DEDUP_LOGS": "0", "RAY_ADDRESS": "local"}
    env.pop("SERVE_APP_API_KEY", None)
    log_path = tmp_path / "serve.log"
    start = time.monotonic()
    with open(log_path, "w") as log:
        proc = subprocess.Popen([str(SERVE_BIN), "run", str(config_path)], cwd=REPO, env=env, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
    try:
        def ready():
            if proc.poll() is not None:
                raise AssertionError(f"serve run exited with {proc.returncode}:\n{log_path.read_text()[-4000:]}")
            try:
                return httpx.get(f"{base}/v1/models", timeout=5).status_code == 200
            except httpx.HTTPError:
                return False

        wait_for(ready, READY_TIMEOUT_S, interval_s=0.5, message=f"serve run to answer on {base}")
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
        _stop(proc)
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"{base}/v1/models", timeout=5)
