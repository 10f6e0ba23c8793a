"""Tool calling on the HTTP API in-process (scripted replica, no Ray): every bad `tools` / `tool_choice` /
tool message is a 400 naming the field before anything reaches the engine; what reaches the engine
(rendered messages, stop strings, the output constraint); the exact response and stream shapes of
tool calls, read back with the official `openai` client's stream helpers."""

from __future__ import annotations

import json

import httpx
import openai
import pydantic
import pytest

from serve_app.backends.base import ModelInfo
from serve_app.request_limits import (
    MAX_TOOL_NAME_CHARS,
    MAX_TOOL_SCHEMA_CHARS,
    MAX_TOOL_SCHEMA_DEPTH,
    MAX_TOOLS,
)
from serve_app.serving.api import OpenAIAPI, build_fastapi_app
from serve_app.serving.config import ServeConfig
from serve_app.serving.llm_server import GenerationChunk
from serve_app.serving.tool_prompt import TOOLS_SECTION
from tests.serving.test_api_unit import (
    CHAT,
    MODEL,
    FakeHandle,
    FakeResponse,
    error_of,
    ok_script,
    run,
    sse_payloads,
)

ADMITTED = GenerationChunk("", (), False, None, 5)
PARAMS = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city", "parameters": PARAMS}}
NOW = {"type": "function", "function": {"name": "now"}}
USER = {"role": "user", "content": "Weather in Paris?"}
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}


def tool(name: str = "f", **function) -> dict:
    return {"type": "function", "function": {"name": name, **function}}


