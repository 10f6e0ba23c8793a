"""Inference backends behind one interface (`Backend`); `make_backend` builds the one a
`BackendConfig` names.

The built-in ones are registered in one table, `registry.BACKENDS` (name → class): `native`, this
repository's engine (backends/native.py); `vllm`, vLLM's V1 async engine (backends/vllm.py; needs
`make install-vllm`); `null`, tokens without a model, for measuring the serving path alone
(backends/null.py). No engine is imported until its backend starts. Any other `Backend` subclass
plugs in by import path (`backend: "module:Class"`). Every one validates its own options
(`options_from_kwargs`, where the config is loaded) and is built from them in its replica (`from_config`).
"""

from serve_app.backends.base import Backend, BackendDeadError, ModelInfo, RoutingStats
from serve_app.backends.config import BackendConfig
from serve_app.backends.registry import make_backend

__all__ = ["Backend", "BackendConfig", "BackendDeadError", "ModelInfo", "RoutingStats", "make_backend"]
