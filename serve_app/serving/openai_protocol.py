"""OpenAI-compatible request models and the OpenAI error body.

Requests are pydantic models: a missing or mistyped field is a 400 naming the field (see
`errors.py`). Each request turns itself into engine `SamplingParams` with `sampling_params()`, whose
own validation names the offending field too. Parameters this server does not implement (legacy
`functions` / `function_call`, `best_of` != n, `suffix`, `echo` with `logprobs`) are rejected with a
400 that names them instead of being silently ignored; unknown parameters (also inside a message) are
rejected like OpenAI does. Tool calling (`tools`, `tool_choice`, `parallel_tool_calls`, `tool`
messages, earlier assistant `tool_calls`): shapes here, meaning in `tools.py` and `tool_prompt.py`.
Sampling fields a request leaves out take the checkpoint's generation_config.json
defaults (`GenerationDefaults`), then OpenAI's.

Extensions beyond OpenAI's API (vLLM's names): `top_k` (0 or -1: off), `repetition_penalty`,
`min_tokens`, `stop_token_ids`, `ignore_eos` (benchmarks), `speculative` (false: opt this request
out of the engine's speculative decoding) and `structured_outputs` (constrained output:
serving/structured_request.py). docs/openai-api.md lists them all.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from serve_app.generation_config import GenerationDefaults
from serve_app.request_limits import (
    MAX_CONTENT_PARTS,
    MAX_LOGPROBS,
    MAX_MESSAGE_NAME_CHARS,
    MAX_MESSAGES,
    MAX_METADATA_CHARS,
    MAX_METADATA_ENTRIES,
    MAX_MODEL_NAME_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    MAX_TEMPERATURE,
    MAX_TOOL_CALL_ID_CHARS,
    MAX_TOOL_CALLS_PER_MESSAGE,
    MAX_TOOL_DESCRIPTION_CHARS,
    MAX_TOOL_NAME_CHARS,
    MAX_TOOLS,
    MAX_USER_CHARS,
    wrap_int64,
)
from serve_app.serving.cache_salt import MAX_REQUEST_SALT_CHARS
from serve_app.serving.structured_request import (
    from_response_format,
    from_structured_outputs,
    logit_bias_pairs,
)
from serve_app.serving.tools import ToolRequest, tool_request
from serve_app.types import SamplingParams, StructuredOutput

# bounded strings and lists: pydantic rejects them before anything else looks at the request, with a
# 400 naming the field and the bound ("user: String should have at most 256 characters")
ShortText = Annotated[str, Field(max_length=MAX_MESSAGE_NAME_CHARS)]
MetadataText = Annotated[str, Field(max_length=MAX_METADATA_CHARS)]
ToolName = Annotated[str, Field(min_length=1, max_length=MAX_TOOL_NAME_CHARS, pattern=r"^[a-zA-Z0-9_-]+$")]

# ---- errors --------------------------------------------------------------------------------------


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """The body of every non-2xx answer: {"error": {"message", "type", "param", "code"}}."""

    error: ErrorInfo


class UnsupportedParameterError(ValueError):
    """A known OpenAI parameter this server does not implement (400, param = its name)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param


# ---- requests ------------------------------------------------------------------------------------


class _Request(BaseModel):
    # OpenAI rejects parameters it does not know, and mistyped values ("16" for an integer); so do
    # we: a typo must not be silently ignored or coerced. No float may be NaN or infinite.
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class StreamOptions(_Request):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: usage so far in every chunk (with include_usage)