def nested(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


def app_client(handle: FakeHandle, template_tools: bool = False) -> httpx.AsyncClient:
    info = ModelInfo(name=MODEL, max_model_len=4096, backend="fake", chat_template_tools=template_tools)
    app = build_fastapi_app(OpenAIAPI(handle, ServeConfig(model="unused"), info))
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t", timeout=30)


BAD = [
    ({"tools": {"type": "function"}}, "tools", "invalid_type", "valid list"),
    ({"tools": [tool(f"f{i}") for i in range(MAX_TOOLS + 1)]}, "tools", "invalid_type", f"at most {MAX_TOOLS} items"),
    ({"tools": [tool("x" * (MAX_TOOL_NAME_CHARS + 1))]}, "tools.0.function.name", "invalid_type", f"at most {MAX_TOOL_NAME_CHARS}"),
    ({"tools": [tool("get weather")]}, "tools.0.function.name", "invalid_type", "match pattern"),
    ({"tools": [tool("")]}, "tools.0.function.name", "invalid_type", "at least 1"),
    ({"tools": [{"type": "retrieval", "function": {"name": "f"}}]}, "tools.0.type", "invalid_type", "'function'"),
    ({"tools": [tool(strictt=True)]}, "tools.0.function.strictt", "unknown_parameter", "unrecognized"),
    ({"tools": [{"type": "function"}]}, "tools.0.function", "missing_required_parameter", "required"),
    ({"tools": [tool("f"), tool("g"), tool("f")]}, "tools.2.function.name", "invalid_value", "duplicate function name 'f'"),
    ({"tools": [tool(parameters={"type": "string"})]}, "tools.0.function.parameters", "invalid_value", "type 'object'"),
    ({"tools": [tool(parameters={"type": "object", "properties": {"a": {"type": "text"}}})]},
     "tools.0.function.parameters.properties.a.type", "invalid_value", "not a valid JSON schema"),
    ({"tools": [tool(parameters={"type": "object", "required": "a"})]}, "tools.0.function.parameters.required", "invalid_value",
     "not a valid JSON schema"),
    ({"tools": [tool(parameters=nested(MAX_TOOL_SCHEMA_DEPTH))]}, "tools.0.function.parameters", "invalid_value",
     f"deeper than {MAX_TOOL_SCHEMA_DEPTH}"),
    ({"tools": [tool(parameters={"type": "object", "description": "x" * MAX_TOOL_SCHEMA_CHARS})]}, "tools.0.function.parameters",
     "invalid_value", f"limit of {MAX_TOOL_SCHEMA_CHARS}"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice", "invalid_value", "'none', 'auto', 'required'"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_time"}}}, "tool_choice.function.name",
     "invalid_value", "no function named 'get_time'"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "get_weather"}}, "tool_choice", "invalid_value",
     "{'type': 'function', 'function': {'name': ...}}"),
    ({"tools": [WEATHER], "tool_choice": 3}, "tool_choice", "invalid_type", ""),
    ({"tool_choice": "required"}, "tool_choice", "invalid_value", "only allowed when tools are given"),
    ({"parallel_tool_calls": False}, "parallel_tool_calls", "invalid_value", "only allowed when tools are given"),
    ({"tools": [WEATHER], "parallel_tool_calls": "no"}, "parallel_tool_calls", "invalid_type", "valid boolean"),
    ({"tools": [WEATHER], "parallel_tool_calls": False, "stop": [f"s{i}" for i in range(16)]}, "stop", "invalid_value",
     "at most 15 stop strings with parallel_tool_calls false"),
    ({"functions": [{"name": "f"}]}, "functions", "unsupported_parameter", "use tools and tool_choice"),
    ({"function_call": "auto"}, "function_call", "unsupported_parameter", "use tools and tool_choice"),
    ({"messages": [{"role": "function", "name": "f", "content": "x"}]}, "messages.0", "unsupported_parameter", "role 'tool'"),
    ({"messages": [USER, {"role": "tool", "content": "18 C"}]}, "messages.1.tool_call_id", "invalid_value", "required for role 'tool'"),
    ({"messages": [{**USER, "tool_call_id": "call_1"}]}, "messages.0.tool_call_id", "invalid_value", "only allowed for role 'tool'"),
    ({"messages": [{**USER, "tool_calls": [CALL]}]}, "messages.0.tool_calls", "invalid_value", "only allowed for role 'assistant'"),
    ({"messages": [USER, {"role": "assistant", "tool_calls": [{**CALL, "function": {"name": "f", "arguments": "[1]"}}]}]},
     "messages.1.tool_calls.0.function.arguments", "invalid_value", "must be a JSON object"),
    ({"messages": [USER, {"role": "assistant", "tool_calls": [{**CALL, "type": "code"}]}]}, "messages.1.tool_calls.0.type",
     "invalid_type", "'function'"),
    ({"messages": [USER, {"role": "assistant", "tool_calls": [CALL]}, {"role": "tool", "tool_call_id": "call_2", "content": "x"}]},
     "messages.2.tool_call_id", "invalid_value", "'call_2' answers no tool call"),
]


@pytest.mark.parametrize(("body", "param", "code", "words"), BAD, ids=[b[1] + "-" + str(i) for i, b in enumerate(BAD)])
def test_bad_tool_fields_are_400_naming_them(body, param, code, words):
    handle = FakeHandle(ok_script)

    async def main():
        async with app_client(handle) as c:
            return error_of(await c.post("/v1/chat/completions", json={**CHAT, **body}), 400)

    error = run(main())
    assert (error["param"], error["code"], error["type"]) == (param, code, "invalid_request_error"), error
    assert words in error["message"], error
    assert handle.calls == []  # nothing reached the engine


