"""Bad input through a real deployment: every case gets its 4xx status and an OpenAI error body
{"error": {"message", "type", "param", "code"}}, and the next (valid) request is served."""

from __future__ import annotations

import openai
import pytest

from tests.serving.conftest import (
    MODEL_NAME,
    app_args,
    assert_error_body,
    openai_client,
    serve_app,
    wait_until_idle,
)

NUM_BLOCKS = 64  # context = 64 blocks x 16 tokens = 1024 tokens
CONTEXT = NUM_BLOCKS * 16
LONG_TEXT = "hello " * (CONTEXT + 50)
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MSG = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def app(ray_cluster, model_dir):
    with serve_app(ray_cluster, app_args(num_replicas=1, engine={"num_blocks": NUM_BLOCKS})) as served:
        yield served


def chat(**fields):
    return {"model": MODEL_NAME, "messages": MSG, "max_tokens": 4, **fields}


def completion(**fields):
    return {"model": MODEL_NAME, "prompt": "Hello", "max_tokens": 4, **fields}


def without(body: dict, key: str) -> dict:
    return {k: v for k, v in body.items() if k != key}


# (id, method, path, json body or raw bytes, status, param, code)
CASES = [
    ("malformed-json", "POST", CHAT, b'{"model": "x", "messages": [', 400, None, "invalid_json"),
    ("body-not-object", "POST", CHAT, b'[1, 2, 3]', 400, None, "any"),
    ("missing-model", "POST", CHAT, without(chat(), "model"), 400, "model", "missing_required_parameter"),
    ("missing-messages", "POST", CHAT, without(chat(), "messages"), 400, "messages", "missing_required_parameter"),
    ("missing-prompt", "POST", COMPLETIONS, without(completion(), "prompt"), 400, "prompt", "missing_required_parameter"),
    ("max-tokens-string", "POST", CHAT, chat(max_tokens="16"), 400, "max_tokens", "invalid_type"),
    ("temperature-string", "POST", COMPLETIONS, completion(temperature="hot"), 400, "temperature", "invalid_type"),
    ("stream-not-bool", "POST", CHAT, chat(stream="yes"), 400, "stream", "invalid_type"),
    ("messages-empty", "POST", CHAT, chat(messages=[]), 400, "messages", "any"),
    ("message-bad-role", "POST", CHAT, chat(messages=[{"role": "robot", "content": "x"}]), 400, "messages.0.role", "any"),
    ("message-content-number", "POST", CHAT, chat(messages=[{"role": "user", "content": 5}]), 400, "messages.0.content", "any"),
    ("unknown-parameter", "POST", CHAT, chat(temprature=0.5), 400, "temprature", "unknown_parameter"),
    ("unknown-model", "POST", CHAT, chat(model="gpt-4"), 404, "model", "model_not_found"),
    ("unknown-model-completions", "POST", COMPLETIONS, completion(model="nope"), 404, "model", "model_not_found"),
    ("prompt-too-long", "POST", COMPLETIONS, completion(prompt=LONG_TEXT), 400, "prompt", "invalid_value"),
    ("chat-too-long", "POST", CHAT, chat(messages=[{"role": "user", "content": LONG_TEXT}]), 400, "messages", "invalid_value"),
    ("prompt-too-long-streamed", "POST", COMPLETIONS, completion(prompt=LONG_TEXT, stream=True), 400, "prompt", "invalid_value"),
    ("empty-prompt", "POST", COMPLETIONS, completion(prompt=""), 400, "prompt", "invalid_value"),
    ("token-id-out-of-vocab", "POST", COMPLETIONS, completion(prompt=[1, 2, 10**7]), 400, "prompt", "invalid_value"),
    ("max-tokens-zero", "POST", CHAT, chat(max_tokens=0), 400, "max_tokens", "invalid_value"),
    ("max-tokens-over-context", "POST", COMPLETIONS, completion(max_tokens=CONTEXT + 1), 400, "max_tokens", "invalid_value"),
    ("temperature-negative", "POST", CHAT, chat(temperature=-1.0), 400, "temperature", "invalid_value"),
    ("top-p-zero", "POST", CHAT, chat(top_p=0.0), 400, "top_p", "invalid_value"),
    ("top-p-over-one", "POST", COMPLETIONS, completion(top_p=1.5), 400, "top_p", "invalid_value"),
    ("top-k-negative", "POST", COMPLETIONS, completion(top_k=-5), 400, "top_k", "invalid_value"),
    ("stop-empty-string", "POST", CHAT, chat(stop=[""]), 400, "stop", "invalid_value"),
    ("streamed-bad-value", "POST", CHAT, chat(top_p=2.0, stream=True), 400, "top_p", "invalid_value"),
    ("n-too-large", "POST", CHAT, chat(n=100), 400, "n", "unsupported_parameter"),
    ("max-tokens-over-room", "POST", COMPLETIONS, completion(prompt="Hello there", max_tokens=CONTEXT - 1), 400, "max_tokens",
     "invalid_value"),
    ("temperature-over-two", "POST", CHAT, chat(temperature=2.5), 400, "temperature", "invalid_value"),
    ("completion-logprobs-over-20", "POST", COMPLETIONS, completion(logprobs=21), 400, "logprobs", "invalid_value"),
    ("top-logprobs-without-logprobs", "POST", CHAT, chat(top_logprobs=2), 400, "top_logprobs", "invalid_value"),
    ("message-field-typo", "POST", CHAT, chat(messages=[{"role": "user", "content": "x", "nmae": "a"}]), 400, "messages.0.nmae",
     "unknown_parameter"),
    ("parallel-tool-calls-without-tools", "POST", CHAT, chat(parallel_tool_calls=True), 400, "parallel_tool_calls", "invalid_value"),
    ("legacy-functions", "POST", CHAT, chat(functions=[{"name": "f"}]), 400, "functions", "unsupported_parameter"),
    ("tool-name-pattern", "POST", CHAT, chat(tools=[{"type": "function", "function": {"name": "a b"}}]), 400, "tools.0.function.name",
     "invalid_type"),
    ("tool-message-answers-no-call", "POST", CHAT, chat(messages=[{"role": "tool", "content": "x", "tool_call_id": "1"}]), 400,
     "messages.0.tool_call_id", "invalid_value"),
    ("image-part", "POST", CHAT, chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
     400, "messages.0.content.0", "unsupported_parameter"),
    ("echo", "POST", COMPLETIONS, completion(echo=True, logprobs=1), 400, "echo", "unsupported_parameter"),
    ("penalty-out-of-range", "POST", CHAT, chat(presence_penalty=2.5), 400, "presence_penalty", "invalid_value"),
    ("logit-bias", "POST", CHAT, chat(logit_bias={"1": 500}), 400, "logit_bias", "invalid_value"),
    ("json-mode", "POST", CHAT, chat(response_format={"type": "xml"}), 400, "response_format.type", "invalid_value"),
    ("stream-options-without-stream", "POST", CHAT, chat(stream_options={"include_usage": True}), 400, "stream_options", "invalid_value"),
    ("unknown-route", "GET", "/v1/engines", None, 404, None, "not_found"),
    ("wrong-method", "GET", COMPLETIONS, None, 405, None, "method_not_allowed"),
    ("unknown-model-retrieve", "GET", "/v1/models/gpt-4", None, 404, "model", "model_not_found"),
]


