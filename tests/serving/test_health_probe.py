"""The health probe (`/health`) in-process with a fake LLMServer handle: only GET and HEAD, every other
method refused with 405 before its body is read or its key checked (with and without API keys,
at the root and under a route prefix); a flood of probes makes at most one engine check per second;
an engine that dies is reported within a second. Through a real deployment: test_fail_closed.py."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from serve_app.serving.api import OpenAIAPI, build_fastapi_app
from serve_app.serving.api_keys import Keyring
from serve_app.serving.config import ServeConfig
from serve_app.serving.health_status import HealthStatus
from tests.serving.test_api_unit import INFO, FakeHandle, ok_script


def app_for(handle: FakeHandle, key: str):
    api = OpenAIAPI(handle, ServeConfig(model="unused", api_key_env=""), INFO, keyring=Keyring(env_key=key) if key else None)
    return build_fastapi_app(api)


@pytest.mark.parametrize("key", ["", "sk-probe-1"])
@pytest.mark.parametrize("root_path", ["", "/llm"])
def test_other_methods_get_405_before_the_body_is_read(key, root_path):
    """Raw ASGI: a POST announcing 1 MiB whose body never comes. Were the body read (the size guard
    buffers it) the call would block; it answers 405 with `Allow` at once and never calls receive."""
    app = app_for(FakeHandle(ok_script), key)

    async def call(method: str) -> tuple[int, dict, int]:
        sent: list[dict] = []
        reads = 0

        async def receive():
            nonlocal reads
            reads += 1
            await asyncio.sleep(3600)

        async def send(message):
            sent.append(message)

        scope = {"type": "http", "method": method, "path": f"{root_path}/health", "root_path": root_path,
                 "headers": [(b"content-length", str(1 << 20).encode())], "query_string": b"",
                 "http_version": "1.1", "scheme": "http", "server": ("test", 80), "client": ("c", 1)}
        await asyncio.wait_for(app(scope, receive, send), 5)
        start = sent[0]
        return start["status"], {k.decode(): v.decode() for k, v in start["headers"]}, reads

    for method in ("POST", "PUT", "DELETE", "PATCH", "OPTIONS"):
        status, headers, reads = asyncio.run(call(method))
        assert (status, reads) == (405, 0), method
        assert headers["allow"] == "GET, HEAD"

    async def get_and_head():
        transport = httpx.ASGITransport(app=app, root_path=root_path)
        async with httpx.AsyncClient(transport=transport, base_url=f"http://test{root_path}") as c:
            return (await c.get("/health")).status_code, (await c.head("/health")).status_code

    assert asyncio.run(get_and_head()) == (200, 200)


def test_a_probe_flood_makes_at_most_one_engine_check_a_second():
    handle = FakeHandle(ok_script)
    calls: list[float] = []
    check = handle.check_health.remote

    async def counted():
        calls.append(time.monotonic())
        await asyncio.sleep(0.05)
        await check()

    handle.check_health.remote = counted
    app = app_for(handle, "")

    async def flood():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as c:
            started = time.monotonic()
            statuses = []
            while time.monotonic() - started < 2.5:
                statuses += [r.status_code for r in await asyncio.gather(*(c.get("/health") for _ in range(50)))]
            return statuses

    statuses = asyncio.run(flood())
    assert len(statuses) >= 200 and set(statuses) == {200}
    assert 1 <= len(calls) <= 4  # 2.5 s of probes: one check per second, plus the first
    assert all(b - a >= 0.9 for a, b in zip(calls, calls[1:], strict=False))


def test_a_dead_engine_is_reported_within_a_second():
    handle = FakeHandle(ok_script)
    app = app_for(handle, "")

    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as c:
            assert (await c.get("/health")).status_code == 200
            handle.healthy = False
            died = time.monotonic()
            while (r := await c.get("/health")).status_code == 200:
                await asyncio.sleep(0.05)
            return time.monotonic() - died, r

    delay_s, r = asyncio.run(main())
    assert delay_s <= 1.2
    assert r.status_code == 503 and r.json()["error"]["code"] == "unhealthy"


def test_concurrent_probes_share_one_call_and_a_hung_check_times_out():
    async def main():
        calls = 0

        async def hung():
            nonlocal calls
            calls += 1
            await asyncio.sleep(3600)

        status = HealthStatus(hung, period_s=1.0, timeout_s=0.2)
        results = await asyncio.gather(*(status.current() for _ in range(100)))
        return calls, results

    calls, results = asyncio.run(main())
    assert calls == 1
    assert all(isinstance(r, TimeoutError) for r in results)
