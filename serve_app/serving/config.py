"""The serving layer's configuration (`ServeConfig`): the Serve application's deployments, replicas,
limits, authentication, exposure, streaming and robustness settings, as a Serve YAML's `args` give
them, validated once where the application is built; the backend's, the router's and the autoscaler's
settings inside it become their layers' own typed configs there.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from serve_app.backends.config import BackendConfig
from serve_app.backends.registry import load_backend_config
from serve_app.serving.autoscaling import AutoscalingSettings
from serve_app.serving.routing_config import RoutingConfig
from serve_app.validation import require

PREFIX_CACHE_SALTS = ("auto", "tenant", "api_key", "none")
OMP_WAIT_POLICIES = ("passive", "active", "default")
# Ray starts its worker processes (the replicas) at this variable's niceness, 15 when unset; make serve sets 0
WORKER_NICENESS_ENV = "RAY_worker_niceness"


@dataclass(frozen=True)
class ServeConfig:
    """How the Ray Serve application is deployed (`serve_app.serving.app.build_app`).

    Built once on the driver from a Serve YAML's `args` (`from_dict`), validated here, then handed to
    every replica as is. The fields are the YAML's keys; the mappings among them (`engine`,
    `router_kwargs`, `autoscaling`) are kept as sorted (name, value) pairs so the config stays frozen
    and picklable. Construction validates every layer once and keeps each as its own typed object,
    which the layers below receive (never a mapping): `backend_config` (`backends.config.BackendConfig`:
    the backend, the model, and the `engine` options validated by the backend), `routing`
    (`routing_config.RoutingConfig`) and `autoscaling_settings` (`autoscaling.AutoscalingSettings`,
    None for a fixed `num_replicas`).
    `backend` picks the engine (`backends.registry.BACKENDS`): `native` (this repository's; `engine`
    holds `engine.config.EngineConfig.from_kwargs` names such as `dtype`, `device`, `max_num_seqs`,
    `kv_cache_memory_gib`) or `vllm` (vLLM's V1 async engine; `engine` holds
    `backends.vllm_options.VLLMOptions` names, validated without importing vllm) or `null` (tokens
    without a model, `backends.null.NullEngineOptions`), or the "module:Class" import path of any
    other `Backend` subclass, whose `options_from_kwargs(model, engine)` validates `engine`.

    Capacity: each LLMServer replica holds at most `max_ongoing_requests` requests (they all enter
    its engine, whose scheduler runs `max_num_seqs` of them at once); beyond that each caller queues
    up to `max_queued_requests`, and anything more is answered 503 with `Retry-After`.
    `torch_num_threads` 0 means every core of the machine (Ray pins fractional-CPU actors to one
    OpenMP thread otherwise). `omp_wait_policy` is OpenMP's OMP_WAIT_POLICY in a CPU replica's
    process and its children, set when the process starts: `passive` (the default) puts an idle
    OpenMP thread to sleep at once, so it leaves its core to the serving processes and to the other
    replicas' engines instead of spinning on it; `active` spins; `default` leaves OpenMP's own choice
    (spin a while, then sleep). `omp_spin_count` ≥ 0 sets how many times an idle OpenMP thread
    spins before it sleeps (libgomp's GOMP_SPINCOUNT, in the replica's environment from the start
    like the policy; about 100 spins a microsecond): a short spin catches the next parallel region
    of the same step, which sleeping (`passive`) would pay a wake-up for, and still gives the core
    away between steps. The API key is never part of the config (which Serve keeps in its
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
    `serving.routing_config.KVRouterSettings`); `request_router_class` plugs in any other router.
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
    omp_wait_policy: str = "passive"  # passive | active | default (OpenMP's own): see the docstring
    omp_spin_count: int = -1  # spins before an idle OpenMP thread sleeps (GOMP_SPINCOUNT); -1: OpenMP's own
    max_ongoing_requests: int = 64
    max_queued_requests: int = 128
    request_routing_stats_period_s: float = 0.5
    router: str = "prefix_aware"  # prefix_aware | kv_aware | pow2 (Serve's default) | round_robin
    router_kwargs: tuple[tuple[str, Any], ...] = ()  # our routers' options (routing_config.KVRouterSettings)
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
    # each layer's config, built and validated once from the fields above (see the docstring)
    backend_config: BackendConfig = field(init=False, repr=False, compare=False)
    routing: RoutingConfig = field(init=False, repr=False, compare=False)
    autoscaling_settings: AutoscalingSettings | None = field(init=False, repr=False, compare=False)

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
        backend = load_backend_config(self.backend, self.model, self.model_name, dict(self.engine))
        object.__setattr__(self, "backend_config", backend)
        if backend.world_size > 1:
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
        require(self.omp_wait_policy in OMP_WAIT_POLICIES, "omp_wait_policy", f"must be one of {OMP_WAIT_POLICIES}")
        require(isinstance(self.omp_spin_count, int) and self.omp_spin_count >= -1, "omp_spin_count",
                "must be an integer >= 0, or -1 for OpenMP's own")
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
        object.__setattr__(self, "routing", RoutingConfig.build(
            self.router, self.request_router_class, dict(self.router_kwargs), self.request_routing_stats_period_s,
            model_name=self.model_name, block_size=backend.kv_block_size, step_token_budget=backend.step_token_budget,
            request_timeout_s=self.request_timeout_s))
        require(self.prefix_cache_salt in PREFIX_CACHE_SALTS, "prefix_cache_salt", f"must be one of {PREFIX_CACHE_SALTS}")
        require(isinstance(self.allow_unauthenticated, bool), "allow_unauthenticated", "must be true or false")
        require(isinstance(self.api_keys_file, str), "api_keys_file", "must be a path")
        require(self.api_keys_reload_s > 0, "api_keys_reload_s", "must be > 0")
        require(isinstance(self.max_replicas_per_node, int) and self.max_replicas_per_node >= 0,
                 "max_replicas_per_node", "must be an integer >= 0 (0: no limit)")
        scaling = AutoscalingSettings.from_kwargs(dict(self.autoscaling)) if self.autoscaling else None
        object.__setattr__(self, "autoscaling_settings", scaling)
        if scaling is not None:
            require(self.num_replicas == 1, "num_replicas", "leave it unset with `autoscaling` (min/max_replicas decide)")
            require(scaling.target_ongoing_requests <= self.max_ongoing_requests, "autoscaling",
                     f"target_ongoing_requests ({scaling.target_ongoing_requests}) must not exceed "
                     f"max_ongoing_requests ({self.max_ongoing_requests}), the per-replica cap")

    @classmethod
    def from_dict(cls, args: dict[str, Any]) -> ServeConfig:
        """From a Serve YAML's `args` mapping; unknown keys raise ValueError."""
        known = {f.name for f in fields(cls) if f.init}
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
