"""vLLM's engine statistics mapped onto ours, so one set of exporters, one dashboard and one router
serve both backends.

vLLM's `AsyncLLM` calls its stat loggers (`vllm.v1.metrics.loggers.StatLoggerBase`) from its output
handler, on the replica's event loop, once per batch of engine-core outputs, with:
- `SchedulerStats` (made after each engine step): running / waiting requests, `kv_cache_usage`,
  prefix-cache queries and hits, and, with `enable_logging_iteration_details`, the step's
  `iteration_details` (requests and tokens in prefill and in decode, elapsed time);
- `IterationStats`: preemptions seen in these outputs and `finished_requests`
  (`FinishedRequestStats`: e2e latency, prefill / decode / queued time, token counts).

`VLLMStatsBridge.record` turns them into this repository's `metrics.stats.SchedulerStats` and
`(FinishReason, RequestMetrics)` pairs and hands them to our stat loggers (`RayStatLogger`, ...),
which export the names in `metrics.names`. It also keeps the latest load (`EngineLoad`) for
`routing_stats()`: vLLM's engine core runs in another process, so the frontend's only cheap view of
its load is the last stats message (one per engine step; a step also follows every abort).

Mapping (vLLM → ours):
- a step with iteration details → `SchedulerStats`: batch size = prefill + decode requests, tokens =
  prefill + decode tokens, duration = vLLM's measured step time (model execution + sampling);
  a stats message without details (no tokens scheduled) only updates the gauges (`record_load`);
- speculative decoding: vLLM's `spec_decoding_stats` (drafts, draft tokens, accepted tokens) → our
  `spec_*` step fields, hence the same speculation metrics;
- `num_waiting` = vLLM's waiting + deferred-waiting requests; free / total blocks come from
  `kv_cache_usage` and the engine's usable block count (vLLM reserves one null block);
- a finished request → `RequestMetrics` on a clock starting at its arrival (0): finished = e2e
  latency, first token = e2e − decode time, first scheduled = first token − prefill time (so TTFT,
  queue time, e2e and TPOT mean what they mean for the native engine: measured from the arrival at
  the engine's frontend). vLLM reports no stats for aborted requests: the backend records those
  itself (`record_aborted`), from its own timings.

Nothing here imports vllm: vLLM's stats are read by attribute name. `make_vllm_stat_logger` (which
does import it) wraps a bridge in a `StatLoggerBase` subclass for `AsyncLLM(stat_loggers=...)`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from serve_app.metrics.stats import EngineLoad, SchedulerStats
from serve_app.types import FinishReason, RequestMetrics

logger = logging.getLogger(__name__)

# vLLM's FinishReason (an IntEnum whose str() is the OpenAI name) → ours
_FINISH_REASONS = {"stop": FinishReason.STOP, "length": FinishReason.LENGTH, "abort": FinishReason.ABORT,
                   "error": FinishReason.ABORT, "repetition": FinishReason.STOP}


def finish_reason(vllm_reason: Any) -> FinishReason:
    """vLLM's finish reason (enum or string) as ours; anything unknown counts as an abort."""
    name = str(vllm_reason).lower().rsplit(".", 1)[-1]
    return _FINISH_REASONS.get(name, FinishReason.ABORT)


def engine_load(vllm_stats: Any, num_total_blocks: int) -> EngineLoad:
    """A vLLM `SchedulerStats` as our `EngineLoad` (routing stats and gauges)."""
    usage = min(max(float(vllm_stats.kv_cache_usage), 0.0), 1.0)
    num_used = round(usage * num_total_blocks)
    return EngineLoad(
        kv_cache_usage=usage,
        num_free_blocks=num_total_blocks - num_used,
        num_total_blocks=num_total_blocks,
        num_running=int(vllm_stats.num_running_reqs),
        num_waiting=int(vllm_stats.num_waiting_reqs) + int(getattr(vllm_stats, "num_skipped_waiting_reqs", 0) or 0),
    )


def scheduler_stats(vllm_stats: Any, load: EngineLoad, num_preempted: int, step_index: int) -> SchedulerStats | None:
    """One engine step as our `SchedulerStats`; None when vLLM sent no iteration details (a stats
    message for a step that scheduled no tokens, or details turned off)."""
    details = getattr(vllm_stats, "iteration_details", None)
    if details is None or getattr(details, "is_dummy", False):
        return None
    duration_s = max(float(details.elapsed_ms), 0.0) / 1000.0
    prefix = vllm_stats.prefix_cache_stats
    return SchedulerStats(
        step_index=int(getattr(details, "iteration_index", step_index)),
        step_start_time=time.monotonic() - duration_s,
        step_duration_s=duration_s,
        num_scheduled_seqs=int(details.num_ctx_requests) + int(details.num_generation_requests),
        num_prefill_tokens=int(details.num_ctx_tokens),
        num_decode_tokens=int(details.num_generation_tokens),
        num_running=load.num_running,
        num_waiting=load.num_waiting,
        num_preempted=num_preempted,
        kv_cache_usage=load.kv_cache_usage,
        num_free_blocks=load.num_free_blocks,
        num_total_blocks=load.num_total_blocks,
        prefix_cache_queries=int(prefix.queries) if prefix is not None else 0,
        prefix_cache_hits=int(prefix.hits) if prefix is not None else 0,
        **spec_decode_stats(getattr(vllm_stats, "spec_decoding_stats", None)),
    )


