"""Shared fixtures: the real model (converted by `make model`) and small factories."""

from __future__ import annotations

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
MODEL_DIR = REPO / "models" / "smollm2-135m-instruct"


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
