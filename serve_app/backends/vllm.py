"""The vLLM backend: vLLM's V1 async engine (`vllm.v1.engine.async_llm.AsyncLLM`) behind `Backend`.

`vllm` is imported in `start()`, inside the replica: importing this module (and the serving layer
above it) never needs vllm, and the native backend never touches it.

Behaviour matches the native backend (`backends/native.py`), so the API, router, metrics and
dashboards do not care which one serves:
- Prompts are tokenized here with the model's own tokenizer and chat template, by the same
  `InputProcessor` the native engine uses (same ids for the same request on both backends, same
  "prompt: ..." / "messages: ..." ValueErrors, raised on the first iteration before anything is
  queued); vLLM receives token ids.
- `generate` streams deltas (`RequestOutputKind.DELTA`), the first an empty one as soon as vLLM has
  queued the request (so the stream's headers do not wait for the first token); leaving it early
  (`aclose()`, task cancellation) aborts the request in the engine core, which frees its KV blocks. `abort(request_id)` ends a running stream with an `abort` finish.
- An output constraint (`SamplingParams.structured`: structured outputs, tool calling's required and
  named modes) goes to vLLM as its `structured_outputs`, as the same grammar the native engine
  enforces (`vllm_structured_outputs()`); vLLM compiles and enforces it itself.
- Routing stats and our metric names come from vLLM's stat-logger hook (`backends/vllm_stats.py`);
  aborted requests, which vLLM leaves out of its stats, are recorded here.
- `check_health` raises `BackendDeadError` once vLLM's engine core has died;
  `seconds_without_progress` counts from vLLM's last per-step stats message while requests are open.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import time
from collections.abc import AsyncIterator, Sequence
from typing import TYPE_CHECKING, Any

from serve_app.backends.base import Backend, BackendDeadError, ModelInfo, RoutingStats
from serve_app.backends.vllm_options import VLLMOptions
from serve_app.backends.vllm_stats import VLLMStatsBridge, finish_reason, make_vllm_stat_logger
from serve_app.types import (
    FinishReason,
    GenerateRequest,
    RequestMetrics,
    RequestOutput,
    SamplingParams,
    StructuredOutput,
    TokenLogprob,
)

if TYPE_CHECKING:
    from serve_app.backends.config import BackendConfig
    from serve_app.input_processor import InputProcessor

logger = logging.getLogger(__name__)

ABORT_WAIT_S = 5.0  # abort() waits at most this long for the engine core's next stats message
# shutdown() gives the engine core this long to exit before vLLM kills it (vLLM's default: 5 s). Its
# rank workers may need vLLM's full worker grace (5 s, then SIGTERM and 4 s more: three CPU ranks on
# two cores do); killed before that, the engine core never unlinks its 160 MiB shared-memory message
# queue, and in a Ray replica nothing did afterwards (its resource tracker is gone with the replica)
SHUTDOWN_TIMEOUT_S = 15.0
# vLLM reports usage statistics over the network by default; a replica must not
NO_USAGE_STATS = {"VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
# our SamplingParams fields that vLLM's take under the same name, with the same meaning and type
SAME_SAMPLING_FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "seed", "ignore_eos", "skip_special_tokens",
                        "repetition_penalty", "presence_penalty", "frequency_penalty", "min_tokens", "logprobs")


def token_logprobs(token_ids: Sequence[int], logprobs: Any, num_top: int | None) -> tuple[TokenLogprob, ...] | None:
    """vLLM's per-token {token id: Logprob(logprob, rank, decoded_token)} dicts (the sampled token
    plus the top `num_top`, raw model distribution by default, as ours) as our `TokenLogprob`s."""
    if num_top is None:
        return None
    out = []
    for token_id, entries in zip(token_ids, logprobs or (), strict=True):
        top = sorted(((lp.rank, t, lp) for t, lp in entries.items() if lp.rank is not None and lp.rank <= num_top),
                     key=lambda e: e[0])
        sampled = entries[token_id]
        out.append(TokenLogprob(token_id, sampled.decoded_token or "", sampled.logprob,
                                tuple((t, lp.decoded_token or "", lp.logprob) for _, t, lp in top)))
    return tuple(out)


def vllm_structured_outputs(structured: StructuredOutput | None) -> Any:
    """Our output constraint as vLLM's `StructuredOutputsParams` (None: unconstrained), enforcing the
    grammar the native engine enforces (`engine/grammar.py`): JSON schemas and JSON objects go as
    xgrammar's own EBNF for the schema without free whitespace, choices as the native choice grammar,
    so greedy output is the same on both backends. (vLLM's `json` would allow any whitespace: its
    xgrammar backend reads `disable_any_whitespace` from the engine's config only, never from a request's
    `StructuredOutputsParams`.)"""
    if structured is None:
        return None
    import xgrammar as xgr
    from vllm.sampling_params import StructuredOutputsParams

    from serve_app.engine.grammar import JSON_OBJECT_SCHEMA, choice_grammar

    kind = structured.kind
    if kind == "regex":
        return StructuredOutputsParams(regex=structured.regex)
    if kind == "choice":
        return StructuredOutputsParams(grammar=choice_grammar(structured.choice))
    if kind == "grammar":
        return StructuredOutputsParams(grammar=structured.grammar)
    schema = structured.json_schema if kind == "json_schema" else JSON_OBJECT_SCHEMA
    return StructuredOutputsParams(grammar=str(xgr.Grammar.from_json_schema(schema, any_whitespace=False)))


class VLLMBackend(Backend):
    """Wraps one `AsyncLLM`. `stat_loggers` are our engine stat loggers (`record`, `record_load`),
    fed with vLLM's stats mapped onto our types."""

    @classmethod
    def options_from_kwargs(cls, model: str, engine: dict[str, Any]) -> VLLMOptions:
        """`engine` holds `VLLMOptions` names (checked without importing vllm)."""
        return VLLMOptions.from_kwargs(**engine)

    @classmethod
    def from_config(cls, config: BackendConfig, stat_loggers: Sequence[Any] = (), fault_hook: Any = None) -> VLLMBackend:
        """`fault_hook` reaches only the native engine's stages: ignored here."""
        return cls(config.model, config.options, config.model_name, stat_loggers)

    def __init__(self, model: str, options: VLLMOptions, model_name: str = "", stat_loggers: Sequence[Any] = ()) -> None:
        self.model = model
        self.options = options
        self.model_name = model_name or os.path.basename(os.path.normpath(model))
        self.stats = VLLMStatsBridge(stat_loggers)
        self._engine: Any = None
        self._input: InputProcessor | None = None
        self._max_model_len = 0
        self._dead_errors: tuple[type[BaseException], ...] = (BackendDeadError,)
        self._tokens_input: Any = None
        self._stream_finished: Any = None  # vLLM's end-of-stream sentinel in a request's output queue
        self._active: set[str] = set()  # request ids whose streams are open
        self._busy_since = time.monotonic()  # when `_active` last became non-empty
        # prompt tokens of open requests with no token yet: the frontend's view of vLLM's queued prefill
        # work (routing stats; vLLM's own stats do not count it; a preempted request's recompute is missed)
        self._unread_prompt_tokens: dict[str, int] = {}
        self._closed = False

    @property
    def engine(self) -> Any:
        """The `AsyncLLM` (raises `BackendDeadError` before `start` and after `shutdown`)."""
        if self._engine is None:
            raise BackendDeadError("backend shut down" if self._closed else "backend not started")
        return self._engine

    async def start(self) -> None:
        if self._engine is not None:
            return
        os.environ.update({**NO_USAGE_STATS, **self.options.environment()})
        if os.environ.get("VLLM_CPU_KVCACHE_SPACE"):
            logger.warning("VLLM_CPU_KVCACHE_SPACE=%s overrides kv_cache_memory_gib", os.environ["VLLM_CPU_KVCACHE_SPACE"])
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.inputs import tokens_input
        from vllm.outputs import STREAM_FINISHED
        from vllm.v1.engine.async_llm import AsyncLLM
        from vllm.v1.engine.exceptions import EngineDeadError

        from serve_app.engine.grammar import check_structured
        from serve_app.input_processor import InputProcessor

        self._dead_errors = (BackendDeadError, EngineDeadError)
        self._tokens_input = tokens_input
        self._stream_finished = STREAM_FINISHED
        started = time.monotonic()
        args = AsyncEngineArgs(**self.options.async_engine_args(self.model, self.model_name))
        self._engine = AsyncLLM.from_engine_args(args, stat_loggers=[make_vllm_stat_logger(self.stats)])
        vllm_config = self._engine.vllm_config
        # vLLM's usage ratio excludes its one null block: used / (num_gpu_blocks - 1)
        self.stats.set_num_total_blocks(max(int(vllm_config.cache_config.num_gpu_blocks or 1) - 1, 0))
        # vLLM picks its own kernels; it is batch invariant only in its own mode (VLLM_BATCH_INVARIANT=1, GPUs)
        invariant = os.environ.get("VLLM_BATCH_INVARIANT", "0") == "1"
        self.stats.record_paths({"linear": "vllm", "attention": "vllm", "amx": "false", "batch_invariant": str(invariant).lower(),
                                 "self_check": "not run"})
        self._max_model_len = int(vllm_config.model_config.max_model_len)
        self._input = InputProcessor(self.model, vllm_config.model_config.get_vocab_size(), self._max_model_len,
                                     check_structured=check_structured)
        logger.info(
            "vLLM engine ready in %.0f s: model %s, %s on %s, context %d tokens, %d KV blocks of %d tokens, eager %s",
            time.monotonic() - started, self.model_name, self.options.dtype, self.options.device, self._max_model_len,
            self.stats.num_total_blocks, vllm_config.cache_config.block_size, self.options.enforce_eager,
        )

    # ---- requests --------------------------------------------------------------------------------
    def _sampling_params(self, params: SamplingParams) -> Any:
        from vllm import SamplingParams as VSamplingParams
        from vllm.sampling_params import RequestOutputKind

        return VSamplingParams(
            **{name: getattr(params, name) for name in SAME_SAMPLING_FIELDS},
            stop=list(params.stop),
            stop_token_ids=list(params.stop_token_ids),
            output_kind=RequestOutputKind.DELTA,
            structured_outputs=vllm_structured_outputs(params.structured),
            logit_bias=dict(params.logit_bias) or None,
        )

    async def generate(self, request: GenerateRequest) -> AsyncIterator[RequestOutput]:
        engine = self.engine
        self.check_health()
        assert self._input is not None
        processed = self._input.process(request)  # ValueError ("prompt: ...") before queuing
        prompt_ids = list(processed.prompt_token_ids)  # vLLM takes a list
        # the processed parameters: model-dependent bounds applied (top_k past the vocabulary is off)
        params = self._sampling_params(processed.sampling_params)
        arrival = request.arrival_time
        first_token_time: float | None = None
        num_tokens = 0
        finished = False
        queue = None
        try:
            # add_request + reading its output queue is what AsyncLLM.generate does; done here so
            # that the request is known to be queued (and its stream's headers can go out) before
            # its first token, which can be a long queue away
            try:
                # the salt keeps this request's cached prefix apart from other tenants' (vLLM hashes it into its blocks)
                salt = {"cache_salt": request.cache_salt} if request.cache_salt is not None else {}
                queue = await engine.add_request(request.request_id, self._tokens_input(prompt_ids, **salt), params)
            except asyncio.CancelledError:  # cancelled while being added: it may be in the engine core already
                await asyncio.shield(engine.abort(request.request_id))
                raise
            if not self._active:
                self._busy_since = time.monotonic()
            self._active.add(request.request_id)
            self._unread_prompt_tokens[request.request_id] = len(prompt_ids)
            yield RequestOutput.admitted(request.request_id, prompt_ids, arrival)
            while not finished:
                out = queue.get_nowait() or await queue.get()  # no task switch when outputs are waiting
                if out is self._stream_finished:
                    finished = True
                    break
                completion = out.outputs[0]
                now = time.monotonic()
                if completion.token_ids and first_token_time is None:
                    first_token_time = now
                    self._unread_prompt_tokens.pop(request.request_id, None)
                num_tokens += len(completion.token_ids)
                reason = finish_reason(completion.finish_reason) if out.finished else None
                metrics = RequestMetrics(arrival_time=arrival, first_token_time=first_token_time,
                                         finished_time=now if out.finished else None,
                                         num_prompt_tokens=len(prompt_ids), num_generation_tokens=num_tokens,
                                         num_cached_tokens=int(getattr(out, "num_cached_tokens", None) or 0))
                finished = out.finished
                if reason == FinishReason.ABORT:
                    self.stats.record_aborted(metrics)
                yield RequestOutput(
                    request_id=request.request_id, text=completion.text, token_ids=tuple(completion.token_ids),
                    finished=out.finished, finish_reason=reason, num_prompt_tokens=len(prompt_ids),
                    metrics=metrics, prompt_token_ids=tuple(prompt_ids),
                    logprobs=token_logprobs(completion.token_ids, completion.logprobs, request.sampling_params.logprobs),
                )
        except self._dead_errors as exc:
            raise BackendDeadError(f"vLLM engine died: {exc}") from exc
        finally:
            self._active.discard(request.request_id)
            self._unread_prompt_tokens.pop(request.request_id, None)
            if queue is not None:
                if not finished and not engine.errored:  # left early: abort in the engine core, free its blocks
                    await asyncio.shield(engine.abort(queue.request_id, internal=True))
                    self.stats.record_aborted(RequestMetrics(
                        arrival_time=arrival, first_token_time=first_token_time, finished_time=time.monotonic(),
                        num_prompt_tokens=len(prompt_ids), num_generation_tokens=num_tokens))
                queue.close()

    async def abort(self, request_id: str) -> None:
        """Abort in vLLM, then wait for the engine core's next stats message (it frees the request's
        blocks before making it), at most `ABORT_WAIT_S`. Unknown or finished ids: no-op."""
        engine = self.engine
        if request_id not in self._active:
            return
        seen = self.stats.num_updates
        await engine.abort(request_id)
        deadline = time.monotonic() + ABORT_WAIT_S
        while self.stats.num_updates == seen and time.monotonic() < deadline and not engine.errored:
            await asyncio.sleep(0.01)

    # ---- state -----------------------------------------------------------------------------------
    def routing_stats(self) -> RoutingStats:
        self.engine  # noqa: B018 - raises once shut down
        stats = RoutingStats.from_load(self.stats.load)
        return dataclasses.replace(stats, num_pending_prompt_tokens=sum(self._unread_prompt_tokens.values()))

    def model_info(self) -> ModelInfo:
        self.engine  # noqa: B018
        assert self._input is not None
        return ModelInfo(name=self.model_name, max_model_len=self._max_model_len, backend="vllm",
                         generation_defaults=self._input.generation_defaults, tokenizer_class=self._input.tokenizer_class,
                         chat_template_tools=self._input.chat_template_tools)

    def check_health(self) -> None:
        if self.engine.errored:
            raise BackendDeadError("vLLM engine core is dead")

    def seconds_without_progress(self) -> float:
        if not self._active:
            return 0.0
        return max(0.0, time.monotonic() - max(self._busy_since, self.stats.last_update))

    def shutdown(self) -> None:
        engine, self._engine, self._closed = self._engine, None, True
        if engine is not None:
            engine.shutdown(timeout=SHUTDOWN_TIMEOUT_S)
