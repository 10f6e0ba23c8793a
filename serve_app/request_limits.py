"""The bounds every request field is held to, in one place (docs/openai-api.md lists them).

Sampling bounds are enforced by `SamplingParams` (serve_app/types.py), which both backends receive;
request-shape bounds (lists, strings, messages) by the API models (serving/openai_protocol.py);
bounds that depend on the model (vocabulary, context) by the engine's `InputProcessor`, which both
backends run before anything is queued. A value past a bound is a 400 naming the field and the bound.

Why these numbers: integers that reach tensors or vLLM must fit a signed 64-bit integer (`seed`) or
32-bit one (`max_tokens`, `min_tokens`); list and string bounds keep one request's per-token work
(stop-string search) and its copies through the serving path small next to a step's cost.
"""

from __future__ import annotations

INT32_MAX = 2**31 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1

MAX_LOGPROBS = 20  # most alternatives per token (vLLM's default limit; OpenAI's chat API allows 20)
MAX_TEMPERATURE = 2.0  # OpenAI's limit (the API's; the offline engine takes any finite value >= 0)
MAX_PENALTY = 2.0  # presence / frequency penalty: OpenAI's range is [-2, 2]
MAX_REPETITION_PENALTY = 2.0  # HF's multiplicative penalty: (0, 2]
MAX_TOKENS = INT32_MAX  # max_tokens and min_tokens (the context bounds them further)

MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 128
MAX_USER_CHARS = 256
MAX_MODEL_NAME_CHARS = 256
MAX_MESSAGES = 512
MAX_CONTENT_PARTS = 64
MAX_MESSAGE_NAME_CHARS = 256
MAX_METADATA_ENTRIES = 16
MAX_METADATA_CHARS = 512  # each metadata key and value
MAX_TOOLS = 128  # OpenAI's limit on `tools`
MAX_TOOL_NAME_CHARS = 64  # OpenAI's: a function name matches ^[a-zA-Z0-9_-]{1,64}$
MAX_TOOL_DESCRIPTION_CHARS = 4096
MAX_TOOL_SCHEMA_CHARS = 32768  # one function's `parameters`, as compact JSON
MAX_TOOL_SCHEMA_DEPTH = 16  # nesting of objects and arrays in one `parameters` schema
MAX_TOOL_CALLS_PER_MESSAGE = 128  # `tool_calls` of one earlier assistant message
MAX_TOOL_CALL_ID_CHARS = 256
MAX_LOGIT_BIAS = 300  # logit_bias entries (OpenAI's limit)
MAX_LOGIT_BIAS_VALUE = 100.0  # each bias in [-100, 100] (OpenAI's range)
MAX_GRAMMAR_CHARS = 65536  # a JSON schema, regex or grammar's text (compiling one is work on the replica)
MAX_CHOICES = 256  # structured outputs `choice`: alternatives
MAX_CHOICE_CHARS = 1024  # each alternative


def wrap_int64(value: int) -> int:
    """`value` wrapped into the signed 64-bit range (a per-choice seed `seed + j` stays valid)."""
    return (value - INT64_MIN) % 2**64 + INT64_MIN
