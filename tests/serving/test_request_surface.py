"""The OpenAI request surface in-process (scripted replica, no Ray): fields that are rejected with a
400 naming them, generation_config defaults, logprobs shapes through the official client, usage in
every chunk, and a stream's headers and keep-alive comments before the first token."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest

from serve_app.backends.base import ModelInfo
from serve_app.generation_config import GenerationDefaults
from serve_app.serving.api import OpenAIAPI, build_fastapi_app
from serve_app.serving.config import ServeConfig
from serve_app.serving.llm_server import GenerationChunk
from serve_app.types import TokenLogprob
from tests.serving.test_api_unit import (
    CHAT,
    MODEL,
    FakeHandle,
    FakeResponse,
    error_of,
    make_client,
    ok_script,
    run,
    sse_payloads,
)

ADMITTED = GenerationChunk("", (), False, None, 3)


def lp(token_id: int, token: str, value: float) -> TokenLogprob:
    return TokenLogprob(token_id, token, value, ((token_id, token, value), (99, " x", float("-inf"))))


def logprob_script(request, attempt):
    return FakeResponse([ADMITTED, GenerationChunk("Hi", (7,), False, None, 3, logprobs=(lp(7, "Hi", -0.5),)),
                         GenerationChunk(" you", (8,), True, "stop", 3, logprobs=(lp(8, " you", -1.25),))])


@pytest.mark.parametrize(("body", "param"), [
    ({"parallel_tool_calls": True}, "parallel_tool_calls"),
    ({"temperature": 2.5}, "temperature"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "hi", "nmae": "typo"}]}, "messages.0.nmae"),
    ({"messages": [{"role": "assistant", "content": "no", "refusal": "I can't"}]}, "messages.0.refusal"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
    ({"logit_bias": {"1": 101}}, "logit_bias"),
    ({"logit_bias": {"x": 1}}, "logit_bias"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"stream_options": {"include_usage": True, "continuous": True}, "stream": True}, "stream_options.continuous"),
])
def test_rejected_fields_are_400_naming_them(body, param):
    handle = FakeHandle(ok_script)

    async def main():
        async with make_client(handle) as c:
            error = error_of(await c.post("/v1/chat/completions", json={**CHAT, **body}), 400)
            assert error["param"] == param, error

    run(main())
    assert handle.calls == []


@pytest.mark.parametrize(("body", "param"), [({"echo": True, "logprobs": 1}, "echo"), ({"best_of": 3}, "best_of"), ({"suffix": "x"}, "suffix"),
                                             ({"logprobs": 21}, "logprobs"), ({"temperature": 2.01}, "temperature")])
def test_rejected_completion_fields(body, param):
    handle = FakeHandle(ok_script)

    async def main():
        async with make_client(handle) as c:
            error = error_of(await c.post("/v1/completions", json={"model": MODEL, "prompt": "x", **body}), 400)
            assert error["param"] == param, error

    run(main())
    assert handle.calls == []


def test_supported_extensions_reach_the_engine_and_defaults_fill_the_rest():
    handle = FakeHandle(ok_script)
    defaults = GenerationDefaults(frozenset({2}), (("temperature", 0.6), ("top_p", 0.9), ("repetition_penalty", 1.1)))
    info = ModelInfo(name=MODEL, max_model_len=128, backend="fake", generation_defaults=defaults)
    app = build_fastapi_app(OpenAIAPI(handle, ServeConfig(model="unused"), info))

    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            r = await c.post("/v1/chat/completions", json={**CHAT, "top_p": 0.5, "presence_penalty": 0.5, "frequency_penalty": -1.0,
                                                           "min_tokens": 2, "stop_token_ids": [5, 6], "logprobs": True,
                                                           "top_logprobs": 3, "messages": [{"role": "user", "content": "hi", "name": "ann"}]})
            assert r.status_code == 200, r.text
            r = await c.post("/v1/completions", json={"model": MODEL, "prompt": "x", "repetition_penalty": 1.3, "logprobs": 2})
            assert r.status_code == 200, r.text

    run(main())
    chat, completion = handle.calls[0], handle.calls[1]
    p = chat.sampling_params
    assert (p.temperature, p.top_p, p.repetition_penalty) == (0.6, 0.5, 1.1)  # request wins, checkpoint fills the rest
    assert (p.presence_penalty, p.frequency_penalty, p.min_tokens, p.stop_token_ids, p.logprobs) == (0.5, -1.0, 2, (5, 6), 3)
    assert p.max_tokens is None  # chat without max_tokens: the room left (filled in by the engine)
    assert chat.messages == ({"role": "user", "content": "hi", "name": "ann"},)
    q = completion.sampling_params
    assert (q.repetition_penalty, q.logprobs, q.max_tokens, q.temperature) == (1.3, 2, 16, 0.6)


def test_logprobs_shapes_through_the_openai_client():
    cfg = ServeConfig(model="unused")
    app = build_fastapi_app(OpenAIAPI(FakeHandle(logprob_script), cfg, ModelInfo(MODEL, 128, "fake")))

    async def main():
        http_client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app))
        client = openai.AsyncOpenAI(base_url="http://test/v1", api_key="x", http_client=http_client, max_retries=0)
        chat = await client.chat.completions.create(model=MODEL, messages=CHAT["messages"], logprobs=True, top_logprobs=2)
        content = chat.choices[0].logprobs.content
        assert [(c.token, c.logprob, c.bytes) for c in content] == [("Hi", -0.5, [72, 105]), (" you", -1.25, list(b" you"))]
        assert [(t.token, t.logprob) for t in content[0].top_logprobs] == [("Hi", -0.5), (" x", -9999.0)]
        done = await client.completions.create(model=MODEL, prompt="x", logprobs=2)
        lps = done.choices[0].logprobs
        assert lps.tokens == ["Hi", " you"] and lps.token_logprobs == [-0.5, -1.25] and lps.text_offset == [0, 2]
        assert lps.top_logprobs[1] == {" you": -1.25, " x": -9999.0}
        stream = await client.completions.create(model=MODEL, prompt="x", logprobs=1, stream=True)
        offsets = [o for ev in [e async for e in stream] for ch in ev.choices if ch.logprobs for o in ch.logprobs.text_offset]
        assert offsets == [0, 2]
        await http_client.aclose()

    run(main())


def test_continuous_usage_stats():
    async def main():
        async with make_client(FakeHandle(ok_script)) as c:
            body = {**CHAT, "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
            payloads = sse_payloads((await c.post("/v1/chat/completions", json=body)).text)
            with_text = [p for p in payloads if p["choices"] and p["choices"][0]["delta"].get("content")]
            assert [p["usage"]["completion_tokens"] for p in with_text] == [1, 2, 3]
            assert all(p["choices"][0]["logprobs"] is None for p in with_text)  # not asked for
            assert payloads[-1]["choices"] == [] and payloads[-1]["usage"]["total_tokens"] == 6

    run(main())


class GatedResponse(FakeResponse):
    """The admission chunk at once; the tokens only after `gate` is set."""

    def __init__(self, gate: asyncio.Event) -> None:
        super().__init__([ADMITTED, GenerationChunk("Hello", (7,), True, "stop", 3)])
        self.gate = gate

    async def __anext__(self):
        if len(self._items) == 1:
            await self.gate.wait()
        return await super().__anext__()


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_stream_headers_and_keepalives_go_out_before_the_first_token(path):
    """Driven at the ASGI level: the token is released only once the client has received the
    status line and at least one keep-alive comment."""
    gate = asyncio.Event()
    handle = FakeHandle(lambda req, attempt: GatedResponse(gate))
    app = build_fastapi_app(OpenAIAPI(handle, ServeConfig(model="unused", stream_keepalive_s=0.05), ModelInfo(MODEL, 128, "fake")))
    body = {**CHAT, "stream": True} if "chat" in path else {"model": MODEL, "prompt": "x", "stream": True}
    sent: list[dict] = []
    requested: list[bool] = []
    response_done = asyncio.Event()

    async def receive():  # the body once, then (like a server) a disconnect only after the response
        if not requested:
            requested.append(True)
            return {"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}
        await response_done.wait()
        return {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)
        if message["type"] == "http.response.body" and b": keep-alive" in message.get("body", b""):
            gate.set()
        if message["type"] == "http.response.body" and not message.get("more_body", False):
            response_done.set()

    async def main():
        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "path": path,
                 "raw_path": path.encode(), "query_string": b"", "root_path": "", "scheme": "http",
                 "headers": [(b"content-type", b"application/json")], "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80)}
        async with asyncio.timeout(30):
            await app(scope, receive, send)

    run(main())
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 200
    bodies = b"".join(m.get("body", b"") for m in sent[1:])
    assert bodies.index(b": keep-alive") < bodies.index(b"Hello") < bodies.index(b"[DONE]")
