"""The HTTP layer in-process (no Ray): failure paths that a healthy deployment cannot produce on demand.

`OpenAIAPI` + `build_fastapi_app` run against a scripted fake of the LLMServer handle (same call
shape as Ray Serve's `DeploymentHandle`), through httpx's ASGI transport and the official `openai`
client: engine failure before and during a stream, a replica dying before the first token (retried),
backpressure, timeouts, unexpected exceptions, the health probe, the API-key and body-size guards.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable

import httpx
import openai
import pytest
from ray.exceptions import ActorDiedError, RayTaskError
from ray.serve.exceptions import BackPressureError

from serve_app.backends.base import BackendDeadError, ModelInfo
from serve_app.serving.api import OpenAIAPI, build_fastapi_app
from serve_app.serving.config import ServeConfig
from serve_app.serving.llm_server import GenerationChunk
from serve_app.types import GenerateRequest

MODEL = "fake-model"
INFO = ModelInfo(name=MODEL, max_model_len=128, backend="fake")


def chunk(text: str, finished: bool = False, reason: str | None = None) -> GenerationChunk:
    return GenerationChunk(text, (7,), finished, reason if finished else None, 3)


def in_replica(exc: BaseException) -> BaseException:
    """How an exception raised inside a replica reaches the ingress (wrapped by Ray)."""
    return RayTaskError("generate", "Traceback (most recent call last): ...", exc).as_instanceof_cause()


class FakeResponse:
    """Mimics DeploymentResponseGenerator: `__anext__` and `cancel()`."""

    def __init__(self, items: list, delay_s: float = 0.0) -> None:
        self._items = list(items)
        self._delay_s = delay_s
        self.cancelled = False

    async def __anext__(self):
        if self._delay_s:
            await asyncio.sleep(self._delay_s)
        if self.cancelled:
            raise asyncio.CancelledError
        if not self._items:
            raise StopAsyncIteration
        item = self._items.pop(0)
        if isinstance(item, BaseException):
            raise item
        return item

    def cancel(self) -> None:
        self.cancelled = True


class _Method:
    def __init__(self, fn: Callable) -> None:
        self.remote = fn


class FakeHandle:
    """`script(request, attempt)` returns the FakeResponse for each `generate` call."""

    def __init__(self, script: Callable[[GenerateRequest, int], FakeResponse], healthy: bool = True) -> None:
        self.script = script
        self.healthy = healthy
        self.calls: list[GenerateRequest] = []
        self.serve_ids: list[str] = []  # the Serve internal request id each call was made under
        self.responses: list[FakeResponse] = []
        self.generate = _Method(self._generate)
        self.check_health = _Method(self._check_health)

    def options(self, **_kwargs) -> FakeHandle:
        return self

    def _generate(self, request: GenerateRequest) -> FakeResponse:
        from ray.serve import context as serve_context

        attempt = sum(1 for c in self.calls if c.request_id == request.request_id)
        self.calls.append(request)
        self.serve_ids.append(serve_context._get_serve_request_context()._internal_request_id)
        response = self.script(request, attempt)
        self.responses.append(response)
        return response

    async def _check_health(self) -> None:
        if not self.healthy:
            raise in_replica(BackendDeadError("engine loop died"))


def make_client(handle: FakeHandle, api_key: str = "", root_path: str = "", **config) -> httpx.AsyncClient:
    """A client of the app mounted at `root_path` (as Ray Serve mounts it under a `route_prefix`:
    the prefix stays in the request path and is stated in the ASGI `root_path`)."""
    cfg = ServeConfig(model="unused", **config)
    app = build_fastapi_app(OpenAIAPI(handle, cfg, INFO), api_key=api_key)
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app, root_path=root_path),
                             base_url=f"http://test{root_path}", timeout=30)


def ok_script(request: GenerateRequest, attempt: int) -> FakeResponse:
    return FakeResponse([chunk("Hello"), chunk(" world"), chunk("!", True, "stop")])


CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}


def run(coro):
    return asyncio.run(coro)


def error_of(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


def sse_payloads(text: str) -> list:
    events = [e[len("data: "):] for e in text.split("\n\n") if e]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def test_happy_path_shapes():
    async def main():
        async with make_client(FakeHandle(ok_script)) as c:
            r = await c.post("/v1/chat/completions", json=CHAT)
            body = r.json()
            assert body["choices"][0]["message"] == {"role": "assistant", "content": "Hello world!"}
            assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6,
                                     "prompt_tokens_details": {"cached_tokens": 0}}
            r = await c.post("/v1/chat/completions", json={**CHAT, "stream": True})
            payloads = sse_payloads(r.text)
            assert payloads[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
            assert "".join(p["choices"][0]["delta"].get("content", "") for p in payloads) == "Hello world!"
            assert payloads[-1]["choices"][0]["finish_reason"] == "stop"

    run(main())


def test_engine_failure_before_first_token_is_500():
    handle = FakeHandle(lambda req, attempt: FakeResponse([in_replica(BackendDeadError("engine loop died: boom"))]))

    async def main():
        async with make_client(handle) as c:
            error = error_of(await c.post("/v1/chat/completions", json=CHAT), 500)
            assert error["type"] == "server_error" and error["code"] == "engine_error"
            assert "Traceback" not in error["message"]
            error = error_of(await c.post("/v1/chat/completions", json={**CHAT, "stream": True}), 500)
            assert error["code"] == "engine_error"

    run(main())


def test_engine_failure_mid_stream_is_an_error_event():
    handle = FakeHandle(lambda req, attempt: FakeResponse([chunk("Hel"), chunk("lo"), in_replica(BackendDeadError("died"))]))

    async def main():
        async with make_client(handle) as c:
            r = await c.post("/v1/completions", json={"model": MODEL, "prompt": "x", "stream": True})
            assert r.status_code == 200
            payloads = sse_payloads(r.text)
            assert [p["choices"][0]["text"] for p in payloads[:-1]] == ["Hel", "lo"]
            assert payloads[-1]["error"]["code"] == "engine_error"
            # non-streamed: the whole request fails with a 500
            error_of(await c.post("/v1/completions", json={"model": MODEL, "prompt": "x"}), 500)

    run(main())
    assert all(r.cancelled or not r._items for r in handle.responses)


def test_openai_client_sees_mid_stream_error():
    handle = FakeHandle(lambda req, attempt: FakeResponse([chunk("Hel"), in_replica(BackendDeadError("died"))]))
    cfg = ServeConfig(model="unused")
    app = build_fastapi_app(OpenAIAPI(handle, cfg, INFO))

    async def main():
        http_client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app))
        client = openai.AsyncOpenAI(base_url="http://test/v1", api_key="x", http_client=http_client, max_retries=0)
        stream = await client.chat.completions.create(model=MODEL, messages=CHAT["messages"], stream=True)
        with pytest.raises(openai.APIError):
            async for _ in stream:
                pass
        await http_client.aclose()

    run(main())


def test_replica_death_before_first_token_is_retried():
    def script(request, attempt):
        if attempt == 0:
            return FakeResponse([ActorDiedError()])
        return ok_script(request, attempt)

    handle = FakeHandle(script)

    async def main():
        async with make_client(handle) as c:
            r = await c.post("/v1/chat/completions", json=CHAT)
            assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "Hello world!"

    run(main())
    assert len(handle.calls) == 2 and handle.calls[0].request_id == handle.calls[1].request_id
    assert "/" not in handle.serve_ids[0]  # a single choice keeps the HTTP request's own Serve id


def test_replica_death_retries_are_bounded():
    handle = FakeHandle(lambda req, attempt: FakeResponse([ActorDiedError()]))

    async def main():
        async with make_client(handle, replica_failure_retries=1) as c:
            r = await c.post("/v1/chat/completions", json=CHAT)
            assert error_of(r, 503)["code"] == "replica_unavailable"
            assert r.headers["retry-after"] == "1"

    run(main())
    assert len(handle.calls) == 2


def test_backpressure_is_503_with_retry_after():
    handle = FakeHandle(lambda req, attempt: FakeResponse([BackPressureError(num_queued_requests=9, max_queued_requests=8)]))

    async def main():
        async with make_client(handle, retry_after_s=3) as c:
            r = await c.post("/v1/completions", json={"model": MODEL, "prompt": "x", "stream": True})
            error = error_of(r, 503)
            assert error["code"] == "server_overloaded" and r.headers["retry-after"] == "3"

    run(main())


def test_timeout_is_504_and_cancels_the_replica_call():
    handle = FakeHandle(lambda req, attempt: FakeResponse([chunk("a")] + [chunk("b")] * 100, delay_s=0.05))

    async def main():
        async with make_client(handle, request_timeout_s=0.5) as c:
            error = error_of(await c.post("/v1/completions", json={"model": MODEL, "prompt": "x"}), 504)
            assert error["type"] == "timeout_error"
            r = await c.post("/v1/completions", json={"model": MODEL, "prompt": "x", "stream": True})
            assert r.status_code == 200
            assert sse_payloads(r.text)[-1]["error"]["code"] == "request_timeout"

    run(main())
    assert len(handle.responses) == 2 and all(r.cancelled for r in handle.responses)


def test_n_fans_out_with_distinct_seeds_and_fails_together():
    handle = FakeHandle(ok_script)

    async def main():
        async with make_client(handle) as c:
            r = await c.post("/v1/chat/completions", json={**CHAT, "n": 3, "seed": 10})
            assert [ch["index"] for ch in r.json()["choices"]] == [0, 1, 2]
            assert r.json()["usage"]["prompt_tokens"] == 3  # one prompt

    run(main())
    assert [c.sampling_params.seed for c in handle.calls] == [10, 11, 12]
    assert len({c.request_id for c in handle.calls}) == 3
    # each choice is its own Serve call (routers match routing results to calls by this id)
    assert len(set(handle.serve_ids)) == 3 and all(i.endswith(("/0", "/1", "/2")) for i in handle.serve_ids)

    def script(request, attempt):  # the second choice fails: the others are cancelled
        if request.request_id.endswith("-1"):
            return FakeResponse([chunk("x"), in_replica(BackendDeadError("died"))])
        return FakeResponse([chunk("x")] + [chunk("y")] * 50, delay_s=0.02)

    failing = FakeHandle(script)

    async def main_failing():
        async with make_client(failing) as c:
            error_of(await c.post("/v1/chat/completions", json={**CHAT, "n": 3}), 500)

    run(main_failing())
    assert all(r.cancelled or not r._items for r in failing.responses)


def test_fan_out_is_bounded_before_any_work_starts():
    """A 1 MiB body can carry ~10^5 prompts: the prompt count and n × prompts are bounded with a 400,
    and nothing reaches a replica (no work that admission would then refuse)."""
    handle = FakeHandle(ok_script)
    completion = {"model": MODEL, "max_tokens": 2}

    async def main():
        async with make_client(handle, max_ongoing_requests=16, max_prompts_per_request=8) as c:
            r = await c.post("/v1/completions", json={**completion, "prompt": [[1, 2]] * 9})
            assert error_of(r, 400)["code"] == "too_many_prompts"
            r = await c.post("/v1/completions", json={**completion, "prompt": ["a"] * 100_000})
            error = error_of(r, 400)
            assert (error["param"], error["code"]) == ("prompt", "too_many_prompts") and "100000" in error["message"]
            r = await c.post("/v1/completions", json={**completion, "prompt": ["a"] * 6, "n": 3, "stream": True})
            error = error_of(r, 400)
            assert (error["param"], error["code"]) == ("n", "too_many_choices") and "18" in error["message"]
            assert handle.calls == []
            r = await c.post("/v1/completions", json={**completion, "prompt": ["a"] * 8, "n": 2})  # 16: at the limit
            assert r.status_code == 200 and len(r.json()["choices"]) == 16
            assert len(handle.calls) == 16
        async with make_client(handle, max_ongoing_requests=4) as c:  # chat: n alone is the fan-out
            error = error_of(await c.post("/v1/chat/completions", json={**CHAT, "n": 5}), 400)
            assert (error["param"], error["code"]) == ("n", "too_many_choices")
            assert len(handle.calls) == 16

    run(main())
    with pytest.raises(ValueError, match="^max_prompts_per_request:"):
        ServeConfig(model="m", max_prompts_per_request=0)


def test_unexpected_exception_is_500_without_details():
    handle = FakeHandle(lambda req, attempt: FakeResponse([in_replica(RuntimeError("secret user text"))]))

    async def main():
        async with make_client(handle) as c:
            error = error_of(await c.post("/v1/chat/completions", json=CHAT), 500)
            assert "secret" not in error["message"] and error["code"] == "internal_error"

    run(main())


def test_value_error_from_the_replica_is_400_with_param():
    handle = FakeHandle(lambda req, attempt: FakeResponse([in_replica(ValueError("prompt: 5000 tokens leave no room"))]))

    async def main():
        async with make_client(handle) as c:
            error = error_of(await c.post("/v1/chat/completions", json=CHAT), 400)
            assert error["param"] == "messages" and "5000 tokens" in error["message"]
            error = error_of(await c.post("/v1/completions", json={"model": MODEL, "prompt": "x"}), 400)
            assert error["param"] == "prompt"

    run(main())


def test_abort_finish_is_503():
    handle = FakeHandle(lambda req, attempt: FakeResponse([chunk("", True, "abort")]))

    async def main():
        async with make_client(handle) as c:
            error_of(await c.post("/v1/chat/completions", json=CHAT), 503)

    run(main())


def test_health_probe():
    async def main():
        async with make_client(FakeHandle(ok_script)) as c:
            assert (await c.get("/health")).status_code == 200
        async with make_client(FakeHandle(ok_script, healthy=False)) as c:
            r = await c.get("/health")
            assert error_of(r, 503)["code"] == "unhealthy"

    run(main())


@pytest.mark.parametrize("root_path", ["", "/llm", "/a/b"])
def test_api_key_guard(root_path):
    """Every route needs the key wherever the app is mounted; only the health probe is open."""
    completion = {"model": MODEL, "prompt": "hi"}
    wrong = {"Authorization": "Bearer wrong"}

    async def main():
        async with make_client(FakeHandle(ok_script), api_key="s3cret", root_path=root_path) as c:
            r = await c.post("/v1/chat/completions", json=CHAT)
            assert error_of(r, 401)["code"] == "invalid_api_key" and r.headers["www-authenticate"] == "Bearer"
            for stream in (False, True):
                error_of(await c.post("/v1/chat/completions", json={**CHAT, "stream": stream}, headers=wrong), 401)
                error_of(await c.post("/v1/completions", json={**completion, "stream": stream}), 401)
            for path in ("/v1/models", f"/v1/models/{MODEL}", "/v2/anything", "/v1", "/", "/health/x"):
                error_of(await c.get(path), 401)
            auth = {"Authorization": "Bearer s3cret"}
            assert (await c.post("/v1/chat/completions", json=CHAT, headers=auth)).status_code == 200
            r = await c.post("/v1/completions", json={**completion, "stream": True}, headers=auth)
            assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n")
            assert (await c.get("/v1/models", headers=auth)).json()["data"][0]["id"] == MODEL
            assert (await c.get("/health")).status_code == 200  # probes need no key

    run(main())


def test_body_size_limit():
    async def chunked(data: bytes):
        for i in range(0, len(data), 512):
            yield data[i : i + 512]

    async def main():
        async with make_client(FakeHandle(ok_script), max_request_bytes=2048) as c:
            big = {**CHAT, "messages": [{"role": "user", "content": "x" * 4096}]}
            error = error_of(await c.post("/v1/chat/completions", json=big), 413)
            assert error["code"] == "request_too_large"
            raw = json.dumps(big).encode()
            r = await c.post("/v1/chat/completions", content=chunked(raw), headers={"Content-Type": "application/json"})
            error_of(r, 413)
            assert (await c.post("/v1/chat/completions", json=CHAT)).status_code == 200

    run(main())


def test_batch_stream_merges_deltas_within_the_interval():
    from serve_app.serving.llm_server import batch_stream
    from serve_app.types import FinishReason, RequestMetrics, RequestOutput

    def out(text: str, finished: bool = False) -> RequestOutput:
        return RequestOutput("r", text, (len(text),), finished, FinishReason.LENGTH if finished else None, 5,
                             RequestMetrics(arrival_time=0.0))

    async def deltas(delay_s: float):
        for i, text in enumerate(["a", "b", "c", "d", "e"]):
            await asyncio.sleep(delay_s)
            yield out(text, finished=i == 4)

    async def collect(interval_s: float, delay_s: float):
        return [c async for c in batch_stream(deltas(delay_s), interval_s)]

    unbatched = run(collect(0.0, 0.0))
    assert [c.text for c in unbatched] == ["a", "b", "c", "d", "e"]
    held = run(collect(10.0, 0.0))  # everything after the first delta waits for the finish
    assert [c.text for c in held] == ["a", "bcde"] and held[-1].finished and held[-1].finish_reason == "length"
    assert held[-1].token_ids == (1, 1, 1, 1) and held[-1].num_prompt_tokens == 5
    spaced = run(collect(0.01, 0.03))  # deltas slower than the interval pass straight through
    assert [c.text for c in spaced] == ["a", "b", "c", "d", "e"]

    closed: list[bool] = []

    async def endless():
        try:
            while True:
                await asyncio.sleep(0)
                yield out("x")
        finally:
            closed.append(True)

    async def leave_early():
        stream = batch_stream(endless(), 0.0)
        await stream.__anext__()
        await stream.aclose()

    run(leave_early())
    assert closed == [True]  # leaving early closes the backend stream (which aborts the request)