class _SamplingFields(_Request):
    model: str = Field(max_length=MAX_MODEL_NAME_CHARS)
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | Annotated[list[str], Field(max_length=MAX_STOP_STRINGS)] | None = None  # each string: SamplingParams
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # extension
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None  # extension
    min_tokens: int = 0  # extension
    stop_token_ids: list[int] | None = Field(default=None, max_length=MAX_STOP_TOKEN_IDS)  # extension
    logit_bias: dict[str, float] | None = None  # token-id strings → bias in [-100, 100]
    structured_outputs: dict[str, Any] | None = None  # vLLM's extension (serving/structured_request.py)
    user: str | None = Field(default=None, max_length=MAX_USER_CHARS)
    cache_salt: str | None = None  # vLLM's: a prefix-cache namespace (serving.cache_salt)
    ignore_eos: bool = False  # extension
    speculative: bool = True  # extension
    # accepted and ignored: they do not change the output
    metadata: dict[MetadataText, MetadataText] | None = Field(default=None, max_length=MAX_METADATA_ENTRIES)
    store: bool | None = None
    service_tier: ShortText | None = None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        return self.include_usage and self.stream_options.continuous_usage_stats

    def _check_common(self, max_n: int) -> None:
        if not 1 <= self.n <= max_n:
            raise UnsupportedParameterError("n", f"must be between 1 and {max_n}, got {self.n}")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options: only allowed when stream is true")
        if self.temperature is not None and self.temperature > MAX_TEMPERATURE:
            raise ValueError(f"temperature: must be in [0, {MAX_TEMPERATURE:g}], got {self.temperature!r}")
        if self.cache_salt is not None and not 1 <= len(self.cache_salt) <= MAX_REQUEST_SALT_CHARS:
            raise ValueError(f"cache_salt: must be a non-empty string of at most {MAX_REQUEST_SALT_CHARS} characters")

    def structured(self) -> StructuredOutput | None:
        """The request's output constraint (ValueError naming the field when malformed)."""
        return None if self.structured_outputs is None else from_structured_outputs(self.structured_outputs)

    def param_aliases(self) -> dict[str, str]:
        """Engine field names → this request's API field names (for the 400's `param`)."""
        return {"structured": "structured_outputs"}

    def _sampling_params(self, max_tokens: int | None, logprobs: int | None, choice_index: int,
                         defaults: GenerationDefaults | None) -> SamplingParams:
        """`max_tokens` None: until EOS or the end of the context (the engine knows the room left)."""
        defaults = defaults or GenerationDefaults()
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        seed = self.seed
        if seed is not None and self.n > 1:  # distinct, still reproducible samples per choice
            seed = wrap_int64(seed + choice_index)
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=defaults.sampling_value("temperature", self.temperature, 1.0),
            top_p=defaults.sampling_value("top_p", self.top_p, 1.0),
            top_k=defaults.sampling_value("top_k", self.top_k, 0),
            repetition_penalty=defaults.sampling_value("repetition_penalty", self.repetition_penalty, 1.0),
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            min_tokens=self.min_tokens,
            seed=seed,
            stop=stop,
            stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            speculative=self.speculative,
            structured=self.structured(),
            logit_bias=logit_bias_pairs(self.logit_bias),
        )


Prompt = str | list[int]


class CompletionRequest(_SamplingFields):
    """POST /v1/completions."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    def prompts(self) -> list[Prompt]:
        """The prompts of this request (a list of strings or of token-id lists is a batch)."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise ValueError("prompt: must not be empty")
        if all(isinstance(x, int) for x in p):
            return [list(p)]  # one prompt given as token ids
        return list(p)

    def validate_supported(self, max_n: int) -> None:
        self._check_common(max_n)
        if self.echo and self.logprobs is not None:
            raise UnsupportedParameterError("echo", "echo with logprobs (the prompt's logprobs) is not supported by this "
                                                    "server: leave out one of them")
        if self.best_of is not None and self.best_of != self.n:
            raise UnsupportedParameterError("best_of", "is not supported by this server (leave it out or equal to n)")
        if self.suffix:
            raise UnsupportedParameterError("suffix", "is not supported by this server")

    def sampling_params(self, choice_index: int = 0, defaults: GenerationDefaults | None = None) -> SamplingParams:
        return self._sampling_params(self.max_tokens, self.logprobs, choice_index, defaults)


class TextPart(_Request):
    type: Literal["text"]
    text: str


class ToolFunction(_Request):
    name: ToolName
    description: str | None = Field(default=None, max_length=MAX_TOOL_DESCRIPTION_CHARS)
    parameters: dict[str, Any] | None = None  # a JSON schema of type object (tools.check_parameters)
    strict: bool | None = None  # auto mode: a call whose arguments do not validate stays text


class Tool(_Request):
    type: Literal["function"]
    function: ToolFunction


class ToolCallFunction(_Request):
    name: ToolName
    arguments: str  # a JSON object, as text


class MessageToolCall(_Request):
    """A tool call of an earlier assistant message."""

    id: str = Field(min_length=1, max_length=MAX_TOOL_CALL_ID_CHARS)
    type: Literal["function"]
    function: ToolCallFunction


