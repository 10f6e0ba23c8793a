"""Engine configuration: frozen dataclasses, validated once at construction.

Every invalid value raises `ValueError` naming the field, so a bad config fails at start-up (or as
an HTTP 400 when it comes from a request) instead of deep inside a step.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from serve_app.speculative_config import SpeculativeConfig
from serve_app.validation import require

if TYPE_CHECKING:
    from serve_app.backends.vllm_options import VLLMOptions
    from serve_app.serving.autoscaling import AutoscalingSettings

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

    def __post_init__(self) -> None:
        require(bool(self.model), "model", "a model directory is required")
        require(self.dtype in DTYPES, "dtype", f"must be one of {DTYPES}, got {self.dtype!r}")
        require(self.device == "cpu" or self.device.startswith("cuda"), "device", f"cpu or cuda[:N], got {self.device!r}")
        require(self.max_model_len >= 0, "max_model_len", "must be >= 0")
        require(self.attention_backend in ATTENTION_BACKENDS, "attention_backend", f"must be one of {ATTENTION_BACKENDS}")
        require(self.linear_backend in LINEAR_BACKENDS, "linear_backend", f"must be one of {LINEAR_BACKENDS}")
        require(self.cuda_graph_max_batch_size >= 1, "cuda_graph_max_batch_size", "must be >= 1")

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
        require(self.batching in BATCHING_POLICIES, "batching", f"must be one of {BATCHING_POLICIES}")
        require(self.max_num_seqs >= 1, "max_num_seqs", "must be >= 1")
        require(self.max_num_batched_tokens >= 1, "max_num_batched_tokens", "must be >= 1")
        require(0 <= self.batch_size <= self.max_num_seqs, "batch_size", "must be in [0, max_num_seqs]")
        if self.batch_size == 0:
            object.__setattr__(self, "batch_size", self.max_num_seqs)
        if self.batch_timeout_s < 0:
            object.__setattr__(self, "batch_timeout_s", 2.0 if self.batching == "static" else 0.0)


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)

    @classmethod
    def from_kwargs(cls, model: str, **kwargs: Any) -> EngineConfig:
        """Build from flat keyword arguments: each name goes to the sub-config that has that field;
        `speculative` is a mapping of `SpeculativeConfig` fields."""
        speculative = SpeculativeConfig.from_value(kwargs.pop("speculative", None))
        parts: dict[type, dict[str, Any]] = {ModelConfig: {"model": model}, CacheConfig: {}, SchedulerConfig: {}}
        for key, value in kwargs.items():
            owner = next((c for c in parts if key in {f.name for f in fields(c)}), None)
            if owner is None or key == "model":
                raise ValueError(f"{key}: not an engine option")
            parts[owner][key] = value
        return cls(ModelConfig(**parts[ModelConfig]), CacheConfig(**parts[CacheConfig]), SchedulerConfig(**parts[SchedulerConfig]),
                   speculative)

    # ---- the backend options contract (`BackendKind.options`): what the serving layer reads ----
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


def _native_options(model: str, engine: dict[str, Any]) -> EngineConfig:
    return EngineConfig.from_kwargs(model, **engine)


def _vllm_options(model: str, engine: dict[str, Any]) -> VLLMOptions:
    from serve_app.backends.vllm_options import VLLMOptions  # noqa: F811 - no vllm import

    return VLLMOptions.from_kwargs(**engine)


@dataclass(frozen=True)
class BackendKind:
    """A built-in backend, by the name `ServeConfig.backend` gives it.

    `options(model, engine)` validates the `engine` mapping into the backend's options, which carry
    `device`, `kv_block_size`, `world_size` (engine ranks per replica) and `step_token_budget` (None:
    unknown): the serving layer reads those, never the backend's name. `backend_class` is the
    `Backend` subclass ("module:Class"), imported only where a replica builds it; it has
    `from_serve_config(config, stat_loggers, fault_hook)`. A plugin backend (`backend: "module:Class"`)
    provides the same through `options_from_kwargs(engine)`."""

    options: Callable[[str, dict[str, Any]], Any]
    backend_class: str


BACKENDS: dict[str, BackendKind] = {
    "native": BackendKind(_native_options, "serve_app.backends.native:NativeBackend"),
    "vllm": BackendKind(_vllm_options, "serve_app.backends.vllm:VLLMBackend"),
}
PREFIX_CACHE_SALTS = ("auto", "tenant", "api_key", "none")


@dataclass(frozen=True)
class ServeConfig:
    """How the Ray Serve application is deployed (`serve_app.serving.app.build_app`).

    Built once on the driver from a Serve YAML's `args` (`from_dict`), validated here, then handed to
    every replica as is. Engine options live in `engine` (flat `EngineConfig.from_kwargs` names such
    as `dtype`, `device`, `max_num_seqs`, `kv_cache_memory_gib`), stored as sorted (name, value) pairs
    so the config stays frozen and picklable. `backend` picks the engine: `native` (this repository's;
    `engine` holds `EngineConfig` names) or `vllm` (vLLM's V1 async engine; `engine` holds
    `backends.vllm_options.VLLMOptions` names, validated here without importing vllm), or the
    "module:Class" import path of any other `Backend` subclass (e.g. the benchmarks' null engine,
    loadtest/null_backend.py), whose `options_from_kwargs(engine)` validates `engine`.

    Capacity: each LLMServer replica holds at most `max_ongoing_requests` requests (they all enter
    its engine, whose scheduler runs `max_num_seqs` of them at once); beyond that each caller queues
    up to `max_queued_requests`, and anything more is answered 503 with `Retry-After`.
    `torch_num_threads` 0 means every core of the machine (Ray pins fractional-CPU actors to one
    OpenMP thread otherwise). The API key is never part of the config (which Serve keeps in its
    controller state and shows on its dashboard): each ingress replica reads it from the environment
    variable named by `api_key_env` (default `SERVE_APP_API_KEY`, tenant `default`) in its own
    process, and/or one key per tenant from `api_keys_file` (a `tenant: key` file, or a directory
    with one file per tenant such as a mounted Secret), re-read when it changes (checked every
    `api_keys_reload_s`; serving.api_keys). Without any key the API is open, which is refused at
    start-up when Serve's HTTP host is not loopback unless `allow_unauthenticated` is true
    (serving.exposure, docs/security.md).
    Liveness (docs/operations.md): `check_health` (every `health_check_period_s`) fails once the
    engine died, or once it has had work pending and finished no step for `engine_stall_timeout_s`
    (a hung step); Serve then replaces the replica. A replica being removed (scale-down, redeploy)
    keeps serving its in-flight streams for up to `drain_timeout_s`, then aborts the rest (KV
    freed; their clients get an `aborted` error and `[DONE]`); Serve's own shutdown deadline is set
    a few seconds beyond it.
    Fan-out: a completions request carries at most `max_prompts_per_request` prompts, and its
    choices (n × prompts, one engine request each) never exceed `max_ongoing_requests`, what one
    replica admits at once, so a request is refused (400) before any of its work starts rather than
    half-admitted and then cut by backpressure.
    `stat_logger_factories` are "module:callable" paths, each called in the replica as
    `factory(config)` to make one engine `StatLogger`. `stream_batch_interval_s` > 0 lets a replica
    merge a stream's deltas that arrive within that interval into one item (the first token and the
    finish are never held): each streamed item costs CPU in the replica, the ingress and the proxy,
    which matters when engine steps are much shorter than the interval (GPUs). `stream_multiplexing`
    sends every delta a replica owes one ingress replica in one frame per flush, over a direct
    authenticated connection, instead of one item per stream (`serving.stream_mux`, docs/serving-path.md): the replica → ingress hop then
    costs per engine step, not per token.
    A streamed response's headers go out as soon as every choice is admitted by its replica (validated
    and queued), and while no token comes (a long queue) a `: keep-alive` SSE comment is sent every
    `stream_keepalive_s`, so proxies with idle timeouts keep the connection.
    Routing (docs/routing.md, docs/prefix_routing.md): `router` picks the LLMServer request router (`prefix_aware`: predicted time to first
    token from each replica's published prefix cache; `kv_aware`: KV occupancy only; Serve's `pow2`;
    `round_robin`); `router_kwargs` tune the first two (names in
    `serving.routing_policy.KVRouterSettings`); `request_router_class` plugs in any other router.
    The ingress tokenizes prompts (`tokenize_in_ingress`) so that routers hash the engine's blocks;
    `prefix_cache_salt` keeps tenants' cached prefixes apart: `tenant` salts each request by its
    tenant, `auto` (the default) does so whenever more than one tenant has a key, `api_key` by a
    digest of the bearer token, `none` shares one cache; a request's own `cache_salt` adds to it.
    Robustness (docs/failure-handling.md): a stream's chunks waiting for a slow reader are bounded by
    `max_stream_buffer_tokens` (beyond it the stream ends with an error and its work is cancelled);
    `exit_on_engine_death` makes a replica whose engine died exit at once, so routers drop it and the
    retry of a request that has not started goes elsewhere; `openapi_docs` serves /openapi.json and
    /docs; `fault_hook_factory` (tests only) installs a `serve_app.faults.FaultHook`.
    Autoscaling: `autoscaling` (Serve's names: `min_replicas`, `max_replicas`,
    `target_ongoing_requests`, `upscale_delay_s`, ...; see `serving.autoscaling.AutoscalingSettings`)
    makes Serve scale LLMServer on load instead of running a fixed `num_replicas` (leave that unset).
    """

    model: str
    served_model_name: str = ""
    backend: str = "native"
    engine: tuple[tuple[str, Any], ...] = ()
    # LLMServer deployment
    num_replicas: int = 1
    num_cpus_per_replica: float = 0.5
    num_gpus_per_replica: float = 0.0
    torch_num_threads: int = 0
    max_ongoing_requests: int = 64
    max_queued_requests: int = 128
    request_routing_stats_period_s: float = 0.5
    router: str = "prefix_aware"  # prefix_aware | kv_aware | pow2 (Serve's default) | round_robin
    router_kwargs: tuple[tuple[str, Any], ...] = ()  # KVCacheAwareRouter options (routing_policy.KVRouterSettings)
    request_router_class: str = ""  # import path of another Serve RequestRouter; overrides `router`
    max_replicas_per_node: int = 0  # 0: no limit (1: one replica per node, e.g. one per GPU machine)
    autoscaling: tuple[tuple[str, Any], ...] = ()  # empty: fixed num_replicas (serving.autoscaling.AutoscalingSettings)
    health_check_period_s: float = 2.0
    health_check_timeout_s: float = 30.0
    engine_stall_timeout_s: float = 60.0  # health check fails: work pending, no engine step finished for this long
    drain_timeout_s: float = 60.0  # a replica being removed serves its in-flight streams this long, then aborts them
    stat_logger_factories: tuple[str, ...] = ()
    stream_batch_interval_s: float = 0.0  # >0: merge a stream's deltas for up to this long (fewer Ray items)
    stream_multiplexing: bool = False  # one frame per flush carries every stream a replica owes an ingress
    # OpenAIIngress deployment
    ingress_num_replicas: int = 1
    ingress_num_cpus: float = 0.1
    ingress_max_ongoing_requests: int = 1024
    ingress_max_queued_requests: int = 256
    request_timeout_s: float = 600.0
    stream_keepalive_s: float = 10.0  # SSE comment every this many seconds while a stream has no event
    max_request_bytes: int = 1 << 20
    max_n: int = 8
    max_prompts_per_request: int = 16  # prompts in one completions request (a batch); n × prompts <= max_ongoing_requests
    replica_failure_retries: int = 1
    retry_after_s: int = 1
    api_key_env: str = "SERVE_APP_API_KEY"  # "" disables authentication whatever the environment holds
    api_keys_file: str = ""  # tenant keys: a `tenant: key` file or a directory of one file per tenant
    api_keys_reload_s: float = 5.0  # how often the keys file is checked for changes
    allow_unauthenticated: bool = False  # true: start without a key even on a non-loopback HTTP host
    log_requests: bool = False  # log prompts and outputs (off: only ids, sizes and timings)
    tokenize_in_ingress: bool = True  # token ids travel with the request (needs the model's tokenizer files on ingress nodes)
    prefix_cache_salt: str = "auto"  # auto | tenant | api_key | none (one shared prefix cache)
    # robustness (docs/failure-handling.md)
    max_stream_buffer_tokens: int = 65536  # tokens (+ logprob alternatives) one stream may hold for a slow reader
    openapi_docs: bool = False  # serve /openapi.json and /docs (the API's schema, e.g. for fuzzers)
    exit_on_engine_death: bool = True  # a replica whose engine died exits at once (leaves the routing; Serve replaces it)
    fault_hook_factory: str = ""  # tests only: "module:callable" making a serve_app.faults.FaultHook

    def __post_init__(self) -> None:
        engine = self.engine.items() if isinstance(self.engine, dict) else self.engine
        object.__setattr__(self, "engine", tuple(sorted((str(k), v) for k, v in engine)))
        router_kwargs = self.router_kwargs.items() if isinstance(self.router_kwargs, dict) else self.router_kwargs
        object.__setattr__(self, "router_kwargs", tuple(sorted((str(k), v) for k, v in router_kwargs)))
        object.__setattr__(self, "stat_logger_factories", tuple(self.stat_logger_factories))
        autoscaling = self.autoscaling or ()
        autoscaling = autoscaling.items() if isinstance(autoscaling, dict) else autoscaling
        object.__setattr__(self, "autoscaling", tuple(sorted((str(k), v) for k, v in autoscaling)))
        require(bool(self.model), "model", "a model directory is required")
        require(self.backend in BACKENDS or ":" in self.backend, "backend",
                 f"must be one of {tuple(BACKENDS)} or a 'module:Class' import path, got {self.backend!r}")
        self.backend_options()  # validates the engine options (names and values) for the backend
        if self.world_size > 1:
            require(not self.num_gpus_per_replica, "num_gpus_per_replica", "leave it unset with tensor_parallel_size or "
                     "pipeline_parallel_size > 1: the replica's placement group holds one device per rank")
        for name in ("num_replicas", "ingress_num_replicas", "max_ongoing_requests", "ingress_max_ongoing_requests", "max_n",
                     "max_prompts_per_request"):
            require(isinstance(getattr(self, name), int) and getattr(self, name) >= 1, name, "must be an integer >= 1")
        for name in ("max_queued_requests", "ingress_max_queued_requests"):
            require(isinstance(getattr(self, name), int) and (getattr(self, name) >= 1 or getattr(self, name) == -1), name, "must be >= 1, or -1 for no limit")
        for name in ("num_cpus_per_replica", "num_gpus_per_replica", "ingress_num_cpus"):
            require(getattr(self, name) >= 0, name, "must be >= 0")
        for name in ("request_routing_stats_period_s", "health_check_period_s", "health_check_timeout_s", "request_timeout_s",
                     "engine_stall_timeout_s", "drain_timeout_s", "stream_keepalive_s"):
            require(getattr(self, name) > 0, name, "must be > 0")
        require(self.torch_num_threads >= 0, "torch_num_threads", "must be >= 0 (0: all cores)")
        require(self.max_request_bytes >= 1024, "max_request_bytes", "must be >= 1024")
        require(self.replica_failure_retries >= 0, "replica_failure_retries", "must be >= 0")
        require(self.retry_after_s >= 0, "retry_after_s", "must be >= 0")
        require(0 <= self.stream_batch_interval_s <= 1, "stream_batch_interval_s", "must be in [0, 1] seconds")
        require(isinstance(self.stream_multiplexing, bool), "stream_multiplexing", "must be true or false")
        for path in self.stat_logger_factories:
            require(isinstance(path, str) and ":" in path, "stat_logger_factories", f"expected 'module:callable', got {path!r}")
        require(not self.fault_hook_factory or ":" in self.fault_hook_factory, "fault_hook_factory", "expected 'module:callable'")
        require(isinstance(self.max_stream_buffer_tokens, int) and self.max_stream_buffer_tokens >= 1024,
                 "max_stream_buffer_tokens", "must be an integer >= 1024")
        require(isinstance(self.openapi_docs, bool), "openapi_docs", "must be true or false")
        require(isinstance(self.exit_on_engine_death, bool), "exit_on_engine_death", "must be true or false")
        if self.request_router_class:
            require("." in self.request_router_class or ":" in self.request_router_class, "request_router_class", "expected an import path")
        from serve_app.serving.routing_policy import ROUTER_CLASSES, KVRouterSettings  # no Ray import

        require(self.router in ROUTER_CLASSES, "router", f"must be one of {tuple(ROUTER_CLASSES)}, got {self.router!r}")
        require(self.prefix_cache_salt in PREFIX_CACHE_SALTS, "prefix_cache_salt", f"must be one of {PREFIX_CACHE_SALTS}")
        require(isinstance(self.allow_unauthenticated, bool), "allow_unauthenticated", "must be true or false")
        require(isinstance(self.api_keys_file, str), "api_keys_file", "must be a path")
        require(self.api_keys_reload_s > 0, "api_keys_reload_s", "must be > 0")
        if self.router_kwargs:
            require(self.router in ("prefix_aware", "kv_aware") and not self.request_router_class, "router_kwargs",
                     "only the prefix_aware and kv_aware routers take options")
            KVRouterSettings.from_kwargs(dict(self.router_kwargs))  # validates names and values
        require(isinstance(self.max_replicas_per_node, int) and self.max_replicas_per_node >= 0,
                 "max_replicas_per_node", "must be an integer >= 0 (0: no limit)")
        if self.autoscaling:
            scaling = self.autoscaling_settings()  # validates names and values
            require(self.num_replicas == 1, "num_replicas", "leave it unset with `autoscaling` (min/max_replicas decide)")
            require(scaling.target_ongoing_requests <= self.max_ongoing_requests, "autoscaling",
                     f"target_ongoing_requests ({scaling.target_ongoing_requests}) must not exceed "
                     f"max_ongoing_requests ({self.max_ongoing_requests}), the per-replica cap")

    @classmethod
    def from_dict(cls, args: dict[str, Any]) -> ServeConfig:
        """From a Serve YAML's `args` mapping; unknown keys raise ValueError."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(args) - known)
        if unknown:
            raise ValueError(f"{unknown[0]}: not a serving option (known: {', '.join(sorted(known))})")
        values = dict(args)
        for name in ("stat_logger_factories",):
            if name in values and isinstance(values[name], str):
                values[name] = (values[name],)
        return cls(**values)

    @property
    def model_name(self) -> str:
        """The name clients put in `model`."""
        return self.served_model_name or Path(self.model).name

    @property
    def engine_kwargs(self) -> dict[str, Any]:
        return dict(self.engine)

    def engine_config(self) -> EngineConfig:
        """The native engine's config (`backend: native`)."""
        options = self.backend_options()
        require(isinstance(options, EngineConfig), "backend", f"engine_config() is the native engine's; this is {self.backend!r}")
        return options

    def vllm_options(self) -> VLLMOptions:
        """The vLLM engine's options (`backend: vllm`)."""
        require(self.backend in BACKENDS and BACKENDS[self.backend].options is _vllm_options, "backend",
                f"vllm_options() is the vLLM backend's; this is {self.backend!r}")
        return self.backend_options()

    def backend_options(self) -> Any:
        """The engine options, validated: `EngineConfig` (native), `VLLMOptions` (vllm) or a plugin's."""
        kind = BACKENDS.get(self.backend)
        if kind is not None:
            return kind.options(self.model, self.engine_kwargs)
        return self.backend_class().options_from_kwargs(self.engine_kwargs)

    def backend_class(self) -> Any:
        """The backend's class: a built-in one's (`BACKENDS`) or a plugin's (`backend: "module:Class"`, a
        `serve_app.backends.Backend` subclass with `options_from_kwargs(engine)` and
        `from_serve_config(config, stat_loggers, fault_hook)`)."""
        import importlib

        path = BACKENDS[self.backend].backend_class if self.backend in BACKENDS else self.backend
        module, _, name = path.partition(":")
        try:
            cls = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError) as exc:
            raise ValueError(f"backend: cannot import {self.backend!r}: {exc}") from exc
        from serve_app.backends.base import Backend

        require(isinstance(cls, type) and issubclass(cls, Backend), "backend", f"{self.backend!r} is not a Backend class")
        return cls

    @property
    def device(self) -> str:
        """Where the engine runs: "cpu" or "cuda[:N]" (any backend)."""
        return self.backend_options().device

    @property
    def kv_block_size(self) -> int:
        """Tokens per KV-cache block in the engine (routers estimate a request's blocks with it)."""
        return self.backend_options().kv_block_size

    @property
    def world_size(self) -> int:
        """Engine ranks per replica (processes or GPUs; 1 unless the backend splits the model)."""
        return getattr(self.backend_options(), "world_size", 1)

    @property
    def step_token_budget(self) -> int | None:
        """Tokens one engine step computes at most, where the backend says (None otherwise)."""
        return getattr(self.backend_options(), "step_token_budget", None)

    def autoscaling_settings(self) -> AutoscalingSettings | None:
        """The LLMServer autoscaling settings, None for a fixed `num_replicas`."""
        from serve_app.serving.autoscaling import AutoscalingSettings  # no Ray import

        return AutoscalingSettings.from_kwargs(dict(self.autoscaling)) if self.autoscaling else None
