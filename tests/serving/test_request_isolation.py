"""No request can hurt another, through a real deployment (Ray on 127.0.0.1, the official client):
- the attacker's probes (top_k 2^63, seed 2^70, non-finite floats, oversized lists and strings, a
  900k-character chat) get 200 or a 400 naming the field, never a 500, and kill nothing;
- a fault injected into one request's admission, sampling, detokenizing or streaming (before its
  first token or mid-stream) ends that request alone (500 or an error event, code `request_failed`)
  while a neighbour stream finishes token-identical; KV returns to idle and the replica stays up;
- the API fuzzer (tests/serving/api_fuzz.py), a short pass beside a canary stream.
`make fuzz` runs the fuzzer for longer and writes reports/api_fuzz.{json,md}."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from tests.serving.api_fuzz import Canary, fuzz
from tests.serving.conftest import (
    MODEL_NAME,
    app_args,
    assert_error_body,
    serve_app,
    small_chat,
    stream_completion,
    wait_until_idle,
)
from tests.serving.faults import fault_user
from tests.serving.fuzz_app import fuzz_app_args, replica_ids

pytestmark = pytest.mark.startup(reason="starts a Serve app")

NEIGHBOUR_TOKENS = 32
FUZZ_EXAMPLES = 150


@pytest.fixture(scope="module")
def app(ray_cluster, model_dir):
    with serve_app(ray_cluster, app_args(**fuzz_app_args())) as served:
        wait_until_idle(1, timeout_s=60)
        yield served


@pytest.fixture(scope="module")
def replicas(app) -> set[str]:
    return replica_ids()


PROBES = [  # (body, expected status, param of the 400)
    (small_chat(top_k=2**63), 200, None),
    (small_chat(top_k=2**63, temperature=0.7, seed=3), 200, None),
    (small_chat(seed=2**70), 400, "seed"),
    (small_chat(seed=-(2**63) - 1), 400, "seed"),
    (small_chat(top_k=-5), 400, "top_k"),
    (small_chat(temperature=1e308), 400, "temperature"),
    (small_chat(repetition_penalty=1e300), 400, "repetition_penalty"),
    (small_chat(min_tokens=2**63), 400, "min_tokens"),
    (small_chat(max_tokens=2**63), 400, "max_tokens"),
    (small_chat(logprobs=True, top_logprobs=2**63), 400, "top_logprobs"),
    (small_chat(stop=["x"] * 20_000), 400, "stop"),
    (small_chat(stop_token_ids=[2**63]), 400, "stop_token_ids"),
    (small_chat(user="u" * 900_000), 400, "user"),
    (small_chat(n=128), 400, "n"),
    (small_chat(messages=[{"role": "user", "content": "word " * 180_000}]), 400, "messages"),
    ({"model": MODEL_NAME, "prompt": [49152], "max_tokens": 2}, 400, "prompt"),
    ({"model": MODEL_NAME, "prompt": "hi", "max_tokens": 2, "logprobs": 2**63}, 400, "logprobs"),
]


@pytest.mark.parametrize("body, status, param", PROBES, ids=[f"probe{i}" for i in range(len(PROBES))])
def test_probes_get_no_500_and_kill_nothing(http, replicas, body, status, param):
    path = "/v1/completions" if "prompt" in body else "/v1/chat/completions"
    for stream in (False, True):
        r = http.post(path, json={**body, "stream": stream})
        if status == 200:
            assert r.status_code == 200, r.text
        else:
            assert_error_body(r, status, param=param)
    assert http.get("/health").status_code == 200
    assert replica_ids() == replicas


def test_nan_and_infinity_literals_are_400(http):
    for literal in ("NaN", "Infinity", "-Infinity", "1e999"):
        content = f'{{"model": "{MODEL_NAME}", "messages": [{{"role": "user", "content": "Hi"}}], "temperature": {literal}}}'
        r = http.post("/v1/chat/completions", content=content, headers={"content-type": "application/json"})
        assert_error_body(r, 400, param="temperature")


NEIGHBOUR = {"model": MODEL_NAME, "prompt": "The history of the printing press", "max_tokens": NEIGHBOUR_TOKENS,
             "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def neighbour_reference(app) -> dict:
    async def main():
        async with httpx.AsyncClient(base_url=app.base_url, timeout=120) as client:
            return await stream_completion(client, NEIGHBOUR)

    ref = asyncio.run(main())
    assert ref["error"] is None and ref["tokens"] == NEIGHBOUR_TOKENS
    return ref


@pytest.mark.parametrize("stage, after", [("prepare", 0), ("sample", 0), ("sample", 4), ("detokenize", 4), ("stream", 0), ("stream", 4)])
def test_a_fault_in_one_request_leaves_its_neighbour_intact(app, replicas, neighbour_reference, stage, after):
    victim_body = {"model": MODEL_NAME, "prompt": "Write a poem about the sea", "max_tokens": NEIGHBOUR_TOKENS,
                   "temperature": 0.8, "ignore_eos": True, "user": fault_user(stage, after)}

    async def main():
        async with httpx.AsyncClient(base_url=app.base_url, timeout=120) as client:
            neighbour = asyncio.create_task(stream_completion(client, NEIGHBOUR))
            await asyncio.sleep(0.3)  # the neighbour is running when the victim arrives
            victim = await stream_completion(client, victim_body)
            return victim, await neighbour

    victim, neighbour = asyncio.run(main())
    assert victim["error"] is not None and victim["error"]["code"] == "request_failed", victim
    assert set(victim["error"]) == {"message", "type", "param", "code"} and stage in victim["error"]["message"]
    if victim["status"] == 200:  # failed after the stream began: an error event, then [DONE]
        assert victim["done"]
    else:
        assert victim["status"] == 500
    assert neighbour["error"] is None and neighbour["done"], neighbour
    assert neighbour["text"] == neighbour_reference["text"] and neighbour["tokens"] == NEIGHBOUR_TOKENS
    wait_until_idle(1)  # the victim's KV blocks are free
    assert replica_ids() == replicas  # nothing restarted


def test_fuzzer_finds_nothing_beside_a_canary(app, replicas):
    with Canary(app.base_url, MODEL_NAME) as canary:
        result = fuzz(app.base_url, MODEL_NAME, FUZZ_EXAMPLES, seed=0)
    assert sum(result.tried.values()) == FUZZ_EXAMPLES
    assert result.statuses[200] >= FUZZ_EXAMPLES // 5  # valid bodies reach the engine, not only the validator
    assert not result.failures, json.dumps(result.failures[:5], indent=1)
    assert canary.finished >= 1 and not canary.failures, canary.failures
    assert replica_ids() == replicas
    wait_until_idle(1, timeout_s=30)
