"""Engine configuration: frozen dataclasses, validated once at construction.

Every invalid value raises `ValueError` naming the field, so a bad config fails at start-up (or as
an HTTP 400 when it comes from a request) instead of deep inside a step.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Literal

BatchingPolicy = Literal["continuous", "dynamic", "static"]
BATCHING_POLICIES = ("continuous", "dynamic", "static")
DTYPES = ("float32", "bfloat16", "float16")


def _require(cond: bool, name: str, msg: str) -> None:
    if not cond:
        raise ValueError(f"{name}: {msg}")


@dataclass(frozen=True)
class ModelConfig:
    """Which checkpoint to load and how.

    `max_model_len` 0 means: the model's `max_position_embeddings` (later capped by the KV cache size).
    """

    model: str
    dtype: str = "float32"
    device: str = "cpu"
    max_model_len: int = 0
    seed: int = 0
    served_model_name: str = ""

    def __post_init__(self) -> None:
        _require(bool(self.model), "model", "a model directory is required")
        _require(self.dtype in DTYPES, "dtype", f"must be one of {DTYPES}, got {self.dtype!r}")
        _require(self.device == "cpu" or self.device.startswith("cuda"), "device", f"cpu or cuda[:N], got {self.device!r}")
        _require(self.max_model_len >= 0, "max_model_len", "must be >= 0")

    @property
    def name(self) -> str:
        return self.served_model_name or Path(self.model).name

    def hf_config(self) -> dict[str, Any]:
        path = Path(self.model) / "config.json"
        if not path.is_file():
            raise ValueError(f"model: {path} not found (run `make model` for the default model)")
        return json.loads(path.read_text())


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache geometry.

    `num_blocks` 0 means: as many blocks as fit in `kv_cache_memory_gib`.
    """

    block_size: int = 16
    num_blocks: int = 0
    kv_cache_memory_gib: float = 1.0
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        _require(self.block_size in (8, 16, 32, 64, 128), "block_size", "must be one of 8, 16, 32, 64, 128")
        _require(self.num_blocks >= 0, "num_blocks", "must be >= 0")
        _require(self.kv_cache_memory_gib > 0, "kv_cache_memory_gib", "must be > 0")


@dataclass(frozen=True)
class SchedulerConfig:
    """Admission and batch shape.

    continuous: admit new requests at every step.
    dynamic: when idle, form a batch from whatever waits (up to `batch_size`) once the oldest request
      has waited `batch_timeout_s` (default 0: at once); run it to completion before admitting more.
    static: when idle, wait until `batch_size` requests wait (or the oldest has waited
      `batch_timeout_s`, default 2 s); run that batch to completion.
    """

    batching: BatchingPolicy = "continuous"
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True
    batch_size: int = 0
    batch_timeout_s: float = -1.0

    def __post_init__(self) -> None:
        _require(self.batching in BATCHING_POLICIES, "batching", f"must be one of {BATCHING_POLICIES}")
        _require(self.max_num_seqs >= 1, "max_num_seqs", "must be >= 1")
        _require(self.max_num_batched_tokens >= 1, "max_num_batched_tokens", "must be >= 1")
        _require(0 <= self.batch_size <= self.max_num_seqs, "batch_size", "must be in [0, max_num_seqs]")
        if self.batch_size == 0:
            object.__setattr__(self, "batch_size", self.max_num_seqs)
        if self.batch_timeout_s < 0:
            object.__setattr__(self, "batch_timeout_s", 2.0 if self.batching == "static" else 0.0)


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)

    @classmethod
    def from_kwargs(cls, model: str, **kwargs: Any) -> EngineConfig:
        """Build from flat keyword arguments: each name goes to the sub-config that has that field."""
        parts: dict[type, dict[str, Any]] = {ModelConfig: {"model": model}, CacheConfig: {}, SchedulerConfig: {}}
        for key, value in kwargs.items():
            owner = next((c for c in parts if key in {f.name for f in fields(c)}), None)
            if owner is None or key == "model":
                raise ValueError(f"{key}: not an engine option")
            parts[owner][key] = value
        return cls(ModelConfig(**parts[ModelConfig]), CacheConfig(**parts[CacheConfig]), SchedulerConfig(**parts[SchedulerConfig]))
