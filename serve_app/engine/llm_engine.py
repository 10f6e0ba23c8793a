"""LLMEngine: the synchronous engine (input processing + EngineCore + output processing + stats).

Both front ends drive it: `LLM` (offline, in the caller's thread) and `AsyncLLMEngine` (from its
background thread). Not thread-safe.

A failure belongs to its request: if admitting, sampling or detokenizing one request raises, that
request is aborted (its blocks freed) and its last `RequestOutput` carries the `RequestFailedError`;
the step's other requests go on. `fault_hook` (tests only, serve_app/faults.py) injects such failures.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

from serve_app.engine.config import EngineConfig
from serve_app.engine.engine_core import EngineCore
from serve_app.engine.grammar import check_structured
from serve_app.engine.output_processor import OutputProcessor
from serve_app.engine.outputs import EngineCoreOutput
from serve_app.engine.request import Request
from serve_app.faults import FaultHook, Stage
from serve_app.input_processor import InputProcessor
from serve_app.metrics.stats import EngineLoad, SchedulerStats
from serve_app.types import FinishReason, GenerateRequest, RequestFailedError, RequestMetrics, RequestOutput


class StatLogger(Protocol):
    """Receives every step's stats and every finished request's metrics (plain data).

    A logger may also define `record_load(load: EngineLoad)`: it is then called with the engine's
    load after requests finish outside a step (aborts, stop strings), so gauges don't go stale
    on an engine that goes idle; and `record_paths(labels: dict[str, str])`, called once with the
    execution paths the model runner chose (`ExecutionPaths.labels`).
    """

    def record(self, scheduler_stats: SchedulerStats | None, finished: list[tuple[FinishReason, RequestMetrics]]) -> None: ...


class LLMEngine:
    def __init__(self, config: EngineConfig, stat_loggers: Iterable[StatLogger] = (), fault_hook: FaultHook | None = None) -> None:
        self.config = config
        self.core = EngineCore(config)
        runner = self.core.model_runner
        runner.fault_hook = fault_hook
        self.fault_hook = fault_hook
        self.input_processor = InputProcessor(config.model.model, runner.args.vocab_size, self.core.max_model_len,
                                              check_structured=check_structured)
        self.output_processor = OutputProcessor(self.input_processor.tokenizer, fault_hook)
        self.stat_loggers = list(stat_loggers)
        self.last_stats: SchedulerStats | None = None
        for stat_logger in self.stat_loggers:
            if hasattr(stat_logger, "record_paths"):
                stat_logger.record_paths(runner.paths.labels)

    @property
    def max_model_len(self) -> int:
        return self.core.max_model_len

    def add_request(self, request: GenerateRequest) -> None:
        """Validate, tokenize and queue; raises ValueError (naming the field) without side effects."""
        if self.output_processor.has_request(request.request_id):
            raise ValueError(f"request_id: {request.request_id!r} is already in the engine")
        self.add_processed(request, Request.from_processed(self.input_processor.process(request)))

    def add_processed(self, request: GenerateRequest, engine_request: Request) -> None:
        """Queue a request already validated by `input_processor.process`. If this raises, nothing of
        the request is left in the engine."""
        if self.fault_hook is not None:
            self.fault_hook.admit(request)
            self.fault_hook.check(Stage.PREPARE, request.request_id)
        self.output_processor.add_request(
            request.request_id, engine_request.prompt_token_ids, request.sampling_params, request.arrival_time
        )
        try:
            self.core.add_request(engine_request)
        except BaseException:
            self.output_processor.discard(request.request_id)
            raise

    def abort(self, request_ids: Iterable[str]) -> list[RequestOutput]:
        """Abort now; the requests' KV blocks are free when this returns."""
        return self._finish(self.core.finish_requests(request_ids, FinishReason.ABORT))

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests()

    def step(self) -> list[RequestOutput]:
        core_outputs = self.core.step()
        processed = self.output_processor.process(core_outputs.outputs)
        results = processed.results
        if (stats := core_outputs.scheduler_stats) is not None:
            self.last_stats = stats
        self._log(core_outputs.scheduler_stats, core_outputs.outputs)
        if processed.stop_ids:
            results += self._finish(self.core.finish_requests(processed.stop_ids, FinishReason.STOP))
        if processed.failed:
            results += self._fail(processed.failed, Stage.DETOKENIZE)
        return results

    def _fail(self, details: dict[str, str], stage: Stage) -> list[RequestOutput]:
        """Abort requests whose processing failed outside the core (id → what went wrong): free what the
        core still holds of them, and end each one's stream with its error."""
        self._log(None, self.core.fail_requests(details, stage))  # (output processor state is gone already)
        return [RequestOutput.failed(rid, RequestFailedError(f"{stage} failed: {detail}", stage)) for rid, detail in details.items()]

    def _finish(self, outputs: list[EngineCoreOutput]) -> list[RequestOutput]:
        self._log(None, outputs)
        if outputs:
            load = self.load()
            for stat_logger in self.stat_loggers:
                if hasattr(stat_logger, "record_load"):
                    stat_logger.record_load(load)
        return self.output_processor.process(outputs).results

    def load(self) -> EngineLoad:
        bm, sched = self.core.block_manager, self.core.scheduler
        return EngineLoad(bm.usage, bm.num_free_blocks, bm.num_blocks, sched.num_running, sched.num_waiting,
                          sched.num_pending_prompt_tokens)

    def _log(self, stats: SchedulerStats | None, outputs: Iterable[EngineCoreOutput]) -> None:
        for o in outputs:
            if o.metrics is not None:
                self.core.kv_events.request_finished(o.request_id, o.metrics.num_cached_tokens, o.metrics.num_prompt_tokens)
        if not self.stat_loggers:
            return
        finished = [(o.finish_reason, o.metrics) for o in outputs if o.metrics is not None]
        if stats is None and not finished:
            return
        for stat_logger in self.stat_loggers:
            stat_logger.record(stats, finished)

    def next_wakeup_s(self) -> float | None:
        return self.core.next_wakeup_s()
