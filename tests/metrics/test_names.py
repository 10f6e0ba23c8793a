"""The metric names module: exactly the documented names (docs/architecture.md), valid specs, buckets reaching minutes;
and the router metrics API."""

from __future__ import annotations

import pytest

from serve_app.metrics import names
from serve_app.metrics.router_metrics import RouterMetrics
from tests.metrics.conftest import sample

# the documented table, row by row (a rename there or here must be deliberate)
DOCUMENTED_TABLE = {
    "llm_step_batch_size": "histogram",
    "llm_step_num_tokens": "histogram",
    "llm_step_duration_seconds": "histogram",
    "llm_time_to_first_token_seconds": "histogram",
    "llm_time_per_output_token_seconds": "histogram",
    "llm_e2e_request_latency_seconds": "histogram",
    "llm_request_queue_time_seconds": "histogram",
    "llm_kv_cache_usage_ratio": "gauge",
    "llm_num_requests_running": "gauge",
    "llm_num_requests_waiting": "gauge",
    "llm_num_preemptions_total": "counter",
    "llm_prompt_tokens_total": "counter",
    "llm_generation_tokens_total": "counter",
    "llm_prefix_cache_queries_total": "counter",
    "llm_prefix_cache_hits_total": "counter",
    "llm_request_success_total": "counter",
    "llm_router_stats_age_seconds": "gauge",
    "llm_spec_proposed_tokens_total": "counter",
    "llm_spec_accepted_tokens_total": "counter",
    "llm_spec_verified_requests_total": "counter",
    "llm_spec_decode_requests_total": "counter",
    "llm_engine_execution_paths": "gauge",
    "llm_grammar_compile_seconds": "histogram",
    "llm_grammar_mask_seconds": "histogram",
}


def test_names_are_the_design_table():
    assert {m.name: m.kind for m in names.ENGINE_METRICS + (names.ROUTER_STATS_AGE,)} == DOCUMENTED_TABLE
    extra = {m.name for m in names.ALL_METRICS} - set(DOCUMENTED_TABLE)
    assert extra == {"llm_router_routed_requests_total", "llm_router_decisions_total", "llm_router_cached_tokens_abs_error",
                     "llm_router_predicted_cached_tokens_total", "llm_router_actual_cached_tokens_total",
                     "llm_api_requests_total"}
    assert len({m.name for m in names.ALL_METRICS}) == len(names.ALL_METRICS)
    assert names.REQUEST_SUCCESS.labels == ("finish_reason",)
    assert all(m.label_names[0] == "model" for m in names.ALL_METRICS)
    assert all(m.help.isascii() for m in names.ALL_METRICS)  # Ray's metrics refuse anything else
    # Ray's histograms take positive bucket boundaries only
    assert all(m.buckets[0] > 0 for m in names.ALL_METRICS if m.kind == "histogram")


def test_buckets():
    assert names.STEP_BATCH_SIZE.buckets == (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
    for spec in (names.TIME_TO_FIRST_TOKEN, names.REQUEST_QUEUE_TIME, names.E2E_REQUEST_LATENCY):
        assert spec.buckets[-1] >= 600, f"{spec.name} must reach minutes"
        assert spec.buckets[0] <= 0.01
    assert names.STEP_DURATION.buckets[0] <= 0.001


@pytest.mark.parametrize("bad", [
    dict(name="llm-x", kind="gauge", help=""),
    dict(name="llm_x", kind="counter", help=""),
    dict(name="llm_x_total", kind="gauge", help=""),
    dict(name="llm_x", kind="histogram", help=""),
    dict(name="llm_x", kind="histogram", help="", buckets=(2.0, 1.0)),
])
def test_invalid_specs_raise(bad):
    with pytest.raises(ValueError):
        names.MetricSpec(**bad)


def test_series_names():
    assert names.series_to_metric("ray_llm_time_to_first_token_seconds_bucket") is names.TIME_TO_FIRST_TOKEN
    assert names.series_to_metric("llm_request_success_total") is names.REQUEST_SUCCESS
    assert names.series_to_metric("ray_llm_kv_cache_usage_ratio_bucket") is None  # a gauge has no buckets
    assert names.series_to_metric("ray_llm_nope") is None
    assert names.STEP_BATCH_SIZE.series_names("ray_") == (
        "ray_llm_step_batch_size_bucket", "ray_llm_step_batch_size_sum", "ray_llm_step_batch_size_count")


def test_router_metrics_api():
    metrics = RouterMetrics.for_registry("m")
    reg = metrics.registry
    metrics.add_replica("r1")
    assert sample(reg, "llm_router_routed_requests_total", model="m", target_replica="r1") == 0
    metrics.record_routed("r1", stats_age_s=0.4)
    metrics.record_routed("r1", stats_age_s=0.7)
    metrics.record_routed("r2", stats_age_s=None)  # no sample: counted, no age
    metrics.set_stats_age("r2", -1.0)  # clock skew never shows as a negative age
    assert sample(reg, "llm_router_routed_requests_total", model="m", target_replica="r1") == 2
    assert sample(reg, "llm_router_routed_requests_total", model="m", target_replica="r2") == 1
    assert sample(reg, "llm_router_stats_age_seconds", model="m", target_replica="r1") == 0.7
    assert sample(reg, "llm_router_stats_age_seconds", model="m", target_replica="r2") == 0.0
    metrics.record_routed("r1", stats_age_s="not a number")  # type: ignore[arg-type]
    assert metrics.num_errors == 1
