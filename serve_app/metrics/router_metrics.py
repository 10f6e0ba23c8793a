"""What a request router records about its decisions (`KVCacheAwareRouter`, `PrefixAwareRouter`, `RoundRobinRouter`).

    metrics = RouterMetrics.for_ray(model_name)            # in the router (inside a DeploymentHandle)
    metrics.record_routed(replica.replica_id.unique_id, stats_age_s=now - sample_time)

- `llm_router_stats_age_seconds{target_replica}`: how old the occupancy sample was that the router
  used for that replica at its latest decision (None: it had no sample, nothing is set).
- `llm_router_routed_requests_total{target_replica}`: requests sent to each replica.
- `llm_router_decisions_total{reason,target_replica}`: decisions by reason (prefix-aware router).
- `llm_router_cached_tokens_abs_error{source,target_replica}` (histogram): |predicted − actual| cached
  prompt tokens per request, once the replica reported what its engine found; and
  `llm_router_predicted_cached_tokens_total` / `llm_router_actual_cached_tokens_total` with the same
  labels (their difference: the signed error).

`target_replica` should be the LLMServer replica's unique id (`RunningReplica.replica_id.unique_id`),
the value Ray Serve puts in the `replica` label of that replica's own metrics, so that dashboards can
line the router's view up with the replica's. Under Ray, the `replica` / `deployment` labels of these
series name the process that routes (e.g. the ingress replica), as Ray adds them itself.

Like the engine loggers, these methods never raise and cost a couple of metric updates.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from serve_app.metrics import names
from serve_app.metrics.instruments import Instrument, PrometheusInstruments, RayInstruments

logger = logging.getLogger(__name__)


class RouterMetrics:
    def __init__(self, model_name: str, make: Callable[[names.MetricSpec], Instrument]) -> None:
        self.model_name = model_name
        self.num_errors = 0
        self._age = make(names.ROUTER_STATS_AGE)
        self._routed = make(names.ROUTER_ROUTED_REQUESTS)
        self._decisions = make(names.ROUTER_DECISIONS)
        self._abs_error = make(names.ROUTER_CACHED_TOKENS_ABS_ERROR)
        self._predicted = make(names.ROUTER_PREDICTED_CACHED_TOKENS)
        self._actual = make(names.ROUTER_ACTUAL_CACHED_TOKENS)
        self._labels: dict[str, dict[str, str]] = {}

    @classmethod
    def for_ray(cls, model_name: str) -> RouterMetrics:
        """Through `ray.serve.metrics`; the age gauges are re-published every 2 s between decisions
        (Ray drops gauges that are not set again for a few seconds)."""
        return cls(model_name, RayInstruments(model_name))

    @classmethod
    def for_registry(cls, model_name: str, registry: Any = None) -> RouterMetrics:
        """prometheus_client metrics (in `registry`, or a new one: `.registry`)."""
        make = PrometheusInstruments(model_name, registry)
        metrics = cls(model_name, make)
        metrics.registry = make.registry
        return metrics

    def _target(self, replica_id: str) -> dict[str, str]:
        labels = self._labels.get(replica_id)
        if labels is None:
            labels = self._labels[replica_id] = {names.TARGET_REPLICA_LABEL: str(replica_id)}
        return labels

    def add_replica(self, replica_id: str) -> None:
        """Start the replica's routed-request count at 0 (call when the router first sees it)."""
        try:
            self._routed.touch(self._target(replica_id))
        except Exception:  # noqa: BLE001
            self._on_error()

    def set_stats_age(self, replica_id: str, age_s: float) -> None:
        try:
            self._age.set(max(float(age_s), 0.0), self._target(replica_id))
        except Exception:  # noqa: BLE001
            self._on_error()

    def record_routed(self, replica_id: str, stats_age_s: float | None = None) -> None:
        """One request routed to `replica_id`, decided on a sample `stats_age_s` old (None: no sample)."""
        try:
            labels = self._target(replica_id)
            self._routed.inc(1, labels)
            if stats_age_s is not None:
                self._age.set(max(float(stats_age_s), 0.0), labels)
        except Exception:  # noqa: BLE001
            self._on_error()

    def record_decision(self, reason: str, replica_id: str) -> None:
        try:
            self._decisions.inc(1, {**self._target(replica_id), names.ROUTING_REASON_LABEL: reason})
        except Exception:  # noqa: BLE001
            self._on_error()

    def record_prediction(self, replica_id: str, predicted_tokens: int, actual_tokens: int, source: str = "exact") -> None:
        """One request's predicted vs the engine's actual cached prompt tokens on `replica_id`."""
        try:
            labels = {**self._target(replica_id), names.PREDICTION_SOURCE_LABEL: source}
            self._abs_error.observe(abs(predicted_tokens - actual_tokens), labels)
            for counter, value in ((self._predicted, predicted_tokens), (self._actual, actual_tokens)):
                if value > 0:  # Ray's counters take positive increments only
                    counter.inc(value, labels)
                else:
                    counter.touch(labels)
        except Exception:  # noqa: BLE001
            self._on_error()

    def _on_error(self) -> None:
        self.num_errors += 1
        if self.num_errors == 1:
            logger.exception("RouterMetrics: recording failed (further failures are only counted)")
