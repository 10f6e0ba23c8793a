"""Shared fixtures: the real model (converted by `make model`) and small factories."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

# Without a GPU, the Triton kernels' tests (tests/engine/test_triton_kernels.py) run them in Triton's
# interpreter. Triton reads TRITON_INTERPRET when it is first imported, and transformers imports it,
# so it is set here, before any test module loads.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

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