def test_what_reaches_the_engine():
    handle = FakeHandle(ok_script)
    history = [USER, {"role": "assistant", "content": "Checking.", "tool_calls": [CALL]},
               {"role": "tool", "tool_call_id": "call_1", "content": "18 C"}]

    async def main():
        async with app_client(handle) as c:
            for body in ({"tools": [WEATHER, NOW]}, {"tools": [WEATHER], "parallel_tool_calls": False, "stop": "x"},
                         {"tools": [WEATHER], "tool_choice": "none", "messages": history}):
                r = await c.post("/v1/chat/completions", json={**CHAT, **body})
                assert r.status_code == 200, r.text
        async with app_client(handle, template_tools=True) as c:
            r = await c.post("/v1/chat/completions", json={**CHAT, "tools": [WEATHER], "messages": history})
            assert r.status_code == 200, r.text

    run(main())
    auto, single, none, native = handle.calls
    now = {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {},
                                                                         "additionalProperties": False}}}
    assert auto.messages == ({"role": "system", "content": TOOLS_SECTION.format(tools=f"{json.dumps(WEATHER)}\n{json.dumps(now)}")},
                             {"role": "user", "content": "hi"})
    assert auto.tools is None and auto.sampling_params.stop == ()
    assert single.sampling_params.stop == ("x", "</tool_call>")  # one call: generation ends at its closing tag
    assert none.messages == (USER, {"role": "assistant", "content": 'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": '
                                                                    '{"city": "Paris"}}\n</tool_call>'},
                             {"role": "user", "content": "<tool_response>\n18 C\n</tool_response>"})
    assert native.tools == (WEATHER,)  # the template renders tools, calls and results itself
    assert native.messages == (USER, {"role": "assistant", "content": "Checking.", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": "18 C", "tool_call_id": "call_1"})
    assert all(getattr(c.sampling_params, "structured", None) is None for c in handle.calls)  # auto and none: unconstrained


def test_constrained_modes_reach_the_engine_as_json_schemas():
    handle = FakeHandle(ok_script)
    call = {"type": "object", "properties": {"name": {"const": "get_weather"}, "arguments": PARAMS}, "required": ["name", "arguments"],
            "additionalProperties": False}
    no_args = {"type": "object", "properties": {}, "additionalProperties": False}
    now_call = {**call, "properties": {"name": {"const": "now"}, "arguments": no_args}}

    async def main():
        async with app_client(handle) as c:
            for body in ({"tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
                         {"tool_choice": {"type": "function", "function": {"name": "now"}}},
                         {"tool_choice": "required", "parallel_tool_calls": False},
                         {"tool_choice": "required"}):
                r = await c.post("/v1/chat/completions", json={**CHAT, "tools": [WEATHER, NOW], **body})
                assert r.status_code == 200, r.text
            big = [tool(f"f{i}", parameters={"type": "object", "description": "x" * 30000}) for i in range(3)]
            return error_of(await c.post("/v1/chat/completions", json={**CHAT, "tools": big, "tool_choice": "required"}), 400)

    error = run(main())
    assert error["param"] == "tools" and "over the limit of 65536" in error["message"]
    schemas = [json.loads(c.sampling_params.structured.json_schema) for c in handle.calls]
    assert schemas == [PARAMS, no_args, {"anyOf": [call, now_call]},
                       {"type": "array", "items": {"anyOf": [call, now_call]}, "minItems": 1}]
    assert all(c.sampling_params.stop == () for c in handle.calls)


# ---- response shapes ---------------------------------------------------------------------------------
def scripted(*pieces: str, reason: str = "stop"):
    def script(request, attempt):
        chunks = [GenerationChunk(p, (7,), False, None, 5) for p in pieces[:-1]]
        return FakeResponse([ADMITTED, *chunks, GenerationChunk(pieces[-1], (8,), True, reason, 5)])
    return script


TWO_CALLS = ('<tool_call>\n{"name": "get_weather", ', '"arguments": {"city": "Paris"}}\n</tool_call>\n<tool_call>\n{"name": "now"}',
             "\n</tool_call>")


def test_auto_calls_non_streamed():
    async def main():
        async with app_client(FakeHandle(scripted(*TWO_CALLS))) as c:
            return (await c.post("/v1/chat/completions", json={**CHAT, "tools": [WEATHER, NOW], "n": 2})).json()

    body = run(main())
    for i, choice in enumerate(body["choices"]):
        calls = choice["message"]["tool_calls"]
        assert choice["message"] == {"role": "assistant", "content": None, "tool_calls": [
            {"id": calls[0]["id"], "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
            {"id": calls[1]["id"], "type": "function", "function": {"name": "now", "arguments": "{}"}}]}
        assert (choice["index"], choice["finish_reason"]) == (i, "tool_calls")
        assert all(c["id"].startswith("call_") and len(c["id"]) == 29 for c in calls)
    ids = [c["id"] for choice in body["choices"] for c in choice["message"]["tool_calls"]]
    assert len(set(ids)) == 4


def test_auto_stream_shape():
    async def main():
        async with app_client(FakeHandle(scripted("I will check. ", *TWO_CALLS))) as c:
            r = await c.post("/v1/chat/completions", json={**CHAT, "tools": [WEATHER, NOW], "stream": True})
            return sse_payloads(r.text)

    chunks = run(main())
    choices = [c["choices"][0] for c in chunks]
    assert all(len(c["choices"]) == 1 and c["object"] == "chat.completion.chunk" for c in chunks)
    ids = [c["delta"]["tool_calls"][0].get("id") for c in choices if "tool_calls" in c["delta"]]
    assert [(c["delta"], c["finish_reason"]) for c in choices] == [
        ({"role": "assistant", "content": None}, None),
        ({"content": "I will check."}, None),
        ({"tool_calls": [{"index": 0, "id": ids[0], "type": "function", "function": {"name": "get_weather", "arguments": ""}}]}, None),
        ({"tool_calls": [{"index": 0, "function": {"arguments": '{"city": "Paris"}'}}]}, None),
        ({"tool_calls": [{"index": 1, "id": ids[2], "type": "function", "function": {"name": "now", "arguments": ""}}]}, None),
        ({"tool_calls": [{"index": 1, "function": {"arguments": "{}"}}]}, "tool_calls"),
    ]


class Weather(pydantic.BaseModel):
    city: str


def test_stream_helper_accumulates_calls():
    """The official client's `chat.completions.stream` (ChatCompletionStreamState) rebuilds the calls,
    with arguments in several pieces, and parses strict function tools into their pydantic models."""
    pieces = ('<tool_call>{"name": "Weather", "arguments": ', '{"city"', ': "Par', 'is"}}', "</tool_call>")

    async def main():
        async with app_client(FakeHandle(scripted(*pieces))) as http:
            client = openai.AsyncOpenAI(base_url="http://t/v1", api_key="x", http_client=http, max_retries=0)
            kinds = []
            async with client.chat.completions.stream(model=MODEL, messages=[USER],
                                                      tools=[openai.pydantic_function_tool(Weather)]) as stream:
                async for event in stream:
                    kinds.append(event.type)
                final = await stream.get_final_completion()
            plain = await client.chat.completions.create(model=MODEL, messages=[USER], tools=[openai.pydantic_function_tool(Weather)])
            return kinds, final, plain

    kinds, final, plain = run(main())
    for completion in (final, plain):
        choice = completion.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        (call,) = choice.message.tool_calls
        assert (call.type, call.function.name, call.function.arguments) == ("function", "Weather", '{"city": "Paris"}')
    assert final.choices[0].message.tool_calls[0].function.parsed_arguments == Weather(city="Paris")
    assert kinds.count("tool_calls.function.arguments.done") == 1 and "content.delta" not in kinds


def test_a_constraint_the_engine_rejects_names_tools():
    """The engine compiles the tools' schemas; what it cannot compile is a 400 on `tools` (outside a
    constrained tool choice the engine's `structured` keeps its API name)."""
    from tests.serving.test_api_unit import in_replica

    def script(request, attempt):
        return FakeResponse([in_replica(ValueError("structured: invalid json_schema: unsupported pattern"))])

    async def main():
        async with app_client(FakeHandle(script)) as c:
            return [error_of(await c.post("/v1/chat/completions", json={**CHAT, "tools": [WEATHER], **extra}), 400)
                    for extra in ({"tool_choice": "required"}, {"tool_choice": "auto"})]

    required, auto = run(main())
    assert (required["param"], required["code"]) == ("tools", "invalid_value") and "unsupported pattern" in required["message"]
    assert auto["param"] == "structured_outputs"  # the engine field under its API name, as without tools
