"""Offline API:

    llm = LLM("models/smollm2-135m-instruct", dtype="float32", device="cpu", batching="continuous")
    outs = llm.generate(["prompt", [1, 2, 3]], SamplingParams(temperature=0.0, max_tokens=32))
    outs[0].token_ids, outs[0].text, outs[0].finish_reason, outs[0].metrics
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Sequence
from typing import Any

from serve_app.engine.config import EngineConfig
from serve_app.engine.llm_engine import LLMEngine, StatLogger
from serve_app.types import GenerateRequest, RequestOutput, SamplingParams

Prompt = str | list[int]


def merge_outputs(first: RequestOutput, delta: RequestOutput) -> RequestOutput:
    """Append a delta to an accumulated output."""
    return RequestOutput(
        request_id=first.request_id,
        text=first.text + delta.text,
        token_ids=first.token_ids + delta.token_ids,
        finished=delta.finished,
        finish_reason=delta.finish_reason,
        num_prompt_tokens=delta.num_prompt_tokens,
        metrics=delta.metrics,
        prompt_token_ids=delta.prompt_token_ids,
        logprobs=None if first.logprobs is None else first.logprobs + (delta.logprobs or ()),
    )


class LLM:
    def __init__(self, model: str, stat_loggers: Sequence[StatLogger] = (), **engine_kwargs: Any) -> None:
        self.engine = LLMEngine(EngineConfig.from_kwargs(model, **engine_kwargs), stat_loggers)
        self._ids = itertools.count()

    @property
    def tokenizer(self):
        return self.engine.input_processor.hf_tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        on_step: Callable[[list[RequestOutput]], None] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt (text or token ids); outputs come back in prompt order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        return self._run([GenerateRequest(self._next_id(), prompt=p, sampling_params=sp) for p, sp in zip(prompts, self._params(sampling_params, len(prompts)), strict=True)], on_step)

    def chat(
        self,
        conversations: Sequence[Sequence[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Generate replies to OpenAI-style message lists, rendered with the model's chat template."""
        params = self._params(sampling_params, len(conversations))
        return self._run([GenerateRequest(self._next_id(), messages=tuple(c), sampling_params=sp) for c, sp in zip(conversations, params, strict=True)])

    def reset_prefix_cache(self) -> None:
        """Forget cached prefix blocks (those no running request holds), e.g. between benchmark runs."""
        self.engine.core.block_manager.reset_prefix_cache()

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams() with the checkpoint's generation_config.json sampling defaults applied
        (what `generate` and `chat` use when given no sampling params)."""
        return SamplingParams(**dict(self.engine.input_processor.generation_defaults.sampling))

    def _next_id(self) -> str:
        return str(next(self._ids))

    def _params(self, params: SamplingParams | Sequence[SamplingParams] | None, n: int) -> Sequence[SamplingParams]:
        if params is None:
            return [self.get_default_sampling_params()] * n
        if isinstance(params, SamplingParams):
            return [params] * n
        if len(params) != n:
            raise ValueError("sampling_params: need one per prompt")
        return params

    def _run(self, requests: list[GenerateRequest], on_step: Callable[[list[RequestOutput]], None] | None = None) -> list[RequestOutput]:
        added: list[str] = []
        try:
            for request in requests:
                self.engine.add_request(request)
                added.append(request.request_id)
        except ValueError:
            self.engine.abort(added)
            raise
        results: dict[str, RequestOutput] = {}
        while self.engine.has_unfinished_requests():
            step_outputs = self.engine.step()
            if on_step is not None:
                on_step(step_outputs)
            for out in step_outputs:
                results[out.request_id] = merge_outputs(results[out.request_id], out) if out.request_id in results else out
            if not step_outputs:  # maybe a static batch still filling: wait for its timeout
                wait = self.engine.next_wakeup_s()
                if wait:
                    time.sleep(min(wait, 0.01))
        return [results[r.request_id] for r in requests]
