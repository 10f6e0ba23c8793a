"""LLMServer autoscaling settings (`ServeConfig.autoscaling`), free of Ray: validated once, then handed
to Serve as the deployment's `autoscaling_config` (instead of a fixed `num_replicas`).

Serve's request-based autoscaler keeps the number of ongoing requests per replica (running in the
engine + queued at the callers' handles) near `target_ongoing_requests`, between `min_replicas` and
`max_replicas`; `upscale_delay_s` / `downscale_delay_s` are how long a decision must hold before it is
applied. For an LLM replica, `target_ongoing_requests` is the concurrency at which one engine still
meets the latency goal (TTFT, inter-token latency) — well below `max_ongoing_requests`, which is the
hard per-replica admission cap — and a new replica takes as long to start as its model takes to load,
so scale up early and down slowly. Each replica asks for `num_gpus_per_replica` GPUs: on a cluster
with the Ray autoscaler (KubeRay `enableInTreeAutoscaling`, or the cluster launcher) a replica that
does not fit makes Ray add a GPU node.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

AGGREGATION_FUNCTIONS = ("mean", "max", "min")


def _require(cond: bool, name: str, msg: str) -> None:
    if not cond:
        raise ValueError(f"autoscaling.{name}: {msg}")


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


@dataclass(frozen=True)
class AutoscalingSettings:
    """Serve `AutoscalingConfig` fields we expose (same names, same meaning); unknown names raise."""

    max_replicas: int
    target_ongoing_requests: float
    min_replicas: int = 1
    initial_replicas: int | None = None  # None: start with min_replicas
    upscale_delay_s: float = 30.0
    downscale_delay_s: float = 600.0
    downscale_to_zero_delay_s: float | None = None  # only with min_replicas 0 (None: downscale_delay_s)
    look_back_period_s: float = 30.0  # window the per-replica load is averaged over
    upscaling_factor: float | None = None  # gain on each upscaling decision (None: 1)
    downscaling_factor: float | None = None  # gain on each downscaling decision (None: 1)
    aggregation_function: str = "mean"  # mean | max | min over the look-back window

    def __post_init__(self) -> None:
        for name in ("min_replicas", "max_replicas"):
            value = getattr(self, name)
            _require(isinstance(value, int) and not isinstance(value, bool) and value >= 0, name, "must be an integer >= 0")
        _require(self.max_replicas >= max(1, self.min_replicas), "max_replicas", f"must be >= 1 and >= min_replicas ({self.min_replicas})")
        if self.initial_replicas is not None:
            _require(isinstance(self.initial_replicas, int) and not isinstance(self.initial_replicas, bool)
                     and self.min_replicas <= self.initial_replicas <= self.max_replicas, "initial_replicas",
                     f"must be an integer in [min_replicas, max_replicas] = [{self.min_replicas}, {self.max_replicas}]")
        _require(_is_number(self.target_ongoing_requests) and self.target_ongoing_requests > 0, "target_ongoing_requests", "must be > 0")
        for name in ("upscale_delay_s", "downscale_delay_s", "look_back_period_s"):
            _require(_is_number(getattr(self, name)) and getattr(self, name) >= 0, name, "must be >= 0 seconds")
        _require(self.look_back_period_s > 0, "look_back_period_s", "must be > 0 seconds")
        if self.downscale_to_zero_delay_s is not None:
            _require(_is_number(self.downscale_to_zero_delay_s) and self.downscale_to_zero_delay_s >= 0,
                     "downscale_to_zero_delay_s", "must be >= 0 seconds")
            _require(self.min_replicas == 0, "downscale_to_zero_delay_s", "only applies with min_replicas 0")
        for name in ("upscaling_factor", "downscaling_factor"):
            value = getattr(self, name)
            _require(value is None or (_is_number(value) and value > 0), name, "must be > 0")
        _require(self.aggregation_function in AGGREGATION_FUNCTIONS, "aggregation_function",
                 f"must be one of {AGGREGATION_FUNCTIONS}, got {self.aggregation_function!r}")

    @classmethod
    def from_kwargs(cls, kwargs: dict[str, Any]) -> AutoscalingSettings:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ValueError(f"autoscaling.{unknown[0]}: not an autoscaling option (known: {', '.join(sorted(known))})")
        for name in ("max_replicas", "target_ongoing_requests"):
            if name not in kwargs:
                raise ValueError(f"autoscaling.{name}: required when autoscaling is set")
        return cls(**kwargs)

    def to_serve(self) -> dict[str, Any]:
        """Serve's `autoscaling_config` (unset optional fields left to Serve's defaults)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}
