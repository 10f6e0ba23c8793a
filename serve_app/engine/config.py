"""The native engine's configuration: frozen dataclasses, validated once at construction.

Every invalid value raises `ValueError` naming the field, so a bad config fails at start-up instead
of deep inside a step. The engine's parts receive these objects, never a mapping. Imports no torch:
the serving layer builds and ships an `EngineConfig` (the native backend's options) in processes
that never load the engine.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Literal

from serve_app.engine.spec_decode.config import SpeculativeConfig
from serve_app.validation import require

BatchingPolicy = Literal["continuous", "dynamic", "static"]
BATCHING_POLICIES = ("continuous", "dynamic", "static")
DTYPES = ("float32", "bfloat16", "float16")
ATTENTION_BACKENDS = ("auto", "torch", "cpu_decode", "triton", "flashinfer")
LINEAR_BACKENDS = ("auto", "kernels", "onednn", "dense")
DEFAULT_KV_CACHE_MEMORY_GIB = 1.0


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
    # auto: on CPU the C++ decode kernel and, in bf16 with AVX512-BF16, the prompt-chunk kernel; on CUDA
    # FlashInfer when importable (16-bit dtypes), else Triton. cpu_decode: the C++ decode kernel for every
    # row, prompt tokens included. torch: the reference path (gathers blocks, SDPA); triton / flashinfer:
    # those kernels (CUDA; triton also runs on CPU under TRITON_INTERPRET=1, for tests)
    attention_backend: str = "auto"
    # CPU bf16 projections (docs/batch-invariance.md): auto picks by the CPU's features (kernels without
    # AMX, onednn with AMX, dense without AVX512 bf16 support); kernels: the C++ AVX512-BF16 kernels;
    # onednn: oneDNN's packed matmul (AMX where the CPU has it); dense: torch's F.linear
    linear_backend: str = "auto"
    # a request's tokens and logprobs do not depend on the rest of its batch, on prefix-cache hits, on chunk
    # sizes, preemption or speculation (bf16 on CPU; fp32 and CUDA paths are close, not bit-identical)
    batch_invariant: bool = True
    amx: bool = True  # False: oneDNN never uses AMX tiles (ONEDNN_MAX_CPU_ISA, set before oneDNN's first use)
    enforce_eager: bool = False  # CUDA: no CUDA graphs for decode steps
    cuda_graph_max_batch_size: int = 256  # CUDA: decode steps up to this many sequences replay a captured graph
    # CPU: torch threads for a step that reads no prompt token (0: as many as any other step); replicas that
    # share their cores decode faster on one thread each (engine/step_threads.py)
    decode_threads: int = 0

    def __post_init__(self) -> None:
        require(bool(self.model), "model", "a model directory is required")
        require(self.dtype in DTYPES, "dtype", f"must be one of {DTYPES}, got {self.dtype!r}")
        require(self.device == "cpu" or self.device.startswith("cuda"), "device", f"cpu or cuda[:N], got {self.device!r}")
        require(self.max_model_len >= 0, "max_model_len", "must be >= 0")
        require(self.attention_backend in ATTENTION_BACKENDS, "attention_backend", f"must be one of {ATTENTION_BACKENDS}")
        require(self.linear_backend in LINEAR_BACKENDS, "linear_backend", f"must be one of {LINEAR_BACKENDS}")
        require(self.cuda_graph_max_batch_size >= 1, "cuda_graph_max_batch_size", "must be >= 1")
        require(type(self.decode_threads) is int and self.decode_threads >= 0, "decode_threads", "must be an integer >= 0")
        require(not self.decode_threads or self.device == "cpu", "decode_threads", "a CPU option (CUDA steps run on the GPU)")

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

    `num_blocks` 0 means: as many blocks as fit in `kv_cache_memory_gib` (unset: 1 GiB), or, on CUDA
    with `gpu_memory_utilization` set (a fraction of the GPU's memory, as vLLM's), in what that
    fraction leaves after the weights and the peak activations of a profiling forward pass.
    """

    block_size: int = 16
    num_blocks: int = 0
    kv_cache_memory_gib: float | None = None
    gpu_memory_utilization: float = 0.0  # 0: not used
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        require(self.block_size in (8, 16, 32, 64, 128), "block_size", "must be one of 8, 16, 32, 64, 128")
        require(self.num_blocks >= 0, "num_blocks", "must be >= 0")
        require(self.kv_cache_memory_gib is None or self.kv_cache_memory_gib > 0, "kv_cache_memory_gib", "must be > 0")
        require(0 <= self.gpu_memory_utilization < 1, "gpu_memory_utilization", "must be in [0, 1) (0: use kv_cache_memory_gib)")
        require(not (self.gpu_memory_utilization and self.kv_cache_memory_gib is not None),
                 "gpu_memory_utilization, kv_cache_memory_gib", "set one of them, not both")

    @property
    def kv_cache_gib(self) -> float:
        """The fixed KV budget (when `gpu_memory_utilization` is not used)."""
        return DEFAULT_KV_CACHE_MEMORY_GIB if self.kv_cache_memory_gib is None else self.kv_cache_memory_gib


