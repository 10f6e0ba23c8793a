"""What the HTTP API records: one count per response, by tenant and status code.

    metrics = APIMetrics.for_ray(model_name)        # in the ingress replica
    metrics.record("team-a", 200)

`llm_api_requests_total{tenant,status}`: the tenant is the name the API-key file gives a key
(`anonymous` without keys, `unauthenticated` for a missing or wrong key); a key never becomes a
label. Like the other loggers, `record` never raises.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from serve_app.metrics import names
from serve_app.metrics.instruments import Instrument, PrometheusInstruments, RayInstruments


class APIMetrics:
    def __init__(self, make: Callable[[names.MetricSpec], Instrument]) -> None:
        self._requests = make(names.API_REQUESTS)

    @classmethod
    def for_ray(cls, model_name: str) -> APIMetrics:
        return cls(RayInstruments(model_name, refresh_interval_s=0))

    @classmethod
    def for_registry(cls, model_name: str, registry: Any = None) -> APIMetrics:
        make = PrometheusInstruments(model_name, registry)
        metrics = cls(make)
        metrics.registry = make.registry
        return metrics

    def record(self, tenant: str, status: int) -> None:
        try:
            self._requests.inc(1.0, {names.TENANT_LABEL: tenant, names.STATUS_LABEL: str(status)})
        except Exception:  # noqa: BLE001 - metrics never fail a request
            pass
