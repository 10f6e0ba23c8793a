"""The API key under a Serve `route_prefix`, as behind a shared gateway: a real deployment at `/llm`
with two ingress replicas, each reading the key from its own environment. Every route needs the key
(models, completions and chat, streamed or not, unknown paths); only the health probe is open."""

from __future__ import annotations

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
)

PREFIX = "/llm"
WRONG = {"Authorization": "Bearer sk-wrong"}
# two ingress replicas: the proxy spreads requests over both, and each must enforce the key
NUM_TRIES = 6


@pytest.fixture(scope="module")
def app(ray_cluster, model_dir):
    # two ingress replicas with multiplexed streams: each ingress reads its own inlet
    args = app_args(num_replicas=1, ingress_num_replicas=2, api_key_env=API_KEY_ENV, stream_multiplexing=True,
                    engine={"num_blocks": 64, "max_num_seqs": 4})
    with serve_app(ray_cluster, args, route_prefix=PREFIX) as served:
        assert served.base_url.endswith(PREFIX)
        yield served


def completion(**fields) -> dict:
    return {"model": MODEL_NAME, "prompt": "Hi", "max_tokens": 2, **fields}


def test_every_route_under_the_prefix_needs_the_key(http):
    for _ in range(NUM_TRIES):
        assert_error_body(http.get("/v1/models"), 401, code="invalid_api_key", type_="authentication_error")
        assert_error_body(http.get(f"/v1/models/{MODEL_NAME}"), 401, code="invalid_api_key")
        assert_error_body(http.get("/v1/nothing-here"), 401, code="invalid_api_key")
        for stream in (False, True):
            assert_error_body(http.post("/v1/completions", json=completion(stream=stream)), 401, code="invalid_api_key")
            r = http.post("/v1/chat/completions", json=small_chat(stream=stream), headers=WRONG)
            assert_error_body(r, 401, code="invalid_api_key")
            assert r.headers["www-authenticate"] == "Bearer"
        assert http.get("/health").status_code == 200  # probes need no key


def test_the_key_opens_every_route_under_the_prefix(app, http):
    for _ in range(NUM_TRIES):
        assert http.get("/v1/models", headers=AUTH).json()["data"][0]["id"] == MODEL_NAME
    assert http.post("/v1/completions", json=completion(), headers=AUTH).json()["usage"]["completion_tokens"] >= 1
    r = http.post("/v1/chat/completions", json=small_chat(stream=True), headers=AUTH)
    assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n"), r.text

    with pytest.raises(openai.AuthenticationError):
        openai_client(app, api_key="sk-wrong").chat.completions.create(model=MODEL_NAME, messages=small_chat()["messages"], max_tokens=2)
    client = openai_client(app, api_key=API_KEY)
    stream = client.completions.create(model=MODEL_NAME, prompt="Hi", max_tokens=3, stream=True)
    assert "".join(c.choices[0].text for c in stream if c.choices)
