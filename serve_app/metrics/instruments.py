"""One metric object per `MetricSpec`, with one small interface over two exporters.

- `PrometheusInstruments`: `prometheus_client` metrics in a `CollectorRegistry` (standalone runs).
- `RayInstruments`: `ray.serve.metrics` metrics, exported on Ray's metrics port as `ray_<name>`;
  inside a Serve replica Ray adds the `deployment`, `replica` and `application` labels itself.

Both fix the `model` label at construction; other labels (`finish_reason`, `target_replica`) are
given per call. Neither library is imported at module load.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from typing import Any, Protocol

from serve_app.metrics.names import MODEL_LABEL, MetricSpec

logger = logging.getLogger(__name__)

Labels = Mapping[str, str]
_NO_LABELS: Labels = {}


class Instrument(Protocol):
    """A counter, gauge or histogram; calling the wrong method for its kind raises TypeError."""

    spec: MetricSpec

    def inc(self, value: float = 1.0, labels: Labels = _NO_LABELS) -> None: ...

    def set(self, value: float, labels: Labels = _NO_LABELS) -> None: ...

    def observe(self, value: float, labels: Labels = _NO_LABELS) -> None: ...

    def touch(self, labels: Labels = _NO_LABELS) -> None:
        """Make a counter's series exist (at 0) before its first increment, so that `rate()` over it
        reads 0 instead of "no data"."""


class _Base:
    spec: MetricSpec

    def _check(self, kind: str) -> None:
        if self.spec.kind != kind:
            raise TypeError(f"{self.spec.name} is a {self.spec.kind}, not a {kind}")


class PrometheusInstrument(_Base):
    def __init__(self, spec: MetricSpec, model: str, registry: Any) -> None:
        import prometheus_client as pc

        self.spec = spec
        self.model = model
        kwargs: dict[str, Any] = {"labelnames": spec.label_names, "registry": registry}
        if spec.kind == "counter":
            self._metric = pc.Counter(spec.base_name, spec.help, **kwargs)
        elif spec.kind == "gauge":
            self._metric = pc.Gauge(spec.base_name, spec.help, **kwargs)
        else:
            self._metric = pc.Histogram(spec.base_name, spec.help, buckets=spec.buckets, **kwargs)
        self._children: dict[tuple[str, ...], Any] = {}

    def _child(self, labels: Labels) -> Any:
        key = tuple(labels.get(name, "") for name in self.spec.labels)
        child = self._children.get(key)
        if child is None:
            if set(labels) != set(self.spec.labels):
                raise ValueError(f"{self.spec.name}: labels {sorted(labels)} != {sorted(self.spec.labels)}")
            child = self._children[key] = self._metric.labels(self.model, *key)
        return child

    def inc(self, value: float = 1.0, labels: Labels = _NO_LABELS) -> None:
        self._check("counter")
        if value > 0:
            self._child(labels).inc(value)

    def touch(self, labels: Labels = _NO_LABELS) -> None:
        self._child(labels)  # a labelled child starts at 0 in the exposition

    def set(self, value: float, labels: Labels = _NO_LABELS) -> None:
        self._check("gauge")
        self._child(labels).set(value)

    def observe(self, value: float, labels: Labels = _NO_LABELS) -> None:
        self._check("histogram")
        self._child(labels).observe(value)


class RayInstrument(_Base):
    def __init__(self, spec: MetricSpec, model: str) -> None:
        from ray.serve import metrics as serve_metrics

        self.spec = spec
        self._lock = threading.Lock()
        self._last: dict[tuple[tuple[str, str], ...], float] = {}  # gauges: last value per label set
        tag_keys = spec.label_names
        if spec.kind == "counter":
            self._metric = serve_metrics.Counter(spec.base_name, spec.help, tag_keys=tag_keys)
        elif spec.kind == "gauge":
            self._metric = serve_metrics.Gauge(spec.base_name, spec.help, tag_keys=tag_keys)
        else:
            self._metric = serve_metrics.Histogram(spec.base_name, spec.help, boundaries=list(spec.buckets), tag_keys=tag_keys)
        self._metric.set_default_tags({MODEL_LABEL: model})

    @staticmethod
    def _tags(labels: Labels) -> dict[str, str] | None:
        return dict(labels) if labels else None

    def inc(self, value: float = 1.0, labels: Labels = _NO_LABELS) -> None:
        self._check("counter")
        if value > 0:  # Ray rejects increments <= 0
            self._metric.inc(value, tags=self._tags(labels))

    def touch(self, labels: Labels = _NO_LABELS) -> None:
        # Ray's public Counter.inc refuses 0; its internal record adds 0, which creates the series.
        record = getattr(self._metric, "_record", None)
        if callable(record):
            record(0, tags=self._tags(labels))

    def set(self, value: float, labels: Labels = _NO_LABELS) -> None:
        self._check("gauge")
        self._metric.set(value, tags=self._tags(labels))
        with self._lock:
            self._last[tuple(sorted(labels.items()))] = value

    def refresh(self) -> None:
        """Set every gauge series again to its last value (see `RayInstruments`)."""
        with self._lock:
            last = list(self._last.items())
        for labels, value in last:
            self._metric.set(value, tags=dict(labels) or None)

    def observe(self, value: float, labels: Labels = _NO_LABELS) -> None:
        self._check("histogram")
        self._metric.observe(value, tags=self._tags(labels))


class PrometheusInstruments:
    """Factory of `prometheus_client` instruments in one registry (its own unless one is given)."""

    def __init__(self, model: str, registry: Any = None) -> None:
        import prometheus_client as pc

        self.model = model
        self.registry = registry if registry is not None else pc.CollectorRegistry(auto_describe=True)

    def __call__(self, spec: MetricSpec) -> Instrument:
        return PrometheusInstrument(spec, self.model, self.registry)


class RayInstruments:
    """Factory of `ray.serve.metrics` instruments (Serve tags added by Ray inside a replica).

    Ray (2.60) drops a gauge series that has not been set again for a few export intervals (measured
    here: gone ~10 s after its last `set` with a 1 s report interval), so an idle replica's KV usage
    and queue gauges would vanish (dashboards: "no data"; Prometheus: stale). A daemon thread sets
    every gauge of this factory again to its last value every `refresh_interval_s` (0: never);
    a dead process's series still age out, as Ray intends. `close()` stops the thread.
    """

    def __init__(self, model: str, refresh_interval_s: float = 2.0) -> None:
        self.model = model
        self.refresh_interval_s = refresh_interval_s
        self._gauges: list[RayInstrument] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __call__(self, spec: MetricSpec) -> Instrument:
        instrument = RayInstrument(spec, self.model)
        if spec.kind == "gauge" and self.refresh_interval_s > 0:
            self._gauges.append(instrument)
            if self._thread is None:
                self._thread = threading.Thread(target=self._refresh_loop, name=f"metrics-refresh-{spec.name}", daemon=True)
                self._thread.start()
        return instrument

    def _refresh_loop(self) -> None:
        while not self._stop.wait(self.refresh_interval_s):
            for gauge in list(self._gauges):
                try:
                    gauge.refresh()
                except Exception:  # noqa: BLE001 - keep refreshing the others; never kill the process
                    logger.debug("refreshing %s failed", gauge.spec.name, exc_info=True)

    def close(self) -> None:
        self._stop.set()
