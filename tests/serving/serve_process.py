"""`serve run` as a subprocess, the way users start it: stopping it with Ctrl-C and checking that
nothing of its Ray instance outlives it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil

from tests.polling import wait_for

SERVE_BIN = Path(sys.executable).with_name("serve")
READY_TIMEOUT_S = 180  # the README promises < 60 s on an idle 2-core machine; CI machines are noisy


def start_serve_run(config: Path, cwd: Path, log_path: Path, **env: str) -> subprocess.Popen:
    """`serve run config` on a fresh Ray instance, as `make serve` runs it (loopback only, every
    replica's log lines shown), with `env` added to this environment; output goes to `log_path`."""
    full_env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_DEDUP_LOGS": "0", "RAY_ADDRESS": "local", **env}
    with open(log_path, "w") as log:
        return subprocess.Popen([str(SERVE_BIN), "run", str(config)], cwd=cwd, env=full_env, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)


def wait_until_answering(proc: subprocess.Popen, url: str, log_path: Path) -> None:
    """Until GET `url` answers 200; fails at once if `serve run` exits."""

    def answers():
        if proc.poll() is not None:
            raise AssertionError(f"serve run exited with {proc.returncode}:\n{log_path.read_text()[-4000:]}")
        try:
            return httpx.get(url, timeout=5).status_code == 200
        except httpx.HTTPError:
            return False

    wait_for(answers, READY_TIMEOUT_S, interval_s=0.5, message=f"serve run to answer on {url}")


def stop_serve_run(proc: subprocess.Popen, timeout_s: float = 60) -> None:
    """Ctrl-C first (serve run shuts Serve down and exits), then escalate, our processes only."""
    tree = [proc] + _children(proc)
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


def _children(proc: subprocess.Popen) -> list:
    try:
        return psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def _alive(p) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
