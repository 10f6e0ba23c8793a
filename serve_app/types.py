"""Request-level types shared by the engine, the backends and the serving layer (no torch import).

`SamplingParams` validates itself once: a bad value raises `ValueError` whose message starts with the
field name, which the HTTP layer turns into a 400 with that `param`.
"""

from __future__ import annotations

import enum
import math
import time
from dataclasses import dataclass, field

from serve_app.request_limits import (
    INT64_MAX,
    INT64_MIN,
    MAX_CHOICE_CHARS,
    MAX_CHOICES,
    MAX_GRAMMAR_CHARS,
    MAX_LOGIT_BIAS,
    MAX_LOGIT_BIAS_VALUE,
    MAX_LOGPROBS,
    MAX_PENALTY,
    MAX_REPETITION_PENALTY,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    MAX_TOKENS,
)

__all__ = ["MAX_LOGPROBS", "FinishReason", "GenerateRequest", "RequestFailedError", "RequestMetrics", "RequestOutput",
           "SamplingParams", "StructuredOutput", "TokenLogprob"]


class FinishReason(enum.StrEnum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or the model's context length
    ABORT = "abort"  # cancelled by the client or the server

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class StructuredOutput:
    """Exactly one constraint kind is set.

    The output is constrained to: a JSON value matching `json_schema` (JSON text), any JSON object
    (`json_object`), a match of `regex`, one of the strings in `choice`, or a string of the EBNF
    `grammar` (xgrammar's GBNF-style syntax, root rule `root`). Sizes are bounded here; whether the
    spec compiles is checked by the engine's `InputProcessor` (a `ValueError` naming `structured`).
    """

    json_schema: str | None = None  # a JSON schema as JSON text
    json_object: bool = False  # any JSON object
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None  # EBNF (xgrammar's / GBNF syntax)

    def __post_init__(self) -> None:
        if self.choice is not None:
            object.__setattr__(self, "choice", tuple(self.choice))
        kinds = [k for k in ("json_schema", "regex", "choice", "grammar") if getattr(self, k) is not None]
        if self.json_object is not False:
            if self.json_object is not True:
                raise ValueError("structured: json_object must be a boolean")
            kinds.append("json_object")
        if len(kinds) != 1:
            raise ValueError(f"structured: set exactly one of json_schema, json_object, regex, choice, grammar (got {kinds or 'none'})")
        for name in ("json_schema", "regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value or len(value) > MAX_GRAMMAR_CHARS):
                raise ValueError(f"structured: {name} must be a non-empty string of at most {MAX_GRAMMAR_CHARS} characters")
        if self.choice is not None:
            if not 1 <= len(self.choice) <= MAX_CHOICES:
                raise ValueError(f"structured: choice must list 1 to {MAX_CHOICES} strings, got {len(self.choice)}")
            if any(not isinstance(c, str) or not c or len(c) > MAX_CHOICE_CHARS for c in self.choice):
                raise ValueError(f"structured: every choice must be a non-empty string of at most {MAX_CHOICE_CHARS} characters")

    @property
    def kind(self) -> str:
        """The constraint's kind: "json_schema", "json_object", "regex", "choice" or "grammar"."""
        return "json_object" if self.json_object else next(k for k in ("json_schema", "regex", "choice", "grammar")
                                                           if getattr(self, k) is not None)

    @property
    def key(self) -> tuple[str, str | tuple[str, ...]]:
        """(kind, spec): what a compiled grammar is cached by."""
        kind = self.kind
        return kind, "" if kind == "json_object" else getattr(self, kind)


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token and when to stop.

    temperature 0 means greedy. top_k 0 (or -1) disables top-k; top_p 1.0 disables nucleus sampling.
    `seed` makes a request's samples reproducible whatever else shares its batch.
    `stop` strings end generation and are excluded from the returned text.
    `max_tokens` None: until EOS or the end of the context (the engine fills in the room left).
    Penalties (see `engine/penalties.py`): `repetition_penalty` (HF's, over prompt and output; 1 = off),
    `presence_penalty` / `frequency_penalty` (OpenAI's, over the output; 0 = off).
    `min_tokens`: EOS and `stop_token_ids` cannot be sampled before that many output tokens.
    `logprobs` N: return each sampled token's log-probability and the N most likely alternatives
    (of the model's raw distribution, before temperature, penalties and top-k/top-p).
    `speculative` False opts this request out of the engine's speculative decoding (its output is
    the same either way; speculation only changes how fast it comes).
    `structured`: constrain the output to a JSON schema, regex, choice or grammar (docs/structured-outputs.md);
    the returned logprobs are then those of the masked distribution (forbidden tokens at -inf), as vLLM's.
    `logit_bias`: (token id, bias) pairs added to those tokens' logits before sampling (bias in
    [-100, 100]; ids below the vocabulary size, checked by the engine's `InputProcessor`).
    """

    max_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    min_tokens: int = 0
    logprobs: int | None = None
    speculative: bool = True
    structured: StructuredOutput | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or not 1 <= self.max_tokens <= MAX_TOKENS):
            raise ValueError(f"max_tokens: must be an integer in [1, {MAX_TOKENS}], got {self.max_tokens!r}")
        if not _is_finite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature: must be a finite number >= 0, got {self.temperature!r}")
        if not _is_finite(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p: must be in (0, 1], got {self.top_p!r}")
        # top_k above the vocabulary keeps every token: the engine's InputProcessor turns it into 0
        if not _is_int(self.top_k) or self.top_k < -1:
            raise ValueError(f"top_k: must be -1, 0 (disabled) or a positive integer, got {self.top_k!r}")
        if self.seed is not None and (not _is_int(self.seed) or not INT64_MIN <= self.seed <= INT64_MAX):
            raise ValueError(f"seed: must be an integer in [{INT64_MIN}, {INT64_MAX}], got {self.seed!r}")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise ValueError(f"stop: at most {MAX_STOP_STRINGS} stop strings, got {len(self.stop)}")
        if any(not isinstance(s, str) or not s or len(s) > MAX_STOP_STRING_CHARS for s in self.stop):
            raise ValueError(f"stop: every stop string must be a non-empty string of at most {MAX_STOP_STRING_CHARS} characters")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise ValueError(f"stop_token_ids: at most {MAX_STOP_TOKEN_IDS} token ids, got {len(self.stop_token_ids)}")
        if any(not _is_int(t) or t < 0 for t in self.stop_token_ids):
            raise ValueError("stop_token_ids: must be non-negative integers")
        if not _is_finite(self.repetition_penalty) or not 0 < self.repetition_penalty <= MAX_REPETITION_PENALTY:
            raise ValueError(f"repetition_penalty: must be in (0, {MAX_REPETITION_PENALTY:g}], got {self.repetition_penalty!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not _is_finite(getattr(self, name)) or not -MAX_PENALTY <= getattr(self, name) <= MAX_PENALTY:
                raise ValueError(f"{name}: must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}], got {getattr(self, name)!r}")
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= MAX_TOKENS:
            raise ValueError(f"min_tokens: must be an integer in [0, {MAX_TOKENS}], got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens: {self.min_tokens} exceeds max_tokens {self.max_tokens}")
        if self.logprobs is not None and (not _is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise ValueError(f"logprobs: must be an integer in [0, {MAX_LOGPROBS}], got {self.logprobs!r}")
        if self.structured is not None and not isinstance(self.structured, StructuredOutput):
            raise ValueError("structured: must be a StructuredOutput")
        if self.structured is not None and self.min_tokens:
            # the grammar may allow only EOS where min_tokens forbids it: nothing would be left to sample
            raise ValueError("min_tokens: cannot be combined with structured outputs")
        self._check_logit_bias()

    def _check_logit_bias(self) -> None:
        if isinstance(self.logit_bias, dict):
            object.__setattr__(self, "logit_bias", tuple(self.logit_bias.items()))
        bias = tuple(tuple(pair) for pair in self.logit_bias)
        object.__setattr__(self, "logit_bias", bias)
        if len(bias) > MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias: at most {MAX_LOGIT_BIAS} entries, got {len(bias)}")
        for pair in bias:
            if len(pair) != 2 or not _is_int(pair[0]) or pair[0] < 0:
                raise ValueError(f"logit_bias: keys must be non-negative token ids, got {pair[0] if pair else pair!r}")
            if not _is_finite(pair[1]) or not -MAX_LOGIT_BIAS_VALUE <= pair[1] <= MAX_LOGIT_BIAS_VALUE:
                raise ValueError(f"logit_bias: the bias of token {pair[0]} must be in [-{MAX_LOGIT_BIAS_VALUE:g}, "
                                 f"{MAX_LOGIT_BIAS_VALUE:g}], got {pair[1]!r}")
        if len({t for t, _ in bias}) != len(bias):
            raise ValueError("logit_bias: token ids must be distinct")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def can_speculate(self) -> bool:
        """Whether speculative decoding may verify proposals for this request: not when it opted out,
        nor when its sampling depends on the tokens before each position (penalties, min_tokens) or
        it asked for logprobs (one row per step keeps those exact and simple)."""
        return self.speculative and not self.has_penalties and self.min_tokens == 0 and self.logprobs is None

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_finite(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


class RequestFailedError(RuntimeError):
    """One request failed inside the engine (preparing, sampling, detokenizing, or streaming it): it
    was aborted and its KV blocks freed; the engine and every other request go on. `stage` names
    where. Not retried elsewhere: the same request would likely fail the same way."""

    def __init__(self, message: str, stage: str = "") -> None:
        super().__init__(message)
        self.stage = stage

    def __reduce__(self):  # survives pickling across Ray (the default would lose `stage`)
        return (RequestFailedError, (str(self), self.stage))


@dataclass(frozen=True)
class GenerateRequest:
    """One generation request as the serving layer hands it to a backend.

    `prompt` is text (tokenized as is) or token ids; `messages` (OpenAI chat format) is rendered with
    the model's chat template instead when given. `prompt_token_ids`, when set, are that prompt or
    those messages already tokenized (the ingress tokenizes once, so routers hash exactly the blocks
    the engine looks up): the engine uses them and does not tokenize again; `prompt`/`messages` then
    only describe the request (logs, routers that read text). `cache_salt` keeps the request's
    cached prefix apart from those of other salts (tenants). `user` (OpenAI's end-user id) is a
    routing tie-break: a session's requests prefer the replica that served it. `tools` (with
    `messages` only): OpenAI tool definitions for a chat template that renders them
    (`serving/tool_prompt.py`).
    """

    request_id: str
    prompt: str | list[int] | None = None
    messages: tuple[dict, ...] | None = None
    sampling_params: SamplingParams = field(default_factory=SamplingParams)
    arrival_time: float = field(default_factory=time.monotonic)
    prompt_token_ids: tuple[int, ...] | None = None
    cache_salt: str | None = None
    user: str | None = None
    tools: tuple[dict, ...] | None = None

    def __post_init__(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("prompt: give exactly one of prompt and messages")
        if self.tools is not None and self.messages is None:
            raise ValueError("tools: only with messages")


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
class TokenLogprob:
    """One generated token with its log-probability and the `logprobs` most likely alternatives,
    most likely first: `top` holds (token id, token text, log-probability) triples."""

    token_id: int
    token: str
    logprob: float
    top: tuple[tuple[int, str, float], ...] = ()


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
    logprobs: tuple[TokenLogprob, ...] | None = None  # one per token of `token_ids` when requested
    # set (with finish_reason ABORT) when one of the request's stages failed: the request alone was
    # aborted; `AsyncLLMEngine` raises it on the request's stream as `RequestFailedError`
    error: RequestFailedError | None = None

    @classmethod
    def admitted(cls, request_id: str, prompt_token_ids: list[int], arrival_time: float) -> RequestOutput:
        """The empty delta that says: validated and queued (a backend's first item)."""
        n = len(prompt_token_ids)
        return cls(request_id, "", (), False, None, n, RequestMetrics(arrival_time=arrival_time, num_prompt_tokens=n),
                   tuple(prompt_token_ids))

    @classmethod
    def failed(cls, request_id: str, error: RequestFailedError) -> RequestOutput:
        """The last item of a request one of whose stages failed (it was aborted alone)."""
        now = time.monotonic()
        return cls(request_id, "", (), True, FinishReason.ABORT, 0, RequestMetrics(arrival_time=now, finished_time=now), error=error)
