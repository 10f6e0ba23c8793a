"""Shared fixtures: the real model (converted by `make model`) and small factories."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import pytest
import torch

# Hypothesis is imported here, at collection, while this process has one thread. Otherwise its pytest
# plugin imports it in its terminal summary, when a suite that never used it (tests/vllm) still has
# engine threads; pytest parses each plugin module to rewrite its asserts, and CPython 3.11's `ast`
# is not thread-safe ("SystemError: AST constructor recursion depth mismatch"). The GPU check's
# environment has no Hypothesis (nor its plugin): there is nothing to do.
with contextlib.suppress(ImportError):
    import hypothesis  # noqa: F401

REPO = Path(__file__).resolve().parent.parent
MODEL_DIR = REPO / "models" / "smollm2-135m-instruct"
pytest_plugins = ["tests.tiers"]  # the test tiers: `cluster` marked at collection, the fast tier's rule


def pytest_collection_modifyitems(config, items) -> None:
    """Tests marked `startup(reason=...)` (and only they) get one rerun on failure: what they depend
    on, a process starting within a bound on a shared machine, is not what they test. Every other
    test must pass the first time (it waits on conditions, never on elapsed time)."""
    for item in items:
        marker = item.get_closest_marker("startup")
        if marker is None:
            continue
        if not marker.kwargs.get("reason"):
            raise pytest.UsageError(f"{item.nodeid}: @pytest.mark.startup needs reason=... (why start-up timing matters)")
        item.add_marker(pytest.mark.flaky(reruns=1, reruns_delay=5))


def pytest_configure(config):
    """Without a GPU, the Triton kernels' tests (tests/engine/test_triton_kernels.py) run them in
    Triton's interpreter. Triton reads TRITON_INTERPRET when it is first imported, and transformers
    imports it, so it is set here, before any test module loads; not for a session that selects the
    vLLM tests (vLLM imports Triton too, and they never run our kernels)."""
    selects_vllm = "vllm" in (config.option.markexpr or "").replace("not vllm", "")
    if not torch.cuda.is_available() and not selects_vllm:
        os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session", autouse=True)
def one_torch_thread_in_the_test_process():
    """In-process engines use one intra-op thread: test workloads are tiny, and two OpenMP threads
    on a 2-core machine that also runs Ray stall at every barrier (10x slower, measured). Ray
    replicas set their own threads from their config."""
    import torch

    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def model_dir() -> str:
    if not (MODEL_DIR / "model.safetensors").is_file():
        pytest.fail(f"{MODEL_DIR} is missing: run `make model` (make test does it)")
    return str(MODEL_DIR)
