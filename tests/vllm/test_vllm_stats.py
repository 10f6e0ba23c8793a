"""The vLLM → our-stats mapping (`backends/vllm_stats.py`) on vLLM's own stats classes (no engine):
attribute drift in a vLLM upgrade fails here, and each mapped number is checked exactly."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from vllm.v1.engine import FinishReason as VFinishReason  # noqa: E402
from vllm.v1.metrics.stats import (  # noqa: E402
    FinishedRequestStats,
    IterationStats,
    PrefixCacheStats,
    SchedulerIterationDetails,
    SchedulerStats,
)

from serve_app.backends.vllm_stats import VLLMStatsBridge, finish_reason, make_vllm_stat_logger  # noqa: E402
from serve_app.metrics.stats import EngineLoad  # noqa: E402
from serve_app.types import FinishReason  # noqa: E402
from tests.vllm.conftest import RecordingLogger  # noqa: E402

pytestmark = pytest.mark.vllm

TOTAL = 40


def step_stats(**details) -> SchedulerStats:
    stats = SchedulerStats(num_running_reqs=3, num_waiting_reqs=2, num_skipped_waiting_reqs=1, kv_cache_usage=0.25,
                           prefix_cache_stats=PrefixCacheStats(requests=1, queries=64, hits=32))
    if details:
        stats.iteration_details = SchedulerIterationDetails(iteration_index=7, **details)
    return stats


def test_finish_reasons():
    assert [finish_reason(r) for r in VFinishReason] == [FinishReason.STOP, FinishReason.LENGTH, FinishReason.ABORT,
                                                        FinishReason.ABORT, FinishReason.STOP]
    assert finish_reason("length") == FinishReason.LENGTH


def test_a_step_becomes_our_scheduler_stats_and_load():
    recorder = RecordingLogger()
    bridge = VLLMStatsBridge([recorder])
    bridge.set_num_total_blocks(TOTAL)
    assert bridge.load == EngineLoad(0.0, TOTAL, TOTAL, 0, 0)  # idle before the first message
    iteration = IterationStats()
    iteration.num_preempted_reqs = 1
    bridge.record(step_stats(num_ctx_requests=1, num_ctx_tokens=100, num_generation_requests=2, num_generation_tokens=2,
                             elapsed_ms=50.0), iteration)
    (step,) = recorder.steps
    assert (step.step_index, step.num_scheduled_seqs, step.num_prefill_tokens, step.num_decode_tokens) == (7, 3, 100, 2)
    assert step.step_duration_s == pytest.approx(0.05)
    assert (step.num_running, step.num_waiting, step.num_preempted) == (3, 3, 1)  # waiting includes the deferred one
    assert (step.kv_cache_usage, step.num_free_blocks, step.num_total_blocks) == (0.25, 30, TOTAL)
    assert (step.prefix_cache_queries, step.prefix_cache_hits) == (64, 32)
    assert bridge.load == EngineLoad(0.25, 30, TOTAL, 3, 3) and bridge.num_updates == 1
    assert recorder.loads == []

    # a stats message without step details (nothing scheduled, e.g. after an abort) only moves the load
    idle = SchedulerStats(kv_cache_usage=0.0)
    bridge.record(idle, None)
    assert len(recorder.steps) == 1 and recorder.loads == [EngineLoad(0.0, TOTAL, TOTAL, 0, 0)]
    assert bridge.num_updates == 2 and bridge.num_errors == 0


def test_a_finished_request_becomes_our_request_metrics():
    recorder = RecordingLogger()
    bridge = VLLMStatsBridge([recorder], TOTAL)
    iteration = IterationStats()
    iteration.finished_requests.append(FinishedRequestStats(
        finish_reason=VFinishReason.LENGTH, e2e_latency=2.0, num_prompt_tokens=10, num_generation_tokens=11,
        queued_time=0.2, prefill_time=0.3, decode_time=1.0, inference_time=1.3, num_cached_tokens=4, num_preemptions=1))
    bridge.record(None, iteration)
    ((reason, m),) = recorder.finished
    assert reason == FinishReason.LENGTH and recorder.steps == []
    assert m.e2e_s == 2.0 and m.ttft_s == pytest.approx(1.0) and m.queue_s == pytest.approx(0.7)
    assert m.tpot_s == pytest.approx(0.1)  # decode time / (tokens - 1), as vLLM's mean_time_per_output_token
    assert (m.num_prompt_tokens, m.num_generation_tokens, m.num_cached_tokens, m.num_preemptions) == (10, 11, 4, 1)


def test_failures_never_reach_the_engine():
    class Broken:
        def record(self, *args):
            raise RuntimeError("exporter down")

    bridge = VLLMStatsBridge([Broken()], TOTAL)
    logger_cls = make_vllm_stat_logger(bridge)
    stat_logger = logger_cls(None, 0)
    stat_logger.record(step_stats(num_ctx_requests=1, num_ctx_tokens=5, num_generation_requests=0, num_generation_tokens=0,
                                  elapsed_ms=1.0), None)
    stat_logger.log_engine_initialized()
    assert bridge.num_errors == 1 and bridge.load.num_running == 3


def test_speculative_decoding_stats_map_to_ours():
    from vllm.v1.spec_decode.metrics import SpecDecodingStats

    recorder = RecordingLogger()
    bridge = VLLMStatsBridge([recorder], TOTAL)
    stats = step_stats(num_ctx_requests=0, num_ctx_tokens=0, num_generation_requests=2, num_generation_tokens=10,
                       elapsed_ms=20.0)
    spec = SpecDecodingStats.new(4)
    spec.observe_draft(num_draft_tokens=4, num_accepted_tokens=3)
    spec.observe_draft(num_draft_tokens=4, num_accepted_tokens=0)
    stats.spec_decoding_stats = spec
    bridge.record(stats, None)
    (step,) = recorder.steps
    assert (step.spec_num_candidates, step.spec_num_seqs, step.spec_num_proposed, step.spec_num_accepted) == (2, 2, 8, 3)
