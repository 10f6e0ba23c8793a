"""Metrics test helpers: a recording stat logger (ground truth) and registry readers."""

from __future__ import annotations

import pytest

from serve_app.metrics.stats import SchedulerStats
from serve_app.types import FinishReason, RequestMetrics


class RecordingLogger:
    """Keeps every call the engine makes: the ground truth the exporters are checked against."""

    def __init__(self) -> None:
        self.steps: list[SchedulerStats] = []
        self.finished: list[tuple[FinishReason, RequestMetrics]] = []
        self.num_calls = 0

    def record(self, scheduler_stats, finished) -> None:
        self.num_calls += 1
        if scheduler_stats is not None:
            self.steps.append(scheduler_stats)
        self.finished.extend(finished)


@pytest.fixture()
def recorder() -> RecordingLogger:
    return RecordingLogger()


def sample(registry, name: str, **labels: str) -> float:
    """One sample's value from a prometheus_client registry; 0 for counters/histograms never touched
    would hide bugs, so a missing sample fails."""
    value = registry.get_sample_value(name, labels)
    assert value is not None, f"no sample {name}{labels} in the registry"
    return value
