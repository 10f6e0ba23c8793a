"""Request-size estimates (request_size): prompt tokens and the KV blocks a request will hold."""

from __future__ import annotations

import dataclasses
import math

from serve_app.serving.request_size import estimate_prompt_tokens, estimate_request_blocks, find_request
from serve_app.serving.routing_config import KVRouterSettings
from serve_app.types import GenerateRequest, SamplingParams
from tests.router.fakes import gen_request


def test_prompt_estimates():
    assert estimate_prompt_tokens(gen_request("r", 37, 8)) == 37  # token ids: exact
    tokenized = dataclasses.replace(GenerateRequest("r", prompt="x" * 400), prompt_token_ids=tuple(range(7)))
    assert estimate_prompt_tokens(tokenized) == 7  # the ingress's token ids win over the text
    assert estimate_prompt_tokens(GenerateRequest("r", prompt="x" * 400)) == 100  # text: 4 chars per token
    assert estimate_prompt_tokens(GenerateRequest("r", prompt="x" * 400), chars_per_token=2.0) == 200
    chat = GenerateRequest("r", messages=({"role": "system", "content": "s" * 40}, {"role": "user", "content": "u" * 80}))
    assert estimate_prompt_tokens(chat) == 30 + 2 * 5 + 3  # content + ChatML framing
    parts = GenerateRequest("r", messages=({"role": "user", "content": [{"type": "text", "text": "p" * 40}]},))
    assert estimate_prompt_tokens(parts) == 10 + 5 + 3  # OpenAI content parts
    assert estimate_prompt_tokens(None) == 0 and estimate_prompt_tokens(object()) == 0


def test_block_estimates_and_weights():
    s = KVRouterSettings(block_size=16)
    assert estimate_request_blocks(gen_request("r", 100, 60), s) == math.ceil(160 / 16)
    # chat requests default max_tokens to the whole context: the expected output is capped
    capped = KVRouterSettings(block_size=16, max_expected_output_tokens=64)
    assert estimate_request_blocks(gen_request("r", 32, 8000), capped) == (32 + 64) // 16
    until_context = dataclasses.replace(gen_request("r", 32, 8), sampling_params=SamplingParams(max_tokens=None))
    assert estimate_request_blocks(until_context, capped) == (32 + 64) // 16  # chat without max_tokens
    half = KVRouterSettings(block_size=16, output_weight=0.5, prompt_weight=1.0)
    assert estimate_request_blocks(gen_request("r", 32, 64), half) == 4
    weightless = KVRouterSettings(prompt_weight=0.0, output_weight=0.0)
    assert estimate_request_blocks(gen_request("r", 32, 64), weightless) == 1  # a generation holds at least one block
    assert estimate_request_blocks(None, s) == 0


def test_the_generation_request_is_found_among_a_calls_arguments():
    request = gen_request("r", 4, 4)
    assert find_request(("model-name", request), {}) is request
    assert find_request((), {"request": request}) is request
    assert find_request(("check_health",), {"timeout": 1}) is None
