"""Constrained tool calls on random-weight checkpoints (tests/engine/tiny_checkpoints.py): a model that
knows nothing still produces arguments that parse and validate when `tool_choice` is required or a
named function, because the engine's structured outputs constrain every token. Llama- and
Qwen2-style configs with SmolLM2's byte-level tokenizer (a JSON grammar needs punctuation tokens),
sampled and greedy, streamed through the offline engine."""

from __future__ import annotations

import pytest

from serve_app.engine import LLM
from tests.engine import tiny_checkpoints as tiny
from tests.serving.test_tool_calling import ASK, TOOLS
from tests.serving.tool_requests import read_calls, tool_request, validated_calls

MAX_TOKENS = 64
CHOICES = [  # (tool_choice fields, sampling) : greedy and sampled
    ({"tool_choice": {"type": "function", "function": {"name": "get_weather"}}}, {"temperature": 0}),
    ({"tool_choice": {"type": "function", "function": {"name": "get_time"}}}, {"temperature": 1.0, "seed": 1}),
    ({"tool_choice": "required", "parallel_tool_calls": False}, {"temperature": 0}),
    ({"tool_choice": "required", "parallel_tool_calls": False}, {"temperature": 1.0, "seed": 2}),
    ({"tool_choice": "required"}, {"temperature": 1.0, "seed": 3}),
]


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def checkpoint(request, tmp_path_factory, model_dir) -> str:
    path = tmp_path_factory.mktemp(f"tools-{request.param}")
    if request.param == "llama":
        config = tiny.llama3_config(vocab_size=tiny.SMOLLM2_VOCAB, bos_token_id=1, eos_token_id=2, max_position_embeddings=2048)
    else:
        config = tiny.qwen2_config(max_position_embeddings=2048)
    tiny.save(tiny.build(config), path)
    tiny.copy_tokenizer(model_dir, path)
    return str(path)


def test_constrained_arguments_validate(checkpoint):
    llm = LLM(checkpoint, dtype="float32", num_blocks=256, block_size=16)
    requests = [tool_request(f"r{i}", {"messages": ASK, "tools": TOOLS, "max_tokens": MAX_TOKENS, **sampling, **choice})
                for i, (choice, sampling) in enumerate(CHOICES)]
    outs = llm.chat([r.messages for r, _ in requests], [r.sampling_params for r, _ in requests])
    for (request, tools), out in zip(requests, outs, strict=True):
        state = read_calls(tools, out.text)
        calls = state.message()["tool_calls"]
        if tools.mode == "required" and tools.parallel:
            # a random model may list calls until max_tokens: every call before the cut validates
            if str(out.finish_reason) == "stop":
                assert len(validated_calls(tools, out.text)) == len(calls) >= 1
            else:
                assert str(out.finish_reason) == "length"
                complete = out.text[:out.text.rindex("}, {") + 1] + "]"
                assert len(validated_calls(tools, complete)) == len(calls) - 1 >= 1
            continue
        assert str(out.finish_reason) == "stop", (request.request_id, out.text)  # ended by the grammar, not max_tokens
        assert state.finish_reason("stop") == "tool_calls"
        names = [name for name, _ in validated_calls(tools, out.text)]
        assert names == ([tools.function] if tools.mode == "function" else [calls[0]["function"]["name"]])


def test_unconstrained_random_model_is_plain_text(checkpoint):
    """The same model under auto: whatever it says stays text (no call, no error)."""
    llm = LLM(checkpoint, dtype="float32", num_blocks=256, block_size=16)
    request, tools = tool_request("auto", {"messages": ASK, "tools": TOOLS, "temperature": 0, "max_tokens": 24})
    (out,) = llm.chat([request.messages], [request.sampling_params])
    assert request.sampling_params.structured is None
    assert validated_calls(tools, out.text) == []
