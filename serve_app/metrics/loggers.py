"""Engine stat loggers: the engine's plain-data stats → Prometheus metrics (names: `names.py`).

Both implement the engine's `StatLogger` protocol (`record(scheduler_stats, finished)`, called on
the engine thread after every step and after aborts):

- `RayStatLogger`: `ray.serve.metrics`, for an engine inside a Ray Serve replica. The metrics appear
  on Ray's per-node metrics port as `ray_<name>` with `deployment` / `replica` / `application` added
  by Ray. `LLMServer` creates one per replica (always; `stat_logger_factories` add others).
- `PrometheusStatLogger`: `prometheus_client`, its own `CollectorRegistry`, for an engine outside Ray
  (`LLM(..., stat_loggers=[logger])`); `serve()` or `asgi_app()` expose it on a `/metrics` route.

What is recorded:
- per step: batch size, tokens computed and duration (histograms); KV-cache usage, running and
  waiting requests (gauges, as of the end of the step); preemptions, prefix-cache queries / hits and
  speculative decoding's proposed / accepted tokens, verified and candidate requests (counters);
- once, the engine's execution paths as the labels of `llm_engine_execution_paths` (value 1);
- per finished request: `llm_request_success_total{finish_reason}`; prompt and generation tokens;
  TTFT and queue time (when the request got that far, aborted or not); e2e latency and TPOT for
  requests that completed (stop / length), not for aborted ones.

Loggers are cheap (a dozen metric updates per step) and never raise: a failure is logged (first
one with its traceback) and counted in `num_errors`, and the engine carries on.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from serve_app.metrics import names
from serve_app.metrics.instruments import Instrument, PrometheusInstruments, RayInstruments
from serve_app.metrics.stats import EngineLoad, SchedulerStats
from serve_app.types import FinishReason, RequestMetrics

logger = logging.getLogger(__name__)

_FINISH_REASONS = tuple(str(r) for r in FinishReason)
_COMPLETED = (FinishReason.STOP, FinishReason.LENGTH)


class MetricsStatLogger:
    """The recording logic, over any instrument factory (`MetricSpec` → `Instrument`)."""

    def __init__(self, model_name: str, make: Callable[[names.MetricSpec], Instrument]) -> None:
        self.model_name = model_name
        self.num_errors = 0
        m = self.instruments = {spec.name: make(spec) for spec in names.ENGINE_METRICS}
        self._batch_size = m[names.STEP_BATCH_SIZE.name]
        self._step_tokens = m[names.STEP_NUM_TOKENS.name]
        self._step_duration = m[names.STEP_DURATION.name]
        self._ttft = m[names.TIME_TO_FIRST_TOKEN.name]
        self._tpot = m[names.TIME_PER_OUTPUT_TOKEN.name]
        self._e2e = m[names.E2E_REQUEST_LATENCY.name]
        self._queue = m[names.REQUEST_QUEUE_TIME.name]
        self._kv_usage = m[names.KV_CACHE_USAGE.name]
        self._running = m[names.NUM_REQUESTS_RUNNING.name]
        self._waiting = m[names.NUM_REQUESTS_WAITING.name]
        self._preemptions = m[names.NUM_PREEMPTIONS.name]
        self._prompt_tokens = m[names.PROMPT_TOKENS.name]
        self._generation_tokens = m[names.GENERATION_TOKENS.name]
        self._prefix_queries = m[names.PREFIX_CACHE_QUERIES.name]
        self._prefix_hits = m[names.PREFIX_CACHE_HITS.name]
        self._success = m[names.REQUEST_SUCCESS.name]
        spec = (names.SPEC_DECODE_REQUESTS, names.SPEC_VERIFIED_REQUESTS, names.SPEC_PROPOSED_TOKENS, names.SPEC_ACCEPTED_TOKENS)
        self._spec = [m[n.name] for n in spec]  # in SchedulerStats.spec_* order
        self._grammar_compile = m[names.GRAMMAR_COMPILE_TIME.name]
        self._grammar_mask = m[names.GRAMMAR_MASK_TIME.name]
        self._success_labels = {r: {names.FINISH_REASON_LABEL: r} for r in _FINISH_REASONS}
        # counters exist (at 0) from the start: rate() reads 0, not "no data", before the first event
        for counter in (self._preemptions, self._prompt_tokens, self._generation_tokens,
                        self._prefix_queries, self._prefix_hits, *self._spec):
            self._safe(counter.touch)
        for labels in self._success_labels.values():
            self._safe(self._success.touch, labels)
        # an idle engine reports an empty cache rather than nothing
        for gauge in (self._kv_usage, self._running, self._waiting):
            self._safe(gauge.set, 0.0)

    # ---- StatLogger ------------------------------------------------------------------------------
    def record_paths(self, labels: dict[str, str]) -> None:
        """The engine's execution paths, once: `llm_engine_execution_paths{...} 1`."""
        self._safe(self.instruments[names.ENGINE_EXECUTION_PATHS.name].set, 1.0, labels)

    def record(self, scheduler_stats: SchedulerStats | None, finished: list[tuple[FinishReason, RequestMetrics]]) -> None:
        try:
            if scheduler_stats is not None:
                self._record_step(scheduler_stats)
            for reason, metrics in finished:
                self._record_finished(reason, metrics)
        except Exception:  # noqa: BLE001 - a metrics failure must never stop the engine
            self._on_error()

    def record_load(self, load: EngineLoad) -> None:
        """Gauges after requests finished outside a step (see the engine's `StatLogger`)."""
        try:
            self._kv_usage.set(load.kv_cache_usage)
            self._running.set(load.num_running)
            self._waiting.set(load.num_waiting)
        except Exception:  # noqa: BLE001 - a metrics failure must never stop the engine
            self._on_error()

    def _record_step(self, s: SchedulerStats) -> None:
        self._batch_size.observe(s.num_scheduled_seqs)
        self._step_tokens.observe(s.num_prefill_tokens + s.num_decode_tokens)
        self._step_duration.observe(s.step_duration_s)
        self._kv_usage.set(s.kv_cache_usage)
        self._running.set(s.num_running)
        self._waiting.set(s.num_waiting)
        self._preemptions.inc(s.num_preempted)
        self._prefix_queries.inc(s.prefix_cache_queries)
        self._prefix_hits.inc(s.prefix_cache_hits)
        for counter, value in zip(self._spec, (s.spec_num_candidates, s.spec_num_seqs, s.spec_num_proposed, s.spec_num_accepted), strict=True):
            counter.inc(value)
        if s.grammar_mask_s is not None:
            self._grammar_mask.observe(s.grammar_mask_s)
        for seconds in s.grammar_compile_s:
            self._grammar_compile.observe(seconds)

    def _record_finished(self, reason: FinishReason, m: RequestMetrics) -> None:
        reason_s = str(reason)
        labels = self._success_labels.get(reason_s) or {names.FINISH_REASON_LABEL: reason_s}
        self._success.inc(1, labels)
        self._prompt_tokens.inc(m.num_prompt_tokens)
        self._generation_tokens.inc(m.num_generation_tokens)
        if (queue_s := m.queue_s) is not None:
            self._queue.observe(max(queue_s, 0.0))
        if (ttft_s := m.ttft_s) is not None:
            self._ttft.observe(max(ttft_s, 0.0))
        if reason in _COMPLETED:
            if (e2e_s := m.e2e_s) is not None:
                self._e2e.observe(max(e2e_s, 0.0))
            if (tpot_s := m.tpot_s) is not None:
                self._tpot.observe(max(tpot_s, 0.0))

    # ---- errors ------------------------------------------------------------------------------------
    def _safe(self, fn: Callable[..., Any], *args: Any) -> None:
        try:
            fn(*args)
        except Exception:  # noqa: BLE001
            self._on_error()

    def _on_error(self) -> None:
        self.num_errors += 1
        if self.num_errors == 1:
            logger.exception("%s: recording metrics failed (further failures are counted, logged every 1000th)",
                             type(self).__name__)
        elif self.num_errors % 1000 == 0:
            logger.warning("%s: %d metric recording failures so far", type(self).__name__, self.num_errors)


