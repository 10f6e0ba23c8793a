"""The tests' Ray start retries a node that registers too slowly, and only that.

A real registration timeout cannot be produced on demand, so `ray.init` is replaced: the first call
spawns a process (as a real failed start leaves a GCS and a raylet) and raises Ray's own message.
"""

from __future__ import annotations

import subprocess
import sys

import psutil
import pytest
import ray

from tests.ray_start import init_local_ray

RAY_TIMEOUT = ("The current node timed out during startup. This could happen because some of the raylet "
               "failed to startup or the GCS has become overloaded.")


def test_a_start_that_times_out_is_retried_after_killing_what_it_left(monkeypatch):
    calls, leftovers = [], []

    def fake_init(**kwargs):
        calls.append(kwargs)
        if len(calls) == 1:
            leftovers.append(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]))
            raise Exception(RAY_TIMEOUT)

    monkeypatch.setattr(ray, "init", fake_init)
    monkeypatch.setattr(ray, "shutdown", lambda: None)
    init_local_ray(namespace="t", include_dashboard=False)
    assert calls == [{"namespace": "t", "include_dashboard": False}] * 2
    assert leftovers[0].wait(timeout=10) is not None  # killed before the second attempt
    assert not psutil.pid_exists(leftovers[0].pid)


def test_the_last_timeout_and_any_other_error_are_raised(monkeypatch):
    calls = []

    def always_times_out(**kwargs):
        calls.append(kwargs)
        raise Exception(RAY_TIMEOUT)

    monkeypatch.setattr(ray, "init", always_times_out)
    monkeypatch.setattr(ray, "shutdown", lambda: None)
    with pytest.raises(Exception, match="timed out during startup"):
        init_local_ray(attempts=2)
    assert len(calls) == 2

    def bad_argument(**kwargs):
        calls.append(kwargs)
        raise ValueError("unknown argument")

    calls.clear()
    monkeypatch.setattr(ray, "init", bad_argument)
    with pytest.raises(ValueError):
        init_local_ray(attempts=3)
    assert len(calls) == 1