class ChatMessage(_Request):
    """One chat message; an unknown field (a typo) is a 400 naming it, as at OpenAI."""

    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | Annotated[list[dict[str, Any]], Field(max_length=MAX_CONTENT_PARTS)] | None = None
    name: ShortText | None = None  # handed to the chat template, which may use it
    refusal: str | None = None  # an earlier assistant refusal: only null is accepted (it has no template slot)
    tool_calls: list[MessageToolCall] | None = Field(default=None, max_length=MAX_TOOL_CALLS_PER_MESSAGE)
    tool_call_id: str | None = Field(default=None, min_length=1, max_length=MAX_TOOL_CALL_ID_CHARS)
    function_call: dict[str, Any] | None = None

    def to_engine(self, index: int) -> dict[str, Any]:
        """The message as the chat template sees it: {"role", "content"[, "name"]} with string content;
        a `tool` message adds "tool_call_id", an assistant message's calls come as "tool_calls" with
        their arguments parsed (templates read them as objects, as vLLM hands them)."""
        where = f"messages.{index}"
        if self.role == "function" or self.function_call is not None:
            raise UnsupportedParameterError(where, "legacy function messages are not supported by this server; "
                                            "use tool_calls and role 'tool'")
        if self.refusal is not None:
            raise UnsupportedParameterError(f"{where}.refusal", "is not supported by this server (send the refusal as content)")
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError(f"{where}.tool_calls: only allowed for role 'assistant'")
        if (self.tool_call_id is not None) != (self.role == "tool"):
            raise ValueError(f"{where}.tool_call_id: " + ("is required for role 'tool'" if self.role == "tool"
                                                          else "only allowed for role 'tool'"))
        content = self.content
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise UnsupportedParameterError(f"{where}.content.{j}", "only text content parts are supported")
                texts.append(part["text"])
            content = "\n".join(texts)
        if content is None:
            if self.role != "assistant":
                raise ValueError(f"{where}.content: is required for role {self.role!r}")
            content = ""
        message: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role, "content": content}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.tool_calls:
            message["tool_calls"] = [_engine_tool_call(f"{where}.tool_calls.{j}", c) for j, c in enumerate(self.tool_calls)]
        return message


def _engine_tool_call(where: str, call: MessageToolCall) -> dict[str, Any]:
    try:
        arguments = json.loads(call.function.arguments)
    except ValueError:
        arguments = None
    if not isinstance(arguments, dict):
        raise ValueError(f"{where}.function.arguments: must be a JSON object, as a string")
    return {"id": call.id, "type": "function", "function": {"name": call.function.name, "arguments": arguments}}


class ChatCompletionRequest(_SamplingFields):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[Tool] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None

    def engine_messages(self) -> tuple[dict[str, Any], ...]:
        return tuple(m.to_engine(i) for i, m in enumerate(self.messages))

    def tool_request(self) -> ToolRequest | None:
        """The validated tool settings (None: no tools); ValueError naming the field."""
        return tool_request(self.tools, self.tool_choice, self.parallel_tool_calls)

    def validate_supported(self, max_n: int) -> None:
        self._check_common(max_n)
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs: requires logprobs to be true")
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= MAX_LOGPROBS:
            raise ValueError(f"top_logprobs: must be an integer in [0, {MAX_LOGPROBS}], got {self.top_logprobs}")
        if self.functions is not None or self.function_call is not None:
            raise UnsupportedParameterError("functions" if self.functions is not None else "function_call",
                                            "the legacy function-calling parameters are not supported by this server; "
                                            "use tools and tool_choice")
        if self.response_format is not None and self.structured_outputs is not None:
            raise ValueError("response_format: give either response_format or structured_outputs, not both")

    def structured(self) -> StructuredOutput | None:
        if self.response_format is not None:
            return from_response_format(self.response_format)
        return super().structured()

    def param_aliases(self) -> dict[str, str]:
        """Engine field names → this request's API field names (for the 400's `param`): under tool_choice
        "required" or a named function the output constraint is made of the tools' schemas."""
        constrained = bool(self.tools) and self.tool_choice not in (None, "none", "auto")
        structured = "tools" if constrained else "response_format" if self.response_format is not None else "structured_outputs"
        return {"prompt": "messages", "structured": structured}

    def sampling_params(self, choice_index: int = 0, defaults: GenerationDefaults | None = None) -> SamplingParams:
        limit = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self._sampling_params(limit, logprobs, choice_index, defaults)
