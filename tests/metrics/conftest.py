"""Metrics test helpers: a recording stat logger (ground truth) and registry readers."""

from __future__ import annotations

import pytest

from tests.recording_logger import RecordingLogger


@pytest.fixture()
def recorder() -> RecordingLogger:
    return RecordingLogger()


def sample(registry, name: str, **labels: str) -> float:
    """One sample's value from a prometheus_client registry; 0 for counters/histograms never touched
    would hide bugs, so a missing sample fails."""
    value = registry.get_sample_value(name, labels)
    assert value is not None, f"no sample {name}{labels} in the registry"
    return value
