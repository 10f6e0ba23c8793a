"""Every metric this service exports: names, types, help texts, labels and bucket boundaries.

The one place that owns them (docs/architecture.md lists them). Both exporters (`loggers.RayStatLogger` through
`ray.serve.metrics`, `loggers.PrometheusStatLogger` through `prometheus_client`), the router metrics,
the Prometheus rules and the Grafana dashboard use exactly these names.

`MetricSpec.name` is the name as Prometheus shows it outside Ray (counters end in `_total`). Under
Ray the same metric appears on Ray's metrics port as `ray_<name>` (`RAY_PREFIX`), with Ray Serve's
`deployment`, `replica` and `application` labels added to ours. Histograms also expose
`<name>_bucket` (with `le`), `<name>_sum` and `<name>_count`.

Every metric carries a `model` label (the served model name).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

MetricKind = Literal["counter", "gauge", "histogram"]

RAY_PREFIX = "ray_"
MODEL_LABEL = "model"
FINISH_REASON_LABEL = "finish_reason"
# The LLMServer replica a router-side series is about. Not `replica`: under Ray Serve that label is
# reserved and names the replica that *records* the metric (for the router: the ingress replica).
TARGET_REPLICA_LABEL = "target_replica"
ROUTING_REASON_LABEL = "reason"  # cache_hit | spill | load | fallback (serving.prefix_policy)
PATH_LABELS = ("linear", "attention", "amx", "batch_invariant", "self_check")  # engine/execution_paths.py
PREDICTION_SOURCE_LABEL = "source"  # exact (replica's cache events) | approximate (router's own history)
TENANT_LABEL = "tenant"  # the API key's tenant name (never the key); anonymous without keys
STATUS_LABEL = "status"  # an HTTP status code


@dataclass(frozen=True)
class MetricSpec:
    name: str
    kind: MetricKind
    help: str
    labels: tuple[str, ...] = ()  # besides `model`
    buckets: tuple[float, ...] = ()  # histograms only; +Inf is implicit

    def __post_init__(self) -> None:
        if not self.name.replace("_", "").isalnum() or not self.name.islower():
            raise ValueError(f"name: metric names use lowercase letters, digits and underscores, got {self.name!r}")
        if (self.kind == "counter") != self.name.endswith("_total"):
            raise ValueError(f"name: counters (and only counters) end in _total, got {self.kind} {self.name!r}")
        if (self.kind == "histogram") != bool(self.buckets):
            raise ValueError(f"buckets: histograms (and only histograms) have buckets ({self.name})")
        if list(self.buckets) != sorted(set(self.buckets)):
            raise ValueError(f"buckets: must be strictly increasing ({self.name})")

    @property
    def base_name(self) -> str:
        """The name to register: exporters append `_total` to counters themselves."""
        return self.name.removesuffix("_total") if self.kind == "counter" else self.name

    @property
    def label_names(self) -> tuple[str, ...]:
        return (MODEL_LABEL, *self.labels)

    @property
    def ray_name(self) -> str:
        return RAY_PREFIX + self.name

    def series_names(self, prefix: str = "") -> tuple[str, ...]:
        """The names of the time series Prometheus stores for this metric."""
        name = prefix + self.name
        if self.kind == "histogram":
            return (f"{name}_bucket", f"{name}_sum", f"{name}_count")
        return (name,)


# ---- bucket boundaries ---------------------------------------------------------------------------
BATCH_SIZE_BUCKETS = tuple(float(2**i) for i in range(10))  # 1, 2, 4, ..., 512 sequences
STEP_TOKENS_BUCKETS = tuple(float(2**i) for i in range(15))  # 1 ... 16384 tokens
STEP_DURATION_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75,
                         1.0, 2.5, 5.0, 10.0)
# TTFT and queue time reach 20 minutes: under load a request can wait in queues for minutes, and a
# histogram whose last bucket is a few seconds turns every such request into "+Inf".
REQUEST_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 15.0, 20.0,
                           30.0, 45.0, 60.0, 90.0, 120.0, 180.0, 300.0, 600.0, 1200.0)
E2E_LATENCY_BUCKETS = REQUEST_LATENCY_BUCKETS + (1800.0, 3600.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2,
                0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0)

# ---- engine metrics (one engine per replica) ------------------------------------------------------
STEP_BATCH_SIZE = MetricSpec(
    "llm_step_batch_size", "histogram", "Sequences scheduled in each engine step (batch size).",
    buckets=BATCH_SIZE_BUCKETS)
STEP_NUM_TOKENS = MetricSpec(
    "llm_step_num_tokens", "histogram", "Tokens computed in each engine step (prefill + decode).",
    buckets=STEP_TOKENS_BUCKETS)
STEP_DURATION = MetricSpec(
    "llm_step_duration_seconds", "histogram", "Wall time of one engine step (schedule + forward + update).",
    buckets=STEP_DURATION_BUCKETS)
TIME_TO_FIRST_TOKEN = MetricSpec(
    "llm_time_to_first_token_seconds", "histogram", "Time from a request's arrival at the engine to its first token.",
    buckets=REQUEST_LATENCY_BUCKETS)
TIME_PER_OUTPUT_TOKEN = MetricSpec(
    "llm_time_per_output_token_seconds", "histogram",
    "Mean inter-token latency after the first token, one observation per finished request with >= 2 tokens.",
    buckets=TPOT_BUCKETS)
E2E_REQUEST_LATENCY = MetricSpec(
    "llm_e2e_request_latency_seconds", "histogram", "Time from a request's arrival at the engine to its last token.",
    buckets=E2E_LATENCY_BUCKETS)
REQUEST_QUEUE_TIME = MetricSpec(
    "llm_request_queue_time_seconds", "histogram", "Time from a request's arrival to its first scheduled step.",
    buckets=REQUEST_LATENCY_BUCKETS)
KV_CACHE_USAGE = MetricSpec(
    "llm_kv_cache_usage_ratio", "gauge", "Fraction of KV-cache blocks in use (0-1), after the latest step.")
NUM_REQUESTS_RUNNING = MetricSpec(
    "llm_num_requests_running", "gauge", "Requests in the scheduler's running queue, after the latest step.")
NUM_REQUESTS_WAITING = MetricSpec(
    "llm_num_requests_waiting", "gauge", "Requests in the scheduler's waiting queue, after the latest step.")
NUM_PREEMPTIONS = MetricSpec(
    "llm_num_preemptions_total", "counter", "Requests preempted (KV blocks freed, recomputed later) for KV-cache space.")
PROMPT_TOKENS = MetricSpec(
    "llm_prompt_tokens_total", "counter", "Prompt tokens of finished requests (counted when a request finishes).")
GENERATION_TOKENS = MetricSpec(
    "llm_generation_tokens_total", "counter", "Generated tokens of finished requests (counted when a request finishes).")
PREFIX_CACHE_QUERIES = MetricSpec(
    "llm_prefix_cache_queries_total", "counter", "Prompt tokens looked up in the prefix cache.")
PREFIX_CACHE_HITS = MetricSpec(
    "llm_prefix_cache_hits_total", "counter", "Prompt tokens found in the prefix cache (their KV was reused).")
REQUEST_SUCCESS = MetricSpec(
    "llm_request_success_total", "counter", "Finished requests, by finish reason (stop, length, abort).",
    labels=(FINISH_REASON_LABEL,))

# speculative decoding (counted per step; ratios of their rates give acceptance and k, see the dashboard)
SPEC_PROPOSED_TOKENS = MetricSpec(
    "llm_spec_proposed_tokens_total", "counter", "Proposed (speculative) tokens verified by the target model.")
SPEC_ACCEPTED_TOKENS = MetricSpec(
    "llm_spec_accepted_tokens_total", "counter",
    "Proposed tokens accepted (each saved a step); acceptance rate = accepted / proposed.")
SPEC_VERIFIED_REQUESTS = MetricSpec(
    "llm_spec_verified_requests_total", "counter",
    "Request-steps verified with at least one proposed token; mean accepted length = accepted / verified.")
SPEC_DECODE_REQUESTS = MetricSpec(
    "llm_spec_decode_requests_total", "counter",
    "Request-steps that could have been verified (decoding, speculation on, not opted out); "
    "mean chosen k = proposed / this.")

# structured outputs (the native engine's grammars)
GRAMMAR_COMPILE_TIME = MetricSpec(
    "llm_grammar_compile_seconds", "histogram",
    "Time to compile one first-seen structured-output grammar (JSON schema, regex, choice, EBNF) in the "
    "engine's compile thread; a cached grammar is not compiled again.",
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0))
GRAMMAR_MASK_TIME = MetricSpec(
    "llm_grammar_mask_seconds", "histogram",
    "Grammar mask work of one engine step with constrained rows: checking greedy rows' choices against their "
    "grammars, and filling and applying the masks of the rows that need one.",
    buckets=(0.00001, 0.000025, 0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1))

ENGINE_EXECUTION_PATHS = MetricSpec(
    "llm_engine_execution_paths", "gauge",
    "1 for the execution paths this engine runs (projections, attention, AMX, batch invariance) and its "
    "start-up self-check's verdict (passed, fell back, not run).",
    labels=PATH_LABELS)

# ---- router metrics (recorded by the request router, in the process that routes) -----------------
ROUTER_STATS_AGE = MetricSpec(
    "llm_router_stats_age_seconds", "gauge",
    "Age of the KV-occupancy sample the router used for a replica at its latest routing decision.",
    labels=(TARGET_REPLICA_LABEL,))
ROUTER_ROUTED_REQUESTS = MetricSpec(
    "llm_router_routed_requests_total", "counter", "Requests the router sent to each LLMServer replica.",
    labels=(TARGET_REPLICA_LABEL,))

ROUTER_DECISIONS = MetricSpec(
    "llm_router_decisions_total", "counter",
    "Routing decisions by reason: cache_hit (sent where its prefix is cached), spill (a replica holding "
    "more of it was slower), load (no replica held any), fallback (stale statistics); by chosen replica.",
    labels=(ROUTING_REASON_LABEL, TARGET_REPLICA_LABEL))
ROUTER_CACHED_TOKENS_ABS_ERROR = MetricSpec(
    "llm_router_cached_tokens_abs_error", "histogram",
    "|Router's predicted - the engine's actual| cached prompt tokens, per request (le=0.5: exact).",
    labels=(PREDICTION_SOURCE_LABEL, TARGET_REPLICA_LABEL),
    buckets=(0.5, 16, 64, 256, 1024, 4096, 16384))
ROUTER_PREDICTED_CACHED_TOKENS = MetricSpec(
    "llm_router_predicted_cached_tokens_total", "counter",
    "Cached prompt tokens the router predicted, over requests whose actual count was reported.",
    labels=(PREDICTION_SOURCE_LABEL, TARGET_REPLICA_LABEL))
ROUTER_ACTUAL_CACHED_TOKENS = MetricSpec(
    "llm_router_actual_cached_tokens_total", "counter",
    "Cached prompt tokens the engines reported, for the same requests (predicted - actual: the signed error).",
    labels=(PREDICTION_SOURCE_LABEL, TARGET_REPLICA_LABEL))

# ---- API metrics (recorded by the ingress, per HTTP response) ---------------------------------------
API_REQUESTS = MetricSpec(
    "llm_api_requests_total", "counter",
    "HTTP API responses by tenant (the API key's name; unauthenticated for rejected keys) and status code.",
    labels=(TENANT_LABEL, STATUS_LABEL))

ENGINE_METRICS: tuple[MetricSpec, ...] = (
    STEP_BATCH_SIZE, STEP_NUM_TOKENS, STEP_DURATION,
    TIME_TO_FIRST_TOKEN, TIME_PER_OUTPUT_TOKEN, E2E_REQUEST_LATENCY, REQUEST_QUEUE_TIME,
    KV_CACHE_USAGE, NUM_REQUESTS_RUNNING, NUM_REQUESTS_WAITING,
    NUM_PREEMPTIONS, PROMPT_TOKENS, GENERATION_TOKENS, PREFIX_CACHE_QUERIES, PREFIX_CACHE_HITS, REQUEST_SUCCESS,
    SPEC_PROPOSED_TOKENS, SPEC_ACCEPTED_TOKENS, SPEC_VERIFIED_REQUESTS, SPEC_DECODE_REQUESTS, ENGINE_EXECUTION_PATHS,
    GRAMMAR_COMPILE_TIME, GRAMMAR_MASK_TIME,
)
# the vLLM backend has no source for these: vLLM compiles and applies its grammars internally and
# reports no timing of either, so its replicas leave both histograms empty
NATIVE_ONLY_METRICS: tuple[MetricSpec, ...] = (GRAMMAR_COMPILE_TIME, GRAMMAR_MASK_TIME)
VLLM_ENGINE_METRICS: tuple[MetricSpec, ...] = tuple(m for m in ENGINE_METRICS if m not in NATIVE_ONLY_METRICS)
ROUTER_METRICS: tuple[MetricSpec, ...] = (ROUTER_STATS_AGE, ROUTER_ROUTED_REQUESTS, ROUTER_DECISIONS, ROUTER_CACHED_TOKENS_ABS_ERROR,
                                          ROUTER_PREDICTED_CACHED_TOKENS, ROUTER_ACTUAL_CACHED_TOKENS)
API_METRICS: tuple[MetricSpec, ...] = (API_REQUESTS,)
ALL_METRICS: tuple[MetricSpec, ...] = ENGINE_METRICS + ROUTER_METRICS + API_METRICS
BY_NAME: dict[str, MetricSpec] = {m.name: m for m in ALL_METRICS}


def series_to_metric(series_name: str) -> MetricSpec | None:
    """`ray_llm_ttft..._bucket` (or any exported series name, with or without `ray_`) → its spec."""
    name = series_name.removeprefix(RAY_PREFIX)
    if name in BY_NAME:
        return BY_NAME[name]
    for suffix in ("_bucket", "_sum", "_count"):
        spec = BY_NAME.get(name.removesuffix(suffix))
        if name.endswith(suffix) and spec is not None and spec.kind == "histogram":
            return spec
    return None
