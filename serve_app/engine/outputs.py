"""Frozen hand-offs between the engine's stages: scheduler → model runner → scheduler → caller."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from serve_app.engine.logprobs import SampledLogprobs
from serve_app.metrics.stats import SchedulerStats
from serve_app.types import FinishReason, RequestFailedError, RequestMetrics, SamplingParams


@dataclass(frozen=True)
class ScheduledRequest:
    """What the model runner needs to compute `token_ids` for one request this step.

    `token_ids` sit at positions `start_pos .. start_pos + len(token_ids) - 1`; the block table covers
    them all. `sample` is True when this chunk reaches the request's last token, so its logits
    pick the next token.

    Speculative decoding: a decoding request may end its `token_ids` with `spec_token_ids`, proposed
    tokens to verify; then every one of its last `1 + len(spec_token_ids)` positions is sampled,
    position j with `spec_generator_keys[j - 1]` (j >= 1; position 0 uses `generator_key`). With
    `spec_draft_probs` (the draft's distributions the proposals were sampled from) the proposals are
    verified by rejection sampling, else by the exact rule.
    """

    request_id: str
    token_ids: tuple[int, ...]
    start_pos: int
    block_table: tuple[int, ...]
    sample: bool
    # these are prompt tokens (a chunk never mixes prompt and generated tokens: the scheduler splits a
    # recompute at the prompt's end); False: generated tokens, attended as decode rows
    reads_prompt: bool
    sampling_params: SamplingParams
    generator_key: int | None  # seed-derived key of this request's next sample (None: unseeded)
    # for the logits processors (engine/penalties.py), set only on sampling chunks that need them:
    prompt_token_ids: tuple[int, ...] = ()  # with penalties
    output_token_ids: tuple[int, ...] = ()  # with penalties
    blocked_token_ids: tuple[int, ...] = ()  # EOS and stop ids while the output is shorter than min_tokens
    spec_token_ids: tuple[int, ...] = ()
    spec_generator_keys: tuple[int | None, ...] = ()
    spec_draft_probs: Any = None  # [len(spec_token_ids), V] tensor, or None
    spec_accept_keys: tuple[int | None, ...] = ()  # with draft probs: each proposal's acceptance-draw key
    # structured outputs: the request's `GrammarState` on sampling chunks (the runner's masks read it,
    # engine/logits_masks.py, and leave it as it was; only the scheduler advances it)
    grammar: Any = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def context_len(self) -> int:
        return self.start_pos + len(self.token_ids)


@dataclass(frozen=True)
class SchedulerOutput:
    scheduled: tuple[ScheduledRequest, ...]
    num_batched_tokens: int
    preempted_ids: tuple[str, ...] = ()

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass(frozen=True)
class ModelRunnerOutput:
    """Sampled token per request that had `sample=True`, in scheduling order.

    `extra_token_ids` (empty, or aligned with `request_ids`): for requests verified with proposed
    tokens, the accepted tokens after the first one (`spec_decode.acceptance.accept`).
    """

    request_ids: tuple[str, ...]
    sampled_token_ids: tuple[int, ...]
    logprobs: tuple[SampledLogprobs | None, ...] = ()  # per request when any asked for logprobs, else empty
    extra_token_ids: tuple[tuple[int, ...], ...] = ()
    # requests whose sampling raised (not in `request_ids`): (request id, what went wrong); the core aborts them
    failed: tuple[tuple[str, str], ...] = ()
    mask_s: float | None = None  # grammar mask time of the step: check + fill + apply (None: no constrained row)


@dataclass(frozen=True)
class EngineCoreOutput:
    """New tokens of one request after a step; `finish_reason` set when it finished this step."""

    request_id: str
    new_token_ids: tuple[int, ...]
    finish_reason: FinishReason | None = None
    stop_reason: int | None = None  # the stop token id that ended it, if any
    metrics: RequestMetrics | None = None  # set when finished
    new_logprobs: tuple[SampledLogprobs, ...] | None = None  # one per new token when requested
    error: RequestFailedError | None = None  # set when the request was aborted because one of its stages failed


@dataclass(frozen=True)
class EngineCoreOutputs:
    outputs: tuple[EngineCoreOutput, ...]
    scheduler_stats: SchedulerStats | None  # None when nothing ran (e.g. a static batch still filling)
