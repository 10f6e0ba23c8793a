"""Inference backends behind one interface (`Backend`); `make_backend` picks one by name.

The built-in ones are registered in one table, `serve_app.config.BACKENDS` (name → options validator
and class): `native`, this repository's engine (backends/native.py); `vllm`, vLLM's V1 async engine
(backends/vllm.py; needs `make install-vllm`). Neither engine is imported until its backend starts.
Any other `Backend` subclass plugs in by import path (`backend: "module:Class"`, e.g. the null engine
for benchmarks, loadtest/null_backend.py). Every one is built by
`Class.from_serve_config(config, stat_loggers, fault_hook)`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from serve_app.backends.base import Backend, BackendDeadError, ModelInfo, RoutingStats

if TYPE_CHECKING:
    from serve_app.config import ServeConfig


def make_backend(config: ServeConfig, stat_loggers: Sequence[Any] = (), fault_hook: Any = None) -> Backend:
    """The backend named by `config.backend` (not started yet). `fault_hook` (tests only,
    serve_app/faults.py) reaches the native engine's per-request stages."""
    return config.backend_class().from_serve_config(config, stat_loggers, fault_hook)


__all__ = ["Backend", "BackendDeadError", "ModelInfo", "RoutingStats", "make_backend"]
