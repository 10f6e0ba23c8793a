"""Shared fixtures: the real model (converted by `make model`) and small factories."""

from __future__ import annotations

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
MODEL_DIR = REPO / "models" / "smollm2-135m-instruct"


@pytest.fixture(scope="session")
def model_dir() -> str:
    if not (MODEL_DIR / "model.safetensors").is_file():
        pytest.fail(f"{MODEL_DIR} is missing: run `make model` (make test does it)")
    return str(MODEL_DIR)
