"""EngineCore: one step = schedule() → execute_model() → update_from_output().

A structured-output request waits (queued, not scheduled) while its grammar compiles in the
`GrammarCompiler`'s thread; each step first collects the grammars that finished, and a request whose
grammar failed to compile is aborted alone with the library's message.

A request whose sampling fails (the model runner reports it in `failed`) is aborted alone and the step
stands for the others; a failure of the step itself (scheduling, the forward pass) may have left the
shared state (KV cache, block tables) inconsistent, so it propagates and ends the engine.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import replace

from serve_app.engine.block_manager import BlockManager
from serve_app.engine.config import EngineConfig
from serve_app.engine.grammar import GrammarCompiler
from serve_app.engine.grammar_state import GrammarState
from serve_app.engine.kv_events import KVEventLog
from serve_app.engine.model_runner import ModelRunner
from serve_app.engine.outputs import EngineCoreOutput, EngineCoreOutputs
from serve_app.engine.request import Request
from serve_app.engine.scheduler import Scheduler
from serve_app.engine.spec_decode.draft import DraftProposer
from serve_app.engine.spec_decode.speculator import Speculator
from serve_app.engine.step_cost import StepCostFit
from serve_app.faults import Stage
from serve_app.types import FinishReason, RequestFailedError


class EngineCore:
    """Synchronous core; not thread-safe (the async engine drives it from one thread)."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        hf_config = config.model.hf_config()
        self.model_runner = ModelRunner(config.model, config.cache, hf_config, config.scheduler)
        args = self.model_runner.args
        block_size = config.cache.block_size
        num_blocks = self.model_runner.num_blocks
        # the context length: the model's, the user's cap, what the KV cache holds, the sliding window,
        # and without chunked prefill the step token budget
        limits = [args.max_position_embeddings, num_blocks * block_size]
        if config.model.max_model_len:
            limits.append(config.model.max_model_len)
        if args.sliding_window:
            limits.append(args.sliding_window)
        if not config.scheduler.enable_chunked_prefill:  # a whole prompt (or recompute) must fit one step
            limits.append(config.scheduler.max_num_batched_tokens)
        self.max_model_len = min(limits)
        self.kv_events = KVEventLog()  # what the prefix cache holds, for routers
        self.block_manager = BlockManager(num_blocks, block_size, config.cache.enable_prefix_caching, self.kv_events,
                                          cache_generated_blocks=self.model_runner.shares_output_blocks)
        # the engine's measured step cost (what k more tokens in a step cost: adaptive speculation)
        self.step_cost = StepCostFit()
        speculator = None
        if config.speculative.enabled:
            proposer = DraftProposer.build(config, args.vocab_size) if config.speculative.method == "draft" else None
            speculator = Speculator(config.speculative, self.step_cost, proposer)
        self.scheduler = Scheduler(config.scheduler, self.block_manager, self.max_model_len, speculator=speculator)
        self.step_index = 0
        self._compile_s: list[float] = []  # grammar compile times since the last step's stats (appended by the compile thread)
        self.grammars = GrammarCompiler(config.model.model, args.vocab_size, on_compiled=self._compile_s.append)
        self._compiling: dict[str, Request] = {}  # requests whose grammar is being compiled

    def add_request(self, request: Request) -> None:
        structured = request.sampling_params.structured
        if structured is not None and request.grammar is None:
            request.grammar = GrammarState(self.grammars.submit(structured), request.eos_token_ids)
        self.scheduler.add_request(request)
        if request.grammar is not None and not request.grammar.ready:
            self._compiling[request.request_id] = request

    def _poll_grammars(self) -> list[EngineCoreOutput]:
        """Make the matchers of the grammars compiled since the last step; abort the requests whose
        grammar failed to compile (their outputs)."""
        failed = {}
        for rid, request in list(self._compiling.items()):
            if self.scheduler.requests.get(rid) is not request:  # aborted meanwhile
                del self._compiling[rid]
                continue
            error = request.grammar.poll()
            if error is not None:
                failed[rid] = error
            if error is not None or request.grammar.ready:
                del self._compiling[rid]
        return self.fail_requests(failed, Stage.PREPARE) if failed else []

    def next_wakeup_s(self) -> float | None:
        """Seconds the caller may wait before the next step when the last one produced nothing:
        a static batch's timeout, or a short wait while only compiling grammars keep requests back."""
        wait = self.scheduler.next_wakeup_s()
        if self._compiling and not self.scheduler.num_running:
            wait = min(wait, 0.002) if wait is not None else 0.002
        return wait

    def finish_requests(self, request_ids: Iterable[str], reason: FinishReason = FinishReason.ABORT) -> list[EngineCoreOutput]:
        """Abort (or, for stop strings found after detokenizing, stop) requests now, freeing their blocks."""
        return self.scheduler.finish_requests(request_ids, reason)

    def fail_requests(self, details: dict[str, str], stage: Stage) -> list[EngineCoreOutput]:
        """Abort requests one of whose stages failed (`details`: request id → what went wrong), freeing
        their blocks; their outputs carry the `RequestFailedError` their callers get."""
        outputs = self.scheduler.finish_requests(details, FinishReason.ABORT)
        return [replace(o, error=RequestFailedError(f"{stage} failed: {details[o.request_id]}", stage)) for o in outputs]

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def step(self) -> EngineCoreOutputs:
        """Run one engine step. With nothing schedulable (e.g. a static batch still filling) it
        returns no outputs and no scheduler stats."""
        start = time.monotonic()
        compile_failures = self._poll_grammars() if self._compiling else []
        scheduler_output = self.scheduler.schedule()
        if scheduler_output.is_empty:
            return EngineCoreOutputs(tuple(compile_failures), None)
        runner_output = self.model_runner.execute_model(scheduler_output)
        outputs = compile_failures + self.scheduler.update_from_output(scheduler_output, runner_output)
        if runner_output.failed:  # their sampling raised: abort them alone (blocks freed), the step stands
            outputs += self.fail_requests(dict(runner_output.failed), Stage.SAMPLE)
        stats = self.scheduler.make_stats(self.step_index, start, time.monotonic() - start, scheduler_output)
        compile_s = [self._compile_s.pop(0) for _ in range(len(self._compile_s))]
        if compile_s or runner_output.mask_s is not None:
            stats = replace(stats, grammar_mask_s=runner_output.mask_s, grammar_compile_s=tuple(compile_s))
        self.step_cost.observe(stats.num_prefill_tokens, stats.num_decode_tokens, stats.step_duration_s)
        self.step_index += 1
        return EngineCoreOutputs(tuple(outputs), stats)
