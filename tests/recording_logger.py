"""A stat logger that keeps every call an engine or backend makes: the ground truth exporters, batch
sizes and speculation counts are checked against (tests, and the benchmarks' step records)."""

from __future__ import annotations

from serve_app.metrics.stats import SchedulerStats
from serve_app.types import FinishReason, RequestMetrics


class RecordingLogger:
    """`steps`: every step's SchedulerStats; `finished`: every finished request's (reason, metrics)."""

    def __init__(self) -> None:
        self.steps: list[SchedulerStats] = []
        self.finished: list[tuple[FinishReason, RequestMetrics]] = []
        self.num_calls = 0

    def record(self, scheduler_stats, finished) -> None:
        self.num_calls += 1
        if scheduler_stats is not None:
            self.steps.append(scheduler_stats)
        self.finished.extend(finished)