@dataclass(frozen=True)
class SchedulerConfig:
    """Admission and batch shape.

    continuous: admit new requests at every step. With `waiting_served_ratio` > 0, while requests
      run, waiting ones join only once at least `waiting_served_ratio` x (running requests) of them
      wait, or once the queue head has been held `max_waiting_steps` steps; a request that finds
      nothing running starts at once. Prompts then prefill in groups rather than one per step, so
      streams already decoding are stalled by fewer prefills (a lower inter-token latency, for a
      later first token under load).
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
    waiting_served_ratio: float = 0.0
    max_waiting_steps: int = 20

    def __post_init__(self) -> None:
        require(self.batching in BATCHING_POLICIES, "batching", f"must be one of {BATCHING_POLICIES}")
        require(self.max_num_seqs >= 1, "max_num_seqs", "must be >= 1")
        require(self.max_num_batched_tokens >= 1, "max_num_batched_tokens", "must be >= 1")
        require(self.waiting_served_ratio >= 0, "waiting_served_ratio", "must be >= 0")
        require(not self.waiting_served_ratio or self.batching == "continuous", "waiting_served_ratio",
                "applies to continuous batching only (static and dynamic batches admit no one while they run)")
        require(self.max_waiting_steps >= 0, "max_waiting_steps", "must be >= 0")
        require(0 <= self.batch_size <= self.max_num_seqs, "batch_size", "must be in [0, max_num_seqs]")
        if self.batch_size == 0:
            object.__setattr__(self, "batch_size", self.max_num_seqs)
        if self.batch_timeout_s < 0:
            object.__setattr__(self, "batch_timeout_s", 2.0 if self.batching == "static" else 0.0)


@dataclass(frozen=True)
class EngineConfig:
    """Everything the native engine is built from (and the native backend's options): built once, by
    `from_kwargs` where flat options arrive (the offline `LLM`, a serving config's `engine` mapping),
    then handed down as this object."""

    model: ModelConfig
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    # a server's engine (the native backend) steps in a process of its own (engine/process_engine.py)
    # rather than in a thread beside the server's event loop; the offline `LLM` always steps in its caller
    core_process: bool = False

    @classmethod
    def from_kwargs(cls, model: str, **kwargs: Any) -> EngineConfig:
        """Build from flat keyword arguments: each name goes to the sub-config that has that field;
        `speculative` is a mapping of `SpeculativeConfig` fields."""
        speculative = SpeculativeConfig.from_value(kwargs.pop("speculative", None))
        core_process = kwargs.pop("core_process", False)
        require(isinstance(core_process, bool), "core_process", f"must be true or false, got {core_process!r}")
        parts: dict[type, dict[str, Any]] = {ModelConfig: {"model": model}, CacheConfig: {}, SchedulerConfig: {}}
        for key, value in kwargs.items():
            owner = next((c for c in parts if key in {f.name for f in fields(c)}), None)
            if owner is None or key == "model":
                raise ValueError(f"{key}: not an engine option")
            parts[owner][key] = value
        return cls(ModelConfig(**parts[ModelConfig]), CacheConfig(**parts[CacheConfig]), SchedulerConfig(**parts[SchedulerConfig]),
                   speculative, core_process)

    # ---- the backend options contract (serve_app.backends.registry): what the serving layer reads ----
    @property
    def device(self) -> str:
        return self.model.device

    @property
    def kv_block_size(self) -> int:
        return self.cache.block_size

    @property
    def world_size(self) -> int:
        return 1

    @property
    def step_token_budget(self) -> int:
        """Tokens one engine step computes at most (the prefix-aware router's step cost)."""
        return self.scheduler.max_num_batched_tokens
