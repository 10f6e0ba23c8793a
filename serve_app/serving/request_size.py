"""What a request will cost a replica, estimated by the router before it routes it: its prompt
tokens and the KV blocks it will hold at its end.

A request's blocks = ceil((prompt_weight × prompt tokens + output_weight × min(max_tokens,
max_expected_output_tokens)) / block_size) (`KVRouterSettings`). Token ids are counted exactly,
text is estimated from its length.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from serve_app.serving.routing_config import KVRouterSettings

# ChatML overhead per message ("<|im_start|>role\n" ... "<|im_end|>\n") and for the assistant prefix
CHAT_TOKENS_PER_MESSAGE = 5
CHAT_TOKENS_FIXED = 3


def estimate_prompt_tokens(request: Any, chars_per_token: float = 4.0) -> int:
    """Prompt length of a `GenerateRequest`-like object (`prompt` text / token ids, or chat `messages`).

    Token ids (`prompt_token_ids` from the ingress, or a token prompt) are counted exactly; text is
    estimated from its length.
    Anything else (e.g. a `model_info()` call's empty arguments) is 0.
    """
    token_ids = getattr(request, "prompt_token_ids", None)
    if token_ids is not None:  # tokenized by the ingress
        return len(token_ids)
    prompt = getattr(request, "prompt", None)
    messages = getattr(request, "messages", None)
    if isinstance(prompt, list | tuple):
        return len(prompt)
    if isinstance(prompt, str):
        return math.ceil(len(prompt) / chars_per_token)
    if messages:
        chars = 0
        for message in messages:
            content = message.get("content") if isinstance(message, Mapping) else None
            if isinstance(content, str):
                chars += len(content)
            elif isinstance(content, list):  # OpenAI content parts
                chars += sum(len(p.get("text", "")) for p in content if isinstance(p, Mapping))
        return math.ceil(chars / chars_per_token) + CHAT_TOKENS_PER_MESSAGE * len(messages) + CHAT_TOKENS_FIXED
    return 0


def estimate_request_blocks(request: Any, settings: KVRouterSettings) -> int:
    """KV blocks the request will hold at its end (estimate; 0 for anything that is not a generation)."""
    prompt_tokens = estimate_prompt_tokens(request, settings.chars_per_token)
    if prompt_tokens == 0:
        return 0
    params = getattr(request, "sampling_params", None)
    max_tokens = getattr(params, "max_tokens", 0)
    if max_tokens is None:  # until the end of the context (chat without max_tokens)
        max_tokens = settings.max_expected_output_tokens
    output_tokens = min(int(max_tokens or 0), settings.max_expected_output_tokens)
    tokens = settings.prompt_weight * prompt_tokens + settings.output_weight * output_tokens
    return max(1, math.ceil(tokens / settings.block_size))


def find_request(args: Sequence[Any], kwargs: Mapping[str, Any]) -> Any:
    """The generation request among a handle call's arguments (`LLMServer.generate(request)`)."""
    for value in (*args, *kwargs.values()):
        if hasattr(value, "sampling_params") and (hasattr(value, "prompt") or hasattr(value, "messages")):
            return value
    return None
