"""Which `Backend` a name means: one table, `BACKENDS`, for the built-in ones (name → "module:Class");
any other `Backend` subclass plugs in by its import path (`backend: "module:Class"`). Nothing else
compares backend names.

Importing a backend's module loads neither torch nor vllm (each imports its engine in `start()`), so
its options are validated where the config is loaded (`serve run`'s driver), not in a replica.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping, Sequence
from typing import Any

from serve_app.backends.base import Backend
from serve_app.backends.config import BackendConfig
from serve_app.validation import require

BACKENDS: dict[str, str] = {
    "native": "serve_app.backends.native:NativeBackend",  # this repository's engine
    "vllm": "serve_app.backends.vllm:VLLMBackend",  # vLLM's V1 async engine (needs `make install-vllm`)
    "null": "serve_app.backends.null:NullBackend",  # tokens without a model: the serving path alone
}


def backend_class(name: str) -> type[Backend]:
    """The `Backend` subclass `name` stands for (ValueError naming `backend` otherwise)."""
    require(name in BACKENDS or ":" in name, "backend",
            f"must be one of {tuple(BACKENDS)} or a 'module:Class' import path, got {name!r}")
    module, _, attr = BACKENDS.get(name, name).partition(":")
    try:
        cls = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"backend: cannot import {name!r}: {exc}") from exc
    require(isinstance(cls, type) and issubclass(cls, Backend), "backend", f"{name!r} is not a Backend class")
    return cls


def load_backend_config(name: str, model: str, model_name: str, engine: Mapping[str, Any]) -> BackendConfig:
    """A serving config's `backend` and `engine` mapping, validated into the backend's options
    (ValueError naming the option)."""
    return BackendConfig(name, model, model_name, backend_class(name).options_from_kwargs(model, dict(engine)))


def make_backend(config: BackendConfig, stat_loggers: Sequence[Any] = (), fault_hook: Any = None) -> Backend:
    """The backend `config` names, built from its validated options (not started yet). `fault_hook`
    (tests only, serve_app/faults.py) reaches the native engine's per-request stages."""
    return backend_class(config.name).from_config(config, stat_loggers, fault_hook)
