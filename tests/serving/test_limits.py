"""Security and backpressure through a real deployment with tight limits: API key (from the
ingress replica's environment) required on every route but the health probe, request-size limit (413), overload → 503 + Retry-After instead of an
unbounded queue, per-request timeout (504, or an error event mid-stream) that frees the KV blocks."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from tests.serving.conftest import (
    API_KEY,
    API_KEY_ENV,
    AUTH,
    MODEL_NAME,
    app_args,
    assert_error_body,
    openai_client,
    serve_app,
    small_chat,
    wait_until_idle,
)

TIMEOUT_S = 8.0
MAX_BYTES = 8192


@pytest.fixture(scope="module")
def app(ray_cluster, model_dir):
    args = app_args(
        num_replicas=1, api_key_env=API_KEY_ENV, max_ongoing_requests=2, max_queued_requests=2, request_timeout_s=TIMEOUT_S,
        max_request_bytes=MAX_BYTES, retry_after_s=2, engine={"num_blocks": 128, "max_num_seqs": 4},
    )
    with serve_app(ray_cluster, args) as served:
        yield served


def test_api_key_required(http, app):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        for stream in (False, True):
            r = http.post("/v1/chat/completions", json=small_chat(stream=stream), headers=headers)
            assert_error_body(r, 401, code="invalid_api_key", type_="authentication_error")
            assert r.headers["www-authenticate"] == "Bearer"
    assert_error_body(http.get("/v1/models"), 401)
    assert_error_body(http.get("/not-a-route"), 401)
    assert http.get("/health").status_code == 200  # probes need no key
    assert http.post("/v1/chat/completions", json=small_chat(), headers=AUTH).status_code == 200

    with pytest.raises(openai.AuthenticationError):
        openai_client(app, api_key="wrong").models.list()
    client = openai_client(app, api_key=API_KEY)
    assert [m.id for m in client.models.list().data] == [MODEL_NAME]
    out = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "Hi"}], max_tokens=3)
    assert out.usage.completion_tokens >= 1


def test_request_size_limit(http):
    big = small_chat(messages=[{"role": "user", "content": "x" * (2 * MAX_BYTES)}])
    assert_error_body(http.post("/v1/chat/completions", json=big, headers=AUTH), 413, code="request_too_large")
    raw = json.dumps(big).encode()

    def chunks():  # no Content-Length: chunked upload, caught while reading
        for i in range(0, len(raw), 1024):
            yield raw[i : i + 1024]

    r = http.post("/v1/chat/completions", content=chunks(), headers={**AUTH, "Content-Type": "application/json"})
    assert_error_body(r, 413, code="request_too_large")
    assert http.post("/v1/chat/completions", json=small_chat(), headers=AUTH).status_code == 200


def test_overload_answers_503_with_retry_after(app, http):
    """2 running + 2 queued at most: a burst of 10 gets some 503s at once, the rest complete."""
    body = small_chat(max_tokens=8, ignore_eos=True)

    def send(_):
        with httpx.Client(base_url=app.base_url, timeout=60) as c:
            return c.post("/v1/chat/completions", json=body, headers=AUTH)

    with ThreadPoolExecutor(10) as pool:
        responses = list(pool.map(send, range(10)))
    statuses = sorted(r.status_code for r in responses)
    assert set(statuses) <= {200, 503}, statuses
    rejected = [r for r in responses if r.status_code == 503]
    assert len(rejected) >= 1 and statuses.count(200) >= 2, statuses
    for r in rejected:
        assert_error_body(r, 503, code="server_overloaded", type_="server_error")
        assert r.headers["retry-after"] == "2"
    for r in responses:
        if r.status_code == 200:
            assert r.json()["usage"]["completion_tokens"] == 8
    wait_until_idle(1)
    assert http.post("/v1/chat/completions", json=small_chat(), headers=AUTH).status_code == 200


def test_request_timeout_aborts_and_frees_blocks(app):
    body = {"model": MODEL_NAME, "prompt": "Tell me a long story.", "max_tokens": 1000, "ignore_eos": True}

    def non_streamed():
        with httpx.Client(base_url=app.base_url, timeout=60) as c:
            return c.post("/v1/completions", json=body, headers=AUTH)

    def streamed():
        with httpx.Client(base_url=app.base_url, timeout=60) as c:
            return c.post("/v1/completions", json={**body, "stream": True}, headers=AUTH)

    with ThreadPoolExecutor(2) as pool:
        plain, stream = pool.submit(non_streamed), pool.submit(streamed)
        plain, stream = plain.result(), stream.result()
    assert_error_body(plain, 504, code="request_timeout", type_="timeout_error")
    assert stream.status_code == 200
    events = [e[len("data: "):] for e in stream.text.split("\n\n") if e]
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["code"] == "request_timeout"
    assert len(events) > 3  # tokens were streamed before the deadline
    wait_until_idle(1, timeout_s=10)
