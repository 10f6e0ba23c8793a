"""Turns engine-core outputs (token ids) into `RequestOutput` deltas (text + token ids).

Log-probabilities (when requested) become `TokenLogprob`s here, with each token's own text.
Stop strings are found here, after detokenizing: such a request is reported in `stop_ids`, and the
caller finishes it in the core (`EngineCore.finish_requests(ids, FinishReason.STOP)`), whose output
then closes the stream with the truncated text. A request whose output cannot be processed
(detokenizing raised) is reported in `failed` instead: the caller aborts it in the core, and its
stream ends with the error; the other requests' deltas are unaffected.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field, replace

from tokenizers import Tokenizer

from serve_app.engine.detokenizer import IncrementalDetokenizer
from serve_app.engine.logprobs import SampledLogprobs
from serve_app.engine.outputs import EngineCoreOutput
from serve_app.faults import FaultHook, Stage
from serve_app.types import (
    FinishReason,
    RequestMetrics,
    RequestOutput,
    SamplingParams,
    TokenLogprob,
)

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ProcessedOutputs:
    results: list[RequestOutput]  # deltas to deliver
    stop_ids: list[str]  # requests that hit a stop string: finish them in the core
    failed: dict[str, str]  # requests whose processing raised (id → what went wrong): abort them in the core


@dataclass
class _RequestState:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    arrival_time: float
    detokenizer: IncrementalDetokenizer | None
    pending_token_ids: list[int] = field(default_factory=list)
    pending_logprobs: list[TokenLogprob] | None = None  # a list when the request asked for logprobs
    num_generated: int = 0
    first_token_time: float | None = None
    stop_requested: bool = False


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer | None, fault_hook: FaultHook | None = None) -> None:
        self._tokenizer = tokenizer
        self._states: dict[str, _RequestState] = {}
        self._fault_hook = fault_hook  # tests only (serve_app/faults.py)

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, arrival_time: float) -> None:
        detok = IncrementalDetokenizer(self._tokenizer, params) if self._tokenizer is not None else None
        self._states[request_id] = _RequestState(request_id, tuple(prompt_token_ids), arrival_time, detok,
                                                 pending_logprobs=None if params.logprobs is None else [])

    def _token_text(self, token_id: int) -> str:
        return "" if self._tokenizer is None else self._tokenizer.decode([token_id], skip_special_tokens=False)

    def _to_token_logprob(self, token_id: int, lp: SampledLogprobs) -> TokenLogprob:
        top = tuple((t, self._token_text(t), v) for t, v in zip(lp.top_ids, lp.top_logprobs, strict=True))
        return TokenLogprob(token_id, self._token_text(token_id), lp.logprob, top)

    def discard(self, request_id: str) -> None:
        self._states.pop(request_id, None)

    def has_request(self, request_id: str) -> bool:
        return request_id in self._states

    def __len__(self) -> int:
        return len(self._states)

    def process(self, outputs: tuple[EngineCoreOutput, ...] | list[EngineCoreOutput]) -> ProcessedOutputs:
        now = time.monotonic()
        processed = ProcessedOutputs([], [], {})
        for out in outputs:
            state = self._states.get(out.request_id)
            if state is None:
                continue
            if out.error is not None:  # aborted by the core because one of its stages failed
                del self._states[out.request_id]
                processed.results.append(self._failed_output(state, out))
                continue
            try:
                self._process_one(state, out, now, processed)
            except Exception as exc:  # noqa: BLE001 - this request's own fault: abort it alone
                logger.exception("detokenizing failed for request %s; it is aborted", out.request_id)
                self._states.pop(out.request_id, None)
                processed.failed[out.request_id] = f"{type(exc).__name__}: {exc}"
        return processed

    def _failed_output(self, state: _RequestState, out: EngineCoreOutput) -> RequestOutput:
        metrics = out.metrics or RequestMetrics(arrival_time=state.arrival_time, num_prompt_tokens=len(state.prompt_token_ids))
        return RequestOutput(out.request_id, "", (), True, FinishReason.ABORT, len(state.prompt_token_ids), metrics,
                             state.prompt_token_ids, error=out.error)

    def _process_one(self, state: _RequestState, out: EngineCoreOutput, now: float, processed: ProcessedOutputs) -> None:
        results, stop_ids = processed.results, processed.stop_ids
        if self._fault_hook is not None and out.new_token_ids:
            self._fault_hook.check(Stage.DETOKENIZE, out.request_id)
        if out.new_token_ids:
            if state.first_token_time is None:
                state.first_token_time = now
            new_token_ids = out.new_token_ids
            if not state.stop_requested:
                if state.detokenizer is not None:
                    new_token_ids = new_token_ids[: state.detokenizer.update(new_token_ids)]
                state.pending_token_ids.extend(new_token_ids)
                if state.pending_logprobs is not None and out.new_logprobs is not None:
                    state.pending_logprobs.extend(
                        self._to_token_logprob(t, lp) for t, lp in zip(new_token_ids, out.new_logprobs, strict=False))
            state.num_generated += len(new_token_ids)
        finished = out.finish_reason is not None
        if not finished and state.detokenizer is not None and state.detokenizer.stopped:
            if not state.stop_requested:
                state.stop_requested = True
                stop_ids.append(out.request_id)
            return
        if not finished and not out.new_token_ids:
            return
        text = state.detokenizer.take_delta(finished) if state.detokenizer is not None else ""
        metrics = out.metrics
        if metrics is not None and state.stop_requested:  # the core may hold accepted tokens past the stop string
            metrics = replace(metrics, num_generation_tokens=state.num_generated)
        metrics = metrics or RequestMetrics(
            arrival_time=state.arrival_time,
            first_token_time=state.first_token_time,
            num_prompt_tokens=len(state.prompt_token_ids),
            num_generation_tokens=state.num_generated,
        )
        results.append(
            RequestOutput(
                request_id=out.request_id,
                text=text,
                token_ids=tuple(state.pending_token_ids),
                finished=finished,
                finish_reason=out.finish_reason,
                num_prompt_tokens=len(state.prompt_token_ids),
                metrics=metrics,
                prompt_token_ids=state.prompt_token_ids,
                logprobs=None if state.pending_logprobs is None else tuple(state.pending_logprobs),
            )
        )
        state.pending_token_ids.clear()
        if state.pending_logprobs is not None:
            state.pending_logprobs.clear()
        if finished:
            del self._states[out.request_id]
