"""Request-level types shared by the engine, the backends and the serving layer (no torch import).

`SamplingParams` validates itself once: a bad value raises `ValueError` whose message starts with the
field name, which the HTTP layer turns into a 400 with that `param`.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field


class FinishReason(enum.StrEnum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or the model's context length
    ABORT = "abort"  # cancelled by the client or the server

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token and when to stop.

    temperature 0 means greedy. top_k 0 (or -1) disables top-k; top_p 1.0 disables nucleus sampling.
    `seed` makes a request's samples reproducible whatever else shares its batch.
    `stop` strings end generation and are excluded from the returned text.
    `speculative` False opts this request out of the engine's speculative decoding (its output is
    the same either way; speculation only changes how fast it comes).
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    speculative: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens: must be an integer >= 1, got {self.max_tokens!r}")
        if not self.temperature >= 0:
            raise ValueError(f"temperature: must be >= 0, got {self.temperature!r}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p: must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise ValueError(f"top_k: must be -1, 0 (disabled) or a positive integer, got {self.top_k!r}")
        if self.seed is not None and not isinstance(self.seed, int):
            raise ValueError(f"seed: must be an integer, got {self.seed!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError("stop: every stop string must be a non-empty string")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise ValueError("stop_token_ids: must be non-negative integers")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(frozen=True)
class GenerateRequest:
    """One generation request as the serving layer hands it to a backend.

    `prompt` is text (tokenized as is) or token ids; `messages` (OpenAI chat format) is rendered with
    the model's chat template instead when given.
    """

    request_id: str
    prompt: str | list[int] | None = None
    messages: tuple[dict, ...] | None = None
    sampling_params: SamplingParams = field(default_factory=SamplingParams)
    arrival_time: float = field(default_factory=time.monotonic)

    def __post_init__(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("prompt: give exactly one of prompt and messages")


@dataclass(frozen=True)
class RequestMetrics:
    """Per-request timings in seconds (monotonic clock); None until the event happened."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    num_cached_tokens: int = 0
    num_preemptions: int = 0

    @property
    def queue_s(self) -> float | None:
        return None if self.first_scheduled_time is None else self.first_scheduled_time - self.arrival_time

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def e2e_s(self) -> float | None:
        return None if self.finished_time is None else self.finished_time - self.arrival_time

    @property
    def tpot_s(self) -> float | None:
        """Mean inter-token latency after the first token."""
        if self.finished_time is None or self.first_token_time is None or self.num_generation_tokens < 2:
            return None
        return (self.finished_time - self.first_token_time) / (self.num_generation_tokens - 1)


@dataclass(frozen=True)
class RequestOutput:
    """New output of one request.

    From `AsyncLLMEngine.generate` each item is a delta (`text`/`token_ids` since the previous item);
    from `LLM.generate` it is the whole output. `finish_reason` is set on the last item only.
    """

    request_id: str
    text: str
    token_ids: tuple[int, ...]
    finished: bool
    finish_reason: FinishReason | None
    num_prompt_tokens: int
    metrics: RequestMetrics
    prompt_token_ids: tuple[int, ...] = ()
