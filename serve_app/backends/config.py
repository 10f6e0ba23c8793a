"""The backend layer's configuration: which `Backend` serves which model, with its options validated.

Built once where the serving config is loaded (`registry.load_backend_config`), then handed to the
replica, which builds its backend from it (`Backend.from_config`). The serving layer reads the
options' `device`, `kv_block_size`, `world_size` and `step_token_budget` through it, never the
backend's name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class BackendConfig:
    """`name`: a `registry.BACKENDS` name or a "module:Class" import path; `model`: the model
    directory; `model_name`: the name clients put in `model`; `options`: the backend's own options,
    already validated (`engine.config.EngineConfig` for `native`, `vllm_options.VLLMOptions` for
    `vllm`, a plugin's own type)."""

    name: str
    model: str
    model_name: str
    options: Any

    @property
    def device(self) -> str:
        """Where the engine runs: "cpu" or "cuda[:N]"."""
        return self.options.device

    @property
    def kv_block_size(self) -> int:
        """Tokens per KV-cache block in the engine (routers estimate a request's blocks with it)."""
        return self.options.kv_block_size

    @property
    def world_size(self) -> int:
        """Engine ranks per replica (processes or GPUs; 1 unless the backend splits the model)."""
        return getattr(self.options, "world_size", 1)

    @property
    def step_token_budget(self) -> int | None:
        """Tokens one engine step computes at most, where the backend says (None otherwise)."""
        return getattr(self.options, "step_token_budget", None)