class PrometheusStatLogger(MetricsStatLogger):
    """Engine metrics in a `prometheus_client` registry (its own unless `registry` is given)."""

    def __init__(self, model_name: str, registry: Any = None) -> None:
        make = PrometheusInstruments(model_name, registry)
        self.registry = make.registry
        super().__init__(model_name, make)

    def exposition(self) -> bytes:
        """The registry in Prometheus's text format (what `/metrics` returns)."""
        import prometheus_client as pc

        return pc.generate_latest(self.registry)

    def serve(self, port: int = 0, addr: str = "127.0.0.1") -> tuple[Any, Any]:
        """Serve `/metrics` from a background thread; returns (server, thread): `server.shutdown()`
        stops it, `server.server_address` tells the port when `port` is 0."""
        import prometheus_client as pc

        return pc.start_http_server(port, addr=addr, registry=self.registry)

    def asgi_app(self) -> Any:
        """An ASGI app serving the registry, to mount at `/metrics` in a FastAPI/Starlette app."""
        import prometheus_client as pc

        return pc.make_asgi_app(registry=self.registry)


class RayStatLogger(MetricsStatLogger):
    """Engine metrics through `ray.serve.metrics` (in a Serve replica: with Serve's tags)."""

    def __init__(self, model_name: str, gauge_refresh_interval_s: float = 2.0) -> None:
        self._instruments = RayInstruments(model_name, gauge_refresh_interval_s)
        super().__init__(model_name, self._instruments)

    def close(self) -> None:
        """Stop re-publishing the gauges (they then age out of Ray's exporter)."""
        self._instruments.close()

