"""Tool calling end to end: the official `openai` client against a real server (Ray Serve on 127.0.0.1,
SmolLM2-135M, fp32, greedy unless a seed says otherwise).

- auto: a message the model answers with text comes back as content, no calls, finish_reason "stop";
- required and a named function: the output is constrained by the tools' JSON schemas, so every
  call's arguments parse and validate (jsonschema), streamed or not, one call or several
  (`parallel_tool_calls`), with n > 1; finish_reason "tool_calls"; the stream, accumulated by the
  client's stream helper, is the non-streamed answer;
- a conversation with an assistant `tool_calls` turn and a `tool` result reaches the model in the
  documented generic format (its prompt-token count is that rendering's).
"""

from __future__ import annotations

import json

import jsonschema
import pytest

from serve_app.input_processor import InputProcessor
from serve_app.serving.openai_protocol import ChatCompletionRequest
from serve_app.serving.tool_prompt import render_chat
from tests.serving.conftest import MODEL_NAME, app_args, serve_app

WEATHER_PARAMS = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "London", "Tokyo"]},
                                                   "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                  "required": ["city", "unit"], "additionalProperties": False}
TIME_PARAMS = {"type": "object", "properties": {"utc_offset": {"type": "integer", "minimum": -12, "maximum": 14}},
               "required": ["utc_offset"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city", "parameters": WEATHER_PARAMS}},
         {"type": "function", "function": {"name": "get_time", "description": "Current time at a UTC offset", "parameters": TIME_PARAMS}}]
SCHEMAS = {"get_weather": WEATHER_PARAMS, "get_time": TIME_PARAMS}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
MAX_TOKENS = 96


@pytest.fixture(scope="module")
def app(ray_cluster, model_dir):
    with serve_app(ray_cluster, app_args(num_replicas=1)) as served:
        yield served


def calls_of(message) -> list[tuple[str, dict]]:
    """(name, arguments) of each call, every arguments parsed and validated against its tool's schema."""
    out = []
    for call in message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_")
        arguments = json.loads(call.function.arguments)
        jsonschema.validate(arguments, SCHEMAS[call.function.name])
        out.append((call.function.name, arguments))
    return out


def streamed(client, **kwargs):
    with client.chat.completions.stream(model=MODEL_NAME, **kwargs) as stream:
        for _ in stream:
            pass
        return stream.get_final_completion()


def test_auto_answers_with_text(client):
    kwargs = dict(messages=[{"role": "user", "content": "Say hello to me in one short sentence."}], tools=TOOLS,
                  temperature=0, max_tokens=32)
    plain = client.chat.completions.create(model=MODEL_NAME, **kwargs)
    final = streamed(client, **kwargs)
    for r in (plain, final):
        choice = r.choices[0]
        assert choice.finish_reason == "stop" and not choice.message.tool_calls
        assert choice.message.content == "Hello, I'm here to help with your data analysis."


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
def test_named_function_arguments_validate(client, stream):
    kwargs = dict(messages=ASK, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}},
                  temperature=0, max_tokens=MAX_TOKENS)
    r = streamed(client, **kwargs) if stream else client.chat.completions.create(model=MODEL_NAME, **kwargs)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert calls_of(choice.message) == [("get_weather", {"city": "Paris", "unit": "celsius"})]


def test_named_function_sampled_choices(client):
    r = client.chat.completions.create(model=MODEL_NAME, messages=ASK, tools=TOOLS, n=3, temperature=1.0, seed=11,
                                       tool_choice={"type": "function", "function": {"name": "get_time"}}, max_tokens=MAX_TOKENS)
    assert [c.index for c in r.choices] == [0, 1, 2]
    for choice in r.choices:
        assert choice.finish_reason == "tool_calls"
        assert [name for name, _ in calls_of(choice.message)] == ["get_time"]


@pytest.mark.parametrize("parallel", [True, False], ids=["parallel", "single"])
def test_required_arguments_validate_streamed_and_not(client, parallel):
    kwargs = dict(messages=ASK, tools=TOOLS, tool_choice="required", parallel_tool_calls=parallel, temperature=0,
                  max_tokens=MAX_TOKENS)
    plain = client.chat.completions.create(model=MODEL_NAME, **kwargs)
    final = streamed(client, **kwargs)
    results = []
    for r in (plain, final):
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        calls = calls_of(choice.message)
        assert len(calls) >= 1 and (parallel or len(calls) == 1)
        results.append(calls)
    assert results[0] == results[1]  # the stream accumulates to the non-streamed answer


def test_required_sampled_choices_validate(client):
    r = client.chat.completions.create(model=MODEL_NAME, messages=ASK, tools=TOOLS, tool_choice="required", n=3,
                                       temperature=1.0, seed=5, max_tokens=MAX_TOKENS, stream=False)
    for choice in r.choices:
        assert choice.finish_reason == "tool_calls"
        assert calls_of(choice.message)


def test_conversation_with_a_tool_result(client, model_dir):
    messages = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_abc", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
                {"role": "tool", "tool_call_id": "call_abc", "content": "Sunny, 24 C"}]
    r = client.chat.completions.create(model=MODEL_NAME, messages=messages, tools=TOOLS, temperature=0, max_tokens=8)
    body = ChatCompletionRequest.model_validate({"model": MODEL_NAME, "messages": messages, "tools": TOOLS})
    rendered, _ = render_chat(body.engine_messages(), body.tool_request(), template_renders=False)
    processor = InputProcessor(model_dir, 49152, 8192)
    ids = processor.apply_chat_template(rendered)
    assert "<tool_response>\nSunny, 24 C\n</tool_response>" in processor.hf_tokenizer.decode(ids)
    assert r.usage.prompt_tokens == len(ids)
    choice = r.choices[0]
    assert choice.finish_reason == "length" and isinstance(choice.message.content, str) and choice.message.content
