"""Tenants through a real deployment (native engine): two LLMServer replicas behind the prefix-aware
router, two ingress replicas with multiplexed streams (the msgpack channel), under `route_prefix:
/llm`, keys from a keys file with two tenants, over HTTP with the official `openai` client.

- A tenant's repeated prompt is served from the prefix cache (`cached_tokens` > 0); the same prompt
  from the other tenant is not (`prefix_cache_salt: auto` salts by tenant with several keys), nor is
  it with a request `cache_salt` the cache has not seen, from either tenant.
- Keys added to the file work on every ingress replica without a restart; removed ones stop working.
- `/health` answers GET on every ingress replica and 405 to other methods, key or not."""

from __future__ import annotations

import time

import httpx
import pytest

from tests.serving.conftest import MODEL_NAME, app_args, assert_error_body, openai_client, serve_app

PREFIX = "/llm"
KEY_A, KEY_B, KEY_C = "sk-tenant-a-5521", "sk-tenant-b-7730", "sk-tenant-c-9104"
NUM_TRIES = 6  # two ingress replicas: repeated calls reach both
STATS_SETTLE_S = 2.0  # a few routing-stats periods: every router knows what each replica caches
# ~200 tokens: several full KV blocks of 16
PROMPT = "Tenant isolation check. " + " ".join(f"The number {i} is written as {i}." for i in range(30))


@pytest.fixture(scope="module")
def keys_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("keys") / "api-keys"
    path.write_text(f"team-a: {KEY_A}\nteam-b: {KEY_B}\n")
    return path


@pytest.fixture(scope="module")
def app(ray_cluster, model_dir, keys_file):
    args = app_args(num_replicas=2, ingress_num_replicas=2, stream_multiplexing=True, api_keys_file=str(keys_file),
                    api_keys_reload_s=0.5, engine={"num_blocks": 128, "max_num_seqs": 4})
    with serve_app(ray_cluster, args, route_prefix=PREFIX) as served:
        yield served


def cached(app, key: str, salt: str | None = None) -> int:
    client = openai_client(app, api_key=key)
    extra = {"cache_salt": salt} if salt is not None else None
    r = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=1, temperature=0, extra_body=extra)
    assert r.usage.prompt_tokens > 100
    return r.usage.prompt_tokens_details.cached_tokens


def test_one_tenants_cached_prefix_is_invisible_to_another(app):
    assert cached(app, KEY_A) == 0
    time.sleep(STATS_SETTLE_S)
    hit = cached(app, KEY_A)
    assert hit >= 96  # the same tenant: its prompt's full blocks come from the cache
    assert cached(app, KEY_B) == 0  # the other tenant: nothing, on whichever replica
    assert cached(app, KEY_A, salt="s1") == 0  # a new request salt: a fresh namespace
    time.sleep(STATS_SETTLE_S)
    assert cached(app, KEY_A, salt="s1") >= 96
    assert cached(app, KEY_B, salt="s1") == 0  # the same request salt from another tenant never matches
    time.sleep(STATS_SETTLE_S)
    assert cached(app, KEY_B) >= 96  # team-b's own earlier request is cached for team-b


def test_a_bad_cache_salt_is_a_400(app):
    with httpx.Client(base_url=app.base_url, timeout=60) as http:
        r = http.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "hi", "max_tokens": 1, "cache_salt": ""},
                      headers={"Authorization": f"Bearer {KEY_A}"})
        assert_error_body(r, 400, param="cache_salt")


def test_keys_reload_on_every_ingress_without_restart(app, keys_file):
    with httpx.Client(base_url=app.base_url, timeout=60) as http:
        def statuses(key: str) -> set[int]:
            return {http.get("/v1/models", headers={"Authorization": f"Bearer {key}"}).status_code for _ in range(NUM_TRIES)}

        assert statuses(KEY_C) == {401}
        keys_file.write_text(f"team-a: {KEY_A}\nteam-c: {KEY_C}\n")  # team-c added, team-b revoked
        deadline = time.monotonic() + 10
        while (statuses(KEY_C), statuses(KEY_B)) != ({200}, {401}):
            assert time.monotonic() < deadline, "keys were not reloaded on every ingress replica"
            time.sleep(0.2)
        assert statuses(KEY_A) == {200}


def test_health_methods_on_every_ingress(app):
    with httpx.Client(base_url=app.base_url, timeout=60) as http:
        for _ in range(NUM_TRIES):
            assert http.get("/health").status_code == 200
            assert http.head("/health").status_code == 200
            for method in ("POST", "PUT", "DELETE"):
                r = http.request(method, "/health", content=b"x" * 4096)
                assert_error_body(r, 405, code="method_not_allowed")
                assert r.headers["allow"] == "GET, HEAD"