def spec_decode_stats(spec: Any) -> dict[str, int]:
    """vLLM's per-step `SpecDecodingStats` as our `SchedulerStats.spec_*` fields (vLLM verifies every
    decoding request that got a draft, so its drafts are both the candidates and the verified ones)."""
    if spec is None:
        return {}
    num_drafts = int(spec.num_drafts)
    return {"spec_num_candidates": num_drafts, "spec_num_seqs": num_drafts,
            "spec_num_proposed": int(spec.num_draft_tokens), "spec_num_accepted": int(spec.num_accepted_tokens)}


def request_metrics(finished: Any) -> tuple[FinishReason, RequestMetrics]:
    """A vLLM `FinishedRequestStats` as ours, on a clock that starts at the request's arrival."""
    e2e_s = max(float(finished.e2e_latency), 0.0)
    first_token_s = min(max(e2e_s - float(finished.decode_time), 0.0), e2e_s)
    first_scheduled_s = min(max(first_token_s - float(finished.prefill_time), 0.0), first_token_s)
    metrics = RequestMetrics(
        arrival_time=0.0,
        first_scheduled_time=first_scheduled_s,
        first_token_time=first_token_s if finished.num_generation_tokens > 0 else None,
        finished_time=e2e_s,
        num_prompt_tokens=int(finished.num_prompt_tokens),
        num_generation_tokens=int(finished.num_generation_tokens),
        num_cached_tokens=int(getattr(finished, "num_cached_tokens", 0) or 0),
        num_preemptions=int(finished.num_preemptions),
    )
    return finish_reason(finished.finish_reason), metrics


class VLLMStatsBridge:
    """Receives vLLM's stats (through `make_vllm_stat_logger`), feeds our stat loggers and keeps
    the latest load. Like our loggers it never raises into the engine: failures are logged and
    counted in `num_errors`.

    `num_total_blocks` is set by the backend once the engine has sized its KV cache; until the first
    stats message the load is "idle" (every block free).
    """

    def __init__(self, stat_loggers: Sequence[Any] = (), num_total_blocks: int = 0) -> None:
        self.stat_loggers = list(stat_loggers)
        self.num_total_blocks = num_total_blocks
        self.load = EngineLoad(0.0, num_total_blocks, num_total_blocks, 0, 0)
        self.num_steps = 0  # stats messages with a step's details
        self.num_updates = 0  # stats messages (the load changed, or may have)
        self.last_update = time.monotonic()  # when the last one came (vLLM sends one per engine step)
        self.num_errors = 0
        self._pending_preemptions = 0

    def set_num_total_blocks(self, num_total_blocks: int) -> None:
        self.num_total_blocks = num_total_blocks
        self.load = EngineLoad(self.load.kv_cache_usage, num_total_blocks - round(self.load.kv_cache_usage * num_total_blocks),
                               num_total_blocks, self.load.num_running, self.load.num_waiting)

    def record(self, vllm_scheduler_stats: Any, vllm_iteration_stats: Any) -> None:
        """One call of vLLM's stat-logger hook."""
        try:
            finished = []
            if vllm_iteration_stats is not None:
                self._pending_preemptions += int(vllm_iteration_stats.num_preempted_reqs)
                finished = [request_metrics(f) for f in vllm_iteration_stats.finished_requests]
            step = None
            if vllm_scheduler_stats is not None:
                self.num_updates += 1
                self.last_update = time.monotonic()
                self.load = engine_load(vllm_scheduler_stats, self.num_total_blocks)
                step = scheduler_stats(vllm_scheduler_stats, self.load, self._pending_preemptions, self.num_steps)
                if step is not None:
                    self.num_steps += 1
                    self._pending_preemptions = 0
            if step is not None or finished:
                self._each("record", step, finished)
            if vllm_scheduler_stats is not None and step is None:
                self._each("record_load", self.load)
        except Exception:  # noqa: BLE001 - a metrics failure must never stop the engine
            self._on_error()

    def record_aborted(self, metrics: RequestMetrics) -> None:
        """A request vLLM aborted (client disconnect, `abort()`): vLLM's stats omit those."""
        try:
            self._each("record", None, [(FinishReason.ABORT, metrics)])
        except Exception:  # noqa: BLE001
            self._on_error()

    def record_paths(self, labels: dict[str, str]) -> None:
        """What runs the model (the labels of `llm_engine_execution_paths`), once at start."""
        try:
            self._each("record_paths", labels)
        except Exception:  # noqa: BLE001
            self._on_error()

    def _each(self, method: str, *args: Any) -> None:
        for stat_logger in self.stat_loggers:
            fn: Callable[..., Any] | None = getattr(stat_logger, method, None)
            if fn is not None:
                fn(*args)

    def _on_error(self) -> None:
        self.num_errors += 1
        if self.num_errors == 1:
            logger.exception("mapping vLLM stats failed (further failures are counted)")


def make_vllm_stat_logger(bridge: VLLMStatsBridge) -> Callable[[Any, int], Any]:
    """A vLLM per-engine stat-logger factory (`AsyncLLM(stat_loggers=[...])`) that feeds `bridge`."""
    from vllm.v1.metrics.loggers import StatLoggerBase

    class BridgeStatLogger(StatLoggerBase):
        def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
            self.engine_index = engine_index

        def record(self, scheduler_stats: Any, iteration_stats: Any, mm_cache_stats: Any = None, engine_idx: int = 0) -> None:
            bridge.record(scheduler_stats, iteration_stats)

        def log_engine_initialized(self) -> None:
            pass

    return BridgeStatLogger
