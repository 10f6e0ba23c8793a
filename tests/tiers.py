"""The test tiers: which tests `make test-fast` runs, and the rule that keeps that tier fast.

Markers (registered in pyproject.toml; docs/testing.md explains the tiers):

- `cluster`: the test starts a Ray cluster, a Serve app or a server process (`serve run`, Locust,
  Prometheus). Applied here, at collection, to every test that calls a starter (`STARTERS`:
  `ray.init`, `serve.run`, `init_local_ray`, ...) in its own body or in the body of any fixture it
  uses, however indirectly (pytest's resolved fixture closure); a test that starts one some other
  way says so itself with `pytest.mark.cluster`.
- `heavy`: the test runs the real model in-process for many steps, seconds to a minute each
  (exactness against HF, batch invariance, speculation, faults at every stage). Marked by hand,
  per module or per test, when a test costs more than a few seconds of CPU.
- `prometheus`: the test needs Debian's `prometheus` / `promtool` binaries (installed as root by
  `make system-deps`; `make test` does it, `make test-fast` does not need it). Marked by hand.
- `slow`, `vllm`, `gpu`: outside the default suite (unchanged).

`make test-fast` deselects `FAST_EXCLUDES`. What keeps that tier honest: a fast-tier test after
which Ray is initialized (and was not before) fails, naming the marker. This module is a pytest
plugin (tests/conftest.py loads it; tests/test_tiers.py runs it on a synthetic suite).
"""

from __future__ import annotations

import ast
import functools
import inspect
import sys
import textwrap
from collections.abc import Callable, Iterable

import pytest

# what `make test-fast` leaves out (pyproject's addopts already leave out slow, vllm and gpu)
FAST_EXCLUDES = ("cluster", "heavy", "prometheus", "slow", "vllm", "gpu")
FAST_MARKEXPR = " and ".join(f"not {m}" for m in FAST_EXCLUDES)

# calls that start a cluster or a server process: `ray.init(...)`, `serve.run(...)`, or a helper by name
STARTER_ATTRIBUTES = frozenset({("ray", "init"), ("serve", "run"), ("serve", "start")})
STARTER_NAMES = frozenset({"init_local_ray", "start_serve_run", "TwoNodeCluster", "prometheus_server", "ray_instance"})


@functools.cache
def starter_call(func: Callable) -> str | None:
    """The first cluster-starting call in `func`'s own body (`"ray.init"`, `"init_local_ray"`, ...),
    or None. Only this body is read: `cluster_reason` reads each fixture's."""
    try:
        source = textwrap.dedent(inspect.getsource(func))
    except (OSError, TypeError):  # no source (a builtin, a generated function): nothing to read
        return None
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call):
            continue
        callee = node.func
        if isinstance(callee, ast.Name) and callee.id in STARTER_NAMES:
            return callee.id
        if isinstance(callee, ast.Attribute):
            if callee.attr in STARTER_NAMES:
                return callee.attr
            if isinstance(callee.value, ast.Name) and (callee.value.id, callee.attr) in STARTER_ATTRIBUTES:
                return f"{callee.value.id}.{callee.attr}"
    return None


def in_fast_tier(item: pytest.Item) -> bool:
    return not any(item.get_closest_marker(m) for m in FAST_EXCLUDES)


def cluster_reason(item: pytest.Item) -> str | None:
    """Why `item` is in the cluster tier ("calls ray.init()", "fixture ray_cluster calls
    init_local_ray()"), or None."""
    func = getattr(item, "function", None)
    if func is not None and (call := starter_call(func)):
        return f"calls {call}()"
    fixture_info = getattr(item, "_fixtureinfo", None)
    for name in getattr(item, "fixturenames", ()):
        for fixturedef in (fixture_info.name2fixturedefs.get(name, ()) if fixture_info else ()):
            if call := starter_call(fixturedef.func):
                return f"fixture {name} calls {call}()"
    return None


def mark_tiers(items: Iterable[pytest.Item]) -> None:
    """Add `cluster` to every item with a `cluster_reason`."""
    for item in items:
        if not item.get_closest_marker("cluster") and cluster_reason(item):
            item.add_marker(pytest.mark.cluster)


def left_ray_running() -> bool:
    """True when Ray is initialized in this process (only if something imported it)."""
    ray = sys.modules.get("ray")
    return ray is not None and bool(getattr(ray, "is_initialized", lambda: False)())


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marker
def pytest_collection_modifyitems(items) -> None:
    mark_tiers(items)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    """A fast-tier test that starts Ray (and leaves it running) fails: it belongs to the `cluster` tier."""
    ray_before = left_ray_running()
    outcome = yield
    if in_fast_tier(item) and not ray_before and left_ray_running():
        outcome.force_exception(AssertionError(
            f"{item.nodeid} started Ray but is not marked cluster (tests/tiers.py; docs/testing.md)"))
