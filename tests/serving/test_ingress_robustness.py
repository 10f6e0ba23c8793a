"""Ingress-side robustness in-process (no Ray), against the scripted handle of test_api_unit:
- a request that failed in the engine is a 500 `request_failed` (an error event mid-stream), not retried;
- a slow reader's backlog is bounded: past `max_stream_buffer_tokens` the replica calls are cancelled
  and the stream ends with a `stream_buffer_overflow` error event;
- logprobs accumulate in linear time;
- tokenizing runs off the event loop: a slow tokenization does not stall another stream;
- a dead engine's replica exits after a grace period (`EngineWatch`), holding calls until then;
- /openapi.json and /docs only behind `openapi_docs`.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from serve_app.serving.engine_watch import EngineWatch
from serve_app.serving.llm_server import GenerationChunk
from serve_app.serving.responses import ChoiceState
from serve_app.serving.streams import ChoicePump
from serve_app.types import GenerateRequest, RequestFailedError, TokenLogprob
from tests.serving.test_api_unit import (
    CHAT,
    MODEL,
    FakeHandle,
    FakeResponse,
    chunk,
    error_of,
    in_replica,
    make_client,
    sse_payloads,
)


def test_request_failure_is_a_500_and_not_retried():
    handle = FakeHandle(lambda req, attempt: FakeResponse([in_replica(RequestFailedError("sample failed: boom", "sample"))]))

    async def main():
        async with make_client(handle) as c:
            error = error_of(await c.post("/v1/chat/completions", json=CHAT), 500)
            assert error["code"] == "request_failed" and "sample" in error["message"] and "boom" not in error["message"]

    asyncio.run(main())
    assert len(handle.calls) == 1  # the same request would fail the same way elsewhere


def test_request_failure_mid_stream_is_an_error_event():
    handle = FakeHandle(lambda req, attempt: FakeResponse([chunk("a"), chunk("b"), in_replica(RequestFailedError("x", "detokenize"))]))

    async def main():
        async with make_client(handle) as c:
            r = await c.post("/v1/completions", json={"model": MODEL, "prompt": "x", "stream": True})
            payloads = sse_payloads(r.text)
            assert payloads[-1]["error"]["code"] == "request_failed"

    asyncio.run(main())


class EndlessStream:
    """A started stream whose replica keeps producing chunks with 20 logprob alternatives each."""

    def __init__(self) -> None:
        self.closed = False
        self.produced = 0

    async def rest(self):
        top = tuple((i, "t", -1.0) for i in range(20))
        while not self.closed:
            self.produced += 1
            yield GenerationChunk("x", (5,), False, None, 3, logprobs=(TokenLogprob(5, "x", -0.5, top),))
            await asyncio.sleep(0)

    def close(self) -> None:
        self.closed = True


def test_slow_reader_overflow_ends_the_stream_and_cancels_the_work():
    async def main():
        streams = [EndlessStream(), EndlessStream()]
        pump = ChoicePump(streams, max_buffered=2048).start()
        await asyncio.sleep(0.5)  # the reader does not read
        assert all(s.closed for s in streams)  # the replica calls are cancelled
        assert max(s.produced for s in streams) < 2048  # bounded: 21 tokens' worth per chunk
        with pytest.raises(Exception) as info:
            await pump.next_batch(1.0)
        assert getattr(info.value, "code", None) == "stream_buffer_overflow"
        await pump.close()

    asyncio.run(main())


def test_a_reader_that_keeps_up_never_overflows():
    async def main():
        stream = EndlessStream()
        pump = ChoicePump([stream], max_buffered=2048).start()
        deadline = time.monotonic() + 0.5
        taken = 0
        while time.monotonic() < deadline:
            taken += len(await pump.next_batch(1.0))
        assert not stream.closed and taken > 100 and pump.buffered <= 2048
        await pump.close()

    asyncio.run(main())


def test_logprob_accumulation_is_linear():
    top = tuple((i, "t", -1.0) for i in range(20))
    chunks = [GenerationChunk("x", (5,), False, None, 3, logprobs=(TokenLogprob(5, "x", -0.5, top),)) for _ in range(40_000)]
    state = ChoiceState(prompt_index=0)
    start = time.perf_counter()
    for c in chunks:
        state.add(c)
    assert len(state.logprobs) == 40_000
    assert time.perf_counter() - start < 2.0  # quadratic copying took minutes at this size


class SlowTokenizer:
    """An input processor whose tokenizing takes 1 s (a huge chat), holding no lock but the GIL's."""

    def process(self, request: GenerateRequest):
        time.sleep(1.0)
        raise ValueError("prompt: too long (after 1 s of tokenizing)")


