"""Inference backends behind one interface (`Backend`); `make_backend` picks one by name.

`native`: this repository's engine (backends/native.py). `vllm`: vLLM's V1 async engine
(backends/vllm.py; needs `make install-vllm`). Neither engine is imported until its backend starts.
Any other `Backend` subclass plugs in by import path (`backend: "module:Class"`, e.g. the null engine
for benchmarks, loadtest/null_backend.py): `Class.from_serve_config(config, stat_loggers)` builds it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from serve_app.backends.base import Backend, BackendDeadError, ModelInfo, RoutingStats
from serve_app.config import ServeConfig


def make_backend(config: ServeConfig, stat_loggers: Sequence[Any] = (), fault_hook: Any = None) -> Backend:
    """The backend named by `config.backend` (not started yet). `fault_hook` (tests only,
    serve_app/faults.py) reaches the native engine's per-request stages."""
    if config.backend == "native":
        from serve_app.backends.native import NativeBackend

        return NativeBackend(config.engine_config(), config.model_name, stat_loggers, fault_hook)
    if config.backend == "vllm":
        from serve_app.backends.vllm import VLLMBackend  # imports vllm only in start()

        return VLLMBackend(config.model, config.vllm_options(), config.model_name, stat_loggers)
    return config.backend_class().from_serve_config(config, stat_loggers)  # a plugin ("module:Class")


__all__ = ["Backend", "BackendDeadError", "ModelInfo", "RoutingStats", "make_backend"]
