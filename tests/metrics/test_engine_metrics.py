"""Known traffic through the real engine → exact metric values in the prometheus_client exporter.

The engine is the real one (`LLM(...)` offline, the SmolLM2 model); the ground truth is what the
engine itself reports (a recording logger next to the exporter, each output's `RequestMetrics`) and
what the traffic implies (N requests × k tokens).
"""

from __future__ import annotations

import random
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from serve_app.metrics import names
from serve_app.metrics.loggers import PrometheusStatLogger
from serve_app.types import FinishReason, GenerateRequest, SamplingParams
from tests.metrics.conftest import sample

MODEL = "smollm2-135m-instruct"


@pytest.fixture(autouse=True)
def one_torch_thread():
    """One intra-op thread: on a shared 2-core machine two spinning OpenMP threads per process are
    10x slower than one. The metric values do not depend on it."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def distinct_prompts(n: int, base_len: int, seed: int = 0) -> list[list[int]]:
    """Token-id prompts of different lengths sharing no leading block (no prefix-cache hits)."""
    rng = random.Random(seed)
    return [[rng.randrange(1000, 40000) for _ in range(base_len + i)] for i in range(n)]


def test_known_traffic_exact_values(model_dir, recorder):
    from serve_app.engine import LLM

    n, k = 4, 5
    metrics = PrometheusStatLogger(MODEL)
    reg = metrics.registry
    llm = LLM(model_dir, dtype="float32", num_blocks=64, stat_loggers=[metrics, recorder])

    # idle engine: gauges at 0, counters present at 0 (rate() reads 0 rather than "no data")
    assert sample(reg, "llm_kv_cache_usage_ratio", model=MODEL) == 0
    assert sample(reg, "llm_num_requests_running", model=MODEL) == 0
    for reason in FinishReason:
        assert sample(reg, "llm_request_success_total", model=MODEL, finish_reason=str(reason)) == 0
    assert sample(reg, "llm_generation_tokens_total", model=MODEL) == 0
    # the paths the runner chose (fp32: no invariance claimed, the self-check still ran)
    paths = llm.engine.core.model_runner.paths
    assert sample(reg, "llm_engine_execution_paths", model=MODEL, **paths.labels) == 1
    assert paths.labels["batch_invariant"] == "false" and paths.labels["self_check"] == "passed"

    prompts = distinct_prompts(n, base_len=9)
    steps: list[int] = []
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=k, ignore_eos=True),
                        on_step=lambda _: steps.append(1))
    num_steps = len(steps)
    assert all(len(o.token_ids) == k and o.finish_reason == FinishReason.LENGTH for o in outs)
    assert num_steps == len(recorder.steps) >= k  # every step ran a batch and reported it

    # requests
    assert sample(reg, "llm_request_success_total", model=MODEL, finish_reason="length") == n
    assert sample(reg, "llm_request_success_total", model=MODEL, finish_reason="stop") == 0
    assert sample(reg, "llm_request_success_total", model=MODEL, finish_reason="abort") == 0
    assert sample(reg, "llm_generation_tokens_total", model=MODEL) == n * k
    assert sample(reg, "llm_prompt_tokens_total", model=MODEL) == sum(map(len, prompts))
    for name in ("llm_time_to_first_token_seconds", "llm_e2e_request_latency_seconds",
                 "llm_request_queue_time_seconds", "llm_time_per_output_token_seconds"):
        assert sample(reg, f"{name}_count", model=MODEL) == n, name
    assert sample(reg, "llm_time_to_first_token_seconds_sum", model=MODEL) == pytest.approx(
        sum(o.metrics.ttft_s for o in outs))
    assert sample(reg, "llm_e2e_request_latency_seconds_sum", model=MODEL) == pytest.approx(
        sum(o.metrics.e2e_s for o in outs))
    assert sample(reg, "llm_time_per_output_token_seconds_sum", model=MODEL) == pytest.approx(
        sum(o.metrics.tpot_s for o in outs))
    # +Inf bucket == count, and the TTFT buckets reach minutes
    assert sample(reg, "llm_time_to_first_token_seconds_bucket", model=MODEL, le="+Inf") == n
    assert sample(reg, "llm_time_to_first_token_seconds_bucket", model=MODEL, le="600.0") == n

    # steps: one observation per engine step; each request is in 1 prefill step + k-1 decode steps
    assert sample(reg, "llm_step_batch_size_count", model=MODEL) == num_steps
    assert sample(reg, "llm_step_duration_seconds_count", model=MODEL) == num_steps
    assert sample(reg, "llm_step_num_tokens_count", model=MODEL) == num_steps
    assert sample(reg, "llm_step_batch_size_sum", model=MODEL) == n * k == sum(s.num_scheduled_seqs for s in recorder.steps)
    assert sample(reg, "llm_step_num_tokens_sum", model=MODEL) == sum(map(len, prompts)) + n * (k - 1)
    assert sample(reg, "llm_step_duration_seconds_sum", model=MODEL) == pytest.approx(
        sum(s.step_duration_s for s in recorder.steps))
    # the first step runs all n prompts together: batch size n lands in the le=4 bucket, not le=2
    assert sample(reg, "llm_step_batch_size_bucket", model=MODEL, le="2.0") < num_steps
    assert sample(reg, "llm_step_batch_size_bucket", model=MODEL, le="4.0") == num_steps

    # no KV pressure, no shared prefixes
    assert sample(reg, "llm_num_preemptions_total", model=MODEL) == 0
    assert sample(reg, "llm_prefix_cache_hits_total", model=MODEL) == 0
    assert sample(reg, "llm_prefix_cache_queries_total", model=MODEL) == sum(s.prefix_cache_queries for s in recorder.steps)

    # idle again: the cache is empty and the queues drained
    assert sample(reg, "llm_kv_cache_usage_ratio", model=MODEL) == 0
    assert sample(reg, "llm_num_requests_running", model=MODEL) == 0
    assert sample(reg, "llm_num_requests_waiting", model=MODEL) == 0
    assert metrics.num_errors == 0


@pytest.mark.heavy  # the real model through preemption, cache hits and aborts: about 3.5 s
def test_preemption_prefix_cache_and_abort(model_dir, recorder):
    """KV pressure → preemptions; a repeated prompt → prefix-cache hits; an abort → finish_reason=abort
    with TTFT/queue recorded but no e2e/TPOT. Gauges follow the scheduler while it is busy."""
    from serve_app.engine import LLM

    metrics = PrometheusStatLogger(MODEL)
    reg = metrics.registry
    # 6 blocks of 8 tokens; 3 requests of 10 + 10 tokens need 3 blocks each: someone gets preempted
    llm = LLM(model_dir, dtype="float32", block_size=8, num_blocks=6, stat_loggers=[metrics, recorder])
    prompts = distinct_prompts(3, base_len=10, seed=1)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))
    preemptions = sum(o.metrics.num_preemptions for o in outs)
    assert preemptions > 0
    assert sample(reg, "llm_num_preemptions_total", model=MODEL) == preemptions == sum(s.num_preempted for s in recorder.steps)
    assert max(s.kv_cache_usage for s in recorder.steps) == 1.0  # the pressure was real
    assert max(s.num_waiting for s in recorder.steps) >= 1
    assert sample(reg, "llm_generation_tokens_total", model=MODEL) == 30

    # the same 16-token prompt twice: the second run reuses its first full block (8 tokens)
    prompt = distinct_prompts(1, base_len=16, seed=2)[0]
    llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
    hits_before = sample(reg, "llm_prefix_cache_hits_total", model=MODEL)
    again = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))[0]
    assert again.metrics.num_cached_tokens >= 8
    assert sample(reg, "llm_prefix_cache_hits_total", model=MODEL) - hits_before == again.metrics.num_cached_tokens
    assert sample(reg, "llm_prefix_cache_hits_total", model=MODEL) == sum(s.prefix_cache_hits for s in recorder.steps)
    assert sample(reg, "llm_prefix_cache_queries_total", model=MODEL) == sum(s.prefix_cache_queries for s in recorder.steps)

    # abort after the first token: the gauges show the running request, then the abort is counted
    e2e_before = sample(reg, "llm_e2e_request_latency_seconds_count", model=MODEL)
    ttft_before = sample(reg, "llm_time_to_first_token_seconds_count", model=MODEL)
    engine = llm.engine
    engine.add_request(GenerateRequest("to-abort", prompt=prompts[0], sampling_params=SamplingParams(max_tokens=30, ignore_eos=True)))
    engine.step()
    assert sample(reg, "llm_num_requests_running", model=MODEL) == 1
    assert sample(reg, "llm_kv_cache_usage_ratio", model=MODEL) == pytest.approx(2 / 6)  # 10 prompt tokens → 2 blocks
    engine.abort(["to-abort"])
    assert sample(reg, "llm_request_success_total", model=MODEL, finish_reason="abort") == 1
    assert sample(reg, "llm_time_to_first_token_seconds_count", model=MODEL) == ttft_before + 1
    assert sample(reg, "llm_e2e_request_latency_seconds_count", model=MODEL) == e2e_before
    assert sample(reg, "llm_request_success_total", model=MODEL, finish_reason="length") == 5
    # the engine is idle now and takes no further step: the gauges must say so already
    assert sample(reg, "llm_num_requests_running", model=MODEL) == 0
    assert sample(reg, "llm_kv_cache_usage_ratio", model=MODEL) == 0
    assert metrics.num_errors == 0


def test_standalone_metrics_route_serves_every_engine_metric():
    """`PrometheusStatLogger.serve()` exposes `/metrics` with every engine metric (names.py) and the
    model label, before any traffic."""
    metrics = PrometheusStatLogger(MODEL)
    server, thread = metrics.serve(port=0)
    try:
        port = server.server_address[1]
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
            assert resp.status == 200
            text = resp.read().decode()
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for spec in names.ENGINE_METRICS:
        family = families.get(spec.base_name)
        assert family is not None, f"{spec.name} missing from /metrics"
        assert family.type == spec.kind, spec.name
        assert family.documentation == spec.help
    # series that exist before traffic all carry the model label
    series = [s for f in families.values() for s in f.samples if s.name.startswith("llm_")]
    assert series and all(s.labels.get("model") == MODEL for s in series)


def test_exporter_never_raises_into_the_engine(caplog):
    """A broken metric backend or malformed stats are logged and counted, never raised."""

    class Broken:
        def __init__(self, spec):
            self.spec = spec

        def inc(self, *a, **k):
            raise RuntimeError("backend down")

        touch = set = observe = inc

    from serve_app.metrics.loggers import MetricsStatLogger

    logger = MetricsStatLogger(MODEL, Broken)
    errors_at_start = logger.num_errors  # initial touch/set calls failed too
    assert errors_at_start > 0
    logger.record(None, [(FinishReason.LENGTH, object())])  # type: ignore[list-item]
    assert logger.num_errors == errors_at_start + 1
    good = PrometheusStatLogger(MODEL)
    good.record(object(), [])  # type: ignore[arg-type] - not a SchedulerStats
    assert good.num_errors == 1
    assert "recording metrics failed" in caplog.text


def test_ray_logger_outside_ray_is_harmless():
    """Without a Ray cluster (e.g. an engine started by a test) the Ray logger records nothing and
    raises nothing."""
    from serve_app.metrics.loggers import RayStatLogger
    from serve_app.metrics.stats import SchedulerStats
    from serve_app.types import RequestMetrics

    logger = RayStatLogger(MODEL)
    stats = SchedulerStats(0, 0.0, 0.01, 2, 10, 1, 2, 0, 1, 0.5, 4, 8, 10, 8)
    logger.record(stats, [(FinishReason.STOP, RequestMetrics(0.0, 0.1, 0.2, 0.5, 10, 3))])
    assert logger.num_errors == 0
    logger.close()  # stops the gauge re-publishing thread