def test_tokenizing_runs_off_the_event_loop():
    import httpx

    from serve_app.serving.api import OpenAIAPI, build_fastapi_app
    from serve_app.serving.config import ServeConfig
    from tests.serving.test_api_unit import INFO

    api = OpenAIAPI(FakeHandle(lambda r, a: FakeResponse([])), ServeConfig(model="unused"), INFO, input_processor=SlowTokenizer())
    app = build_fastapi_app(api)

    async def ticker(gaps: list[float]) -> None:
        last = time.monotonic()
        for _ in range(40):
            await asyncio.sleep(0.02)
            now = time.monotonic()
            gaps.append(now - last)
            last = now

    async def main():
        gaps: list[float] = []
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as c:
            tick = asyncio.create_task(ticker(gaps))
            r = await c.post("/v1/chat/completions", json=CHAT)
            await tick
        error_of(r, 400)
        assert max(gaps) < 0.5, max(gaps)  # the loop kept turning while the tokenizer worked

    asyncio.run(main())


def test_engine_watch_exits_after_grace_and_holds_calls():
    async def main():
        state = {"healthy": True, "exited_at": None}

        def check():
            if not state["healthy"]:
                raise RuntimeError("engine loop died")

        def exit_process():
            state["exited_at"] = time.monotonic()

        watch = EngineWatch(check, exit_process, period_s=0.01, grace_s=0.2)
        await asyncio.sleep(0.1)
        assert state["exited_at"] is None and watch.dead is None
        died = time.monotonic()
        state["healthy"] = False
        await watch.wait_for_exit()  # held until the (fake) exit
        assert state["exited_at"] is not None and 0.2 <= state["exited_at"] - died < 1.0
        assert isinstance(watch.dead, RuntimeError)

    asyncio.run(main())


def test_openapi_schema_only_behind_the_switch():
    async def main():
        async with make_client(FakeHandle(lambda r, a: FakeResponse([]))) as c:
            assert (await c.get("/openapi.json")).status_code == 404
            assert (await c.get("/docs")).status_code == 404
        async with make_client(FakeHandle(lambda r, a: FakeResponse([])), openapi_docs=True) as c:
            schema = (await c.get("/openapi.json")).json()
            assert {"/v1/completions", "/v1/chat/completions", "/v1/models"} <= set(schema["paths"])
            assert (await c.get("/docs")).status_code == 200

    asyncio.run(main())


def test_fuzz_properties_catch_what_they_must():
    from httpx import Headers

    from tests.serving.api_fuzz import check_response

    json_headers = Headers({"content-type": "application/json"})
    error = b'{"error": {"message": "m", "type": "invalid_request_error", "param": null, "code": null}}'
    assert check_response(400, json_headers, error) is None
    assert check_response(503, Headers({"retry-after": "1"}), error) is None
    assert check_response(503, json_headers, error) == "503 without Retry-After"
    assert check_response(500, json_headers, error).startswith("500")
    assert check_response(502, json_headers, b"Bad Gateway").startswith("502 without")
    assert check_response(422, json_headers, b'{"detail": []}').startswith("422 without an OpenAI")
    sse = Headers({"content-type": "text/event-stream"})
    assert check_response(200, sse, b'data: {"choices": []}\n\ndata: [DONE]\n\n') is None
    assert check_response(200, sse, b'data: {"choices": []}\n\n') is not None
    assert check_response(200, sse, b'data: {"error": {"code": "engine_error"}}\n\ndata: [DONE]\n\n') is not None