@pytest.mark.parametrize(("method", "path", "body", "status", "param", "code"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_then_success(http, method, path, body, status, param, code):
    if isinstance(body, bytes):
        r = http.request(method, path, content=body, headers={"Content-Type": "application/json"})
    else:
        r = http.request(method, path, json=body)
    error = assert_error_body(r, status, param=param, code=code)
    assert error["type"] == "invalid_request_error"
    # the server keeps serving
    ok = http.post(CHAT, json=chat(max_tokens=2, temperature=0))
    assert ok.status_code == 200, ok.text
    assert ok.json()["choices"][0]["message"]["content"]


def test_openai_client_raises_typed_errors(app):
    client = openai_client(app)
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model=MODEL_NAME, messages=MSG, top_p=5.0)
    assert bad.value.status_code == 400 and bad.value.body["param"] == "top_p"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt="x")
    assert client.completions.create(model=MODEL_NAME, prompt="Hello", max_tokens=2).choices[0].text is not None


def test_failed_requests_leave_no_kv_blocks(app, http):
    for body in (completion(prompt=LONG_TEXT), chat(top_p=0.0), completion(prompt=LONG_TEXT, stream=True)):
        assert http.post(CHAT if "messages" in body else COMPLETIONS, json=body).status_code == 400
    wait_until_idle(1, timeout_s=10)
