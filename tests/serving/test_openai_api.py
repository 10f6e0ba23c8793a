"""The OpenAI-compatible API through a real Ray Serve deployment (2 LLMServer replicas), driven by the
official `openai` client and raw HTTP: completions and chat, streamed and not, usage, stop/seed/n,
concurrent streams, greedy output == the offline `LLM`, client disconnects, no authentication; with and
without stream multiplexing."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from pathlib import Path

import httpx
import pytest

from tests.serving.conftest import (
    MODEL_DIR,
    MODEL_NAME,
    app_args,
    async_openai_client,
    replica_actors,
    replica_stats,
    serve_app,
    wait_for,
    wait_until_idle,
)

CHAT_PROMPTS = ["What is the capital of France?", "List three prime numbers greater than 10."]
TEXT_PROMPTS = ["Once upon a time", "The three primary colors are"]
MAX_TOKENS = 20


@pytest.fixture(scope="module", params=[False, True], ids=["per-stream", "multiplexed"])
def app(request, ray_cluster, model_dir):
    """Every test runs with each replica's streams sent one Serve item per delta, and multiplexed
    (serving.stream_mux: one message per flush per ingress, the admission chunk on the call)."""
    with serve_app(ray_cluster, app_args(num_replicas=2, stream_multiplexing=request.param)) as served:
        yield served


def test_models_and_health(client, http):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL_NAME]
    assert client.models.retrieve(MODEL_NAME).id == MODEL_NAME
    health = http.get("/health")
    assert health.status_code == 200 and health.json()["status"] == "ok"


def test_completion(client):
    out = client.completions.create(model=MODEL_NAME, prompt="Once upon a time", max_tokens=8, temperature=0)
    assert out.object == "text_completion" and out.model == MODEL_NAME and out.id.startswith("cmpl-")
    assert len(out.choices) == 1 and out.choices[0].index == 0
    assert out.choices[0].text.strip()
    assert out.choices[0].finish_reason == "length"
    assert out.usage.completion_tokens == 8
    assert out.usage.prompt_tokens == 4  # "Once upon a time"
    assert out.usage.total_tokens == 12


def test_chat(client):
    out = client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "What is the capital of France?"}], temperature=0, max_tokens=32
    )
    assert out.object == "chat.completion" and out.id.startswith("chatcmpl-")
    message = out.choices[0].message
    assert message.role == "assistant"
    assert message.content == "The capital of France is Paris."
    assert out.choices[0].finish_reason == "stop"
    assert out.usage.prompt_tokens > 10 and 0 < out.usage.completion_tokens < 32
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens


def test_completion_streamed_equals_non_streamed(client):
    full = client.completions.create(model=MODEL_NAME, prompt="The three primary colors are", max_tokens=16, temperature=0)
    chunks = list(
        client.completions.create(
            model=MODEL_NAME, prompt="The three primary colors are", max_tokens=16, temperature=0,
            stream=True, stream_options={"include_usage": True},
        )
    )
    text_chunks = [c for c in chunks if c.choices]
    assert len(text_chunks) >= 2  # really streamed, not one blob
    assert "".join(c.choices[0].text for c in text_chunks) == full.choices[0].text
    assert text_chunks[-1].choices[0].finish_reason == "length"
    assert all(c.choices[0].finish_reason is None for c in text_chunks[:-1])
    usage_chunk = chunks[-1]
    assert usage_chunk.choices == [] and usage_chunk.usage.completion_tokens == 16
    assert usage_chunk.usage.prompt_tokens == full.usage.prompt_tokens
    assert all(c.usage is None for c in text_chunks)


def test_chat_streamed_equals_non_streamed(client):
    messages = [{"role": "user", "content": "Write a haiku about the sea."}]
    full = client.chat.completions.create(model=MODEL_NAME, messages=messages, temperature=0, max_tokens=20)
    chunks = list(client.chat.completions.create(model=MODEL_NAME, messages=messages, temperature=0, max_tokens=20, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text == full.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == full.choices[0].finish_reason
    assert all(c.usage is None for c in chunks)  # no include_usage: no usage chunk


def test_sse_wire_format(http):
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Hi!"}], "max_tokens": 4, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    with http.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    events = [e for e in raw.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    payloads = [json.loads(e[len("data: "):]) for e in events[:-1]]
    assert payloads[-1]["choices"] == [] and payloads[-1]["usage"]["completion_tokens"] == 4
    assert all("usage" in p and p["usage"] is None for p in payloads[:-1])


def test_stop_seed_top_k(client):
    out = client.completions.create(model=MODEL_NAME, prompt="Once upon a time", max_tokens=40, temperature=0, stop=[","])
    assert out.choices[0].finish_reason == "stop" and "," not in out.choices[0].text
    kwargs = dict(model=MODEL_NAME, prompt="My favourite animal is", max_tokens=12, temperature=1.0, seed=1234, extra_body={"top_k": 50})
    first = client.completions.create(**kwargs).choices[0].text
    second = client.completions.create(**kwargs).choices[0].text
    assert first == second  # a seeded request is reproducible whichever replica serves it


def test_n_and_prompt_batches(client):
    out = client.completions.create(model=MODEL_NAME, prompt="Once upon a time", n=2, max_tokens=6, temperature=0)
    assert [c.index for c in out.choices] == [0, 1]
    assert out.choices[0].text == out.choices[1].text  # greedy: identical choices
    assert out.usage.prompt_tokens == 4 and out.usage.completion_tokens == 12  # prompt counted once
    batch = client.completions.create(model=MODEL_NAME, prompt=TEXT_PROMPTS, max_tokens=6, temperature=0)
    singles = [client.completions.create(model=MODEL_NAME, prompt=p, max_tokens=6, temperature=0).choices[0].text for p in TEXT_PROMPTS]
    assert [c.text for c in batch.choices] == singles
    streamed = list(client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "Hi!"}], n=2,
                                                    max_tokens=5, temperature=0, stream=True))
    texts = ["".join(c.choices[0].delta.content or "" for c in streamed if c.choices[0].index == i) for i in (0, 1)]
    assert texts[0] == texts[1] and texts[0]


def test_token_id_prompt(client):
    as_text = client.completions.create(model=MODEL_NAME, prompt="Once upon a time", max_tokens=5, temperature=0)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(MODEL_DIR))
    token_ids = tok.encode("Once upon a time", add_special_tokens=False)
    as_ids = client.completions.create(model=MODEL_NAME, prompt=token_ids, max_tokens=5, temperature=0)
    assert as_ids.choices[0].text == as_text.choices[0].text


def test_concurrent_streams(app):
    """20 concurrent streamed chats (≥ 16) all complete with every token."""
    num_streams, max_tokens = 20, 12

    async def one(client, i: int) -> tuple[int, str | None, int]:
        stream = await client.chat.completions.create(
            model=MODEL_NAME, messages=[{"role": "user", "content": f"Count to {i + 3}."}], max_tokens=max_tokens,
            temperature=0.7, seed=i, stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
        )
        reason, tokens, pieces = None, 0, 0
        async for chunk in stream:
            if chunk.choices:
                pieces += 1
                reason = chunk.choices[0].finish_reason or reason
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
        return pieces, reason, tokens

    async def main():
        async with async_openai_client(app) as client:
            return await asyncio.wait_for(asyncio.gather(*(one(client, i) for i in range(num_streams))), timeout=240)

    start = time.monotonic()
    results = asyncio.run(main())
    assert len(results) == num_streams
    for pieces, reason, tokens in results:
        assert reason == "length" and tokens == max_tokens and pieces >= 2
    assert time.monotonic() - start < 240
    wait_until_idle(2)


def test_greedy_matches_offline_llm(client, model_dir):
    """Greedy text over HTTP equals the offline `LLM` output for the same prompts (same dtype)."""
    from serve_app.engine import LLM, SamplingParams

    llm = LLM(model_dir, dtype="float32")
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    offline_chat = llm.chat([[{"role": "user", "content": p}] for p in CHAT_PROMPTS], params)
    offline_text = llm.generate(TEXT_PROMPTS, params)
    del llm
    for prompt, expected in zip(CHAT_PROMPTS, offline_chat, strict=True):
        out = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": prompt}], temperature=0,
                                             max_tokens=MAX_TOKENS)
        assert out.choices[0].message.content == expected.text
        assert out.usage.completion_tokens == len(expected.token_ids)
        assert out.choices[0].finish_reason == str(expected.finish_reason)
    for prompt, expected in zip(TEXT_PROMPTS, offline_text, strict=True):
        out = client.completions.create(model=MODEL_NAME, prompt=prompt, temperature=0, max_tokens=MAX_TOKENS)
        assert out.choices[0].text == expected.text
        assert out.usage.completion_tokens == len(expected.token_ids)


def _busy_stats() -> dict | None:
    stats = replica_stats()
    busy = any(s["num_free_blocks"] < s["num_total_blocks"] or s["num_running"] for s in stats.values())
    return stats if busy else None


def test_stream_disconnect_frees_kv_blocks(app):
    idle = wait_until_idle(2)
    body = {"model": MODEL_NAME, "prompt": "Tell me a very long story.", "max_tokens": 2000, "temperature": 0,
            "stream": True, "ignore_eos": True}
    with httpx.Client(base_url=app.base_url, timeout=60) as c, c.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        received = 0
        for line in lines:
            if line.startswith("data: "):
                received += 1
            if received >= 3:
                break
        busy = wait_for(_busy_stats, 10, message="blocks in use")
        assert sum(s["num_free_blocks"] for s in busy.values()) < sum(s["num_free_blocks"] for s in idle.values())
    # leaving the `with` closed the connection mid-stream: the engine must abort and free the blocks
    after = wait_until_idle(2, timeout_s=15)
    assert {n: s["num_free_blocks"] for n, s in after.items()} == {n: s["num_free_blocks"] for n, s in idle.items()}


def test_non_streamed_disconnect_frees_kv_blocks(app):
    wait_until_idle(2)
    body = {"model": MODEL_NAME, "prompt": "Tell me a very long story.", "max_tokens": 2000, "ignore_eos": True}
    with httpx.Client(base_url=app.base_url, timeout=httpx.Timeout(60, read=2.0)) as c:
        with pytest.raises(httpx.ReadTimeout):
            c.post("/v1/completions", json=body)
    wait_until_idle(2, timeout_s=15)


def test_no_api_key_configured(app):
    """Without a configured key, requests need no (and ignore any) Authorization header."""
    body = {"model": MODEL_NAME, "prompt": "Hi", "max_tokens": 1}
    for headers in ({}, {"Authorization": "Bearer whatever"}):
        r = httpx.post(f"{app.api_url}/completions", json=body, headers=headers, timeout=60)
        assert r.status_code == 200, r.text


def test_prompts_and_outputs_are_not_logged(client, ray_cluster):
    marker = f"zebra{uuid.uuid4().hex[:12]}"
    out = client.completions.create(model=MODEL_NAME, prompt=f"Repeat this word: {marker} {marker} {marker}", max_tokens=12,
                                    temperature=0)
    assert out.choices[0].text is not None
    time.sleep(1.0)  # let the replicas flush their logs
    from ray._private.worker import _global_node

    logs = Path(_global_node.get_session_dir_path()) / "logs"
    assert logs.is_dir()
    leaked = [p.name for p in logs.rglob("*") if p.is_file() and marker.encode() in p.read_bytes()]
    assert leaked == []


def _loaded_torch(_actor_instance) -> dict:
    """Runs inside a Ray actor's process (`__ray_call__`): whether torch is imported there."""
    import os
    import sys

    return {"pid": os.getpid(), "torch": "torch" in sys.modules, "transformers": "transformers" in sys.modules,
            "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY")}


def test_only_engine_replicas_import_torch(client, ray_cluster):
    """After a chat request (tokenized in the ingress), the ingress replicas, Serve's controller and
    its proxies have not imported torch; the LLMServer replicas have (the same probe can see it)."""
    import ray

    reply = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
    assert reply.choices[0].message.content is not None

    def probe(actor) -> dict:
        return ray.get(actor.__ray_call__.remote(_loaded_torch), timeout=30)

    ingress = {name: probe(a) for name, a in replica_actors("OpenAIIngress").items()}
    engines = {name: probe(a) for name, a in replica_actors("LLMServer").items()}
    assert ingress and all(p["transformers"] and not p["torch"] for p in ingress.values()), ingress  # it tokenized
    assert engines and all(p["torch"] for p in engines.values()), engines
    # the default: idle engine threads sleep (in the environment the process started with, before OpenMP loaded)
    assert all(p["omp_wait_policy"] == "PASSIVE" for p in engines.values()), engines
    serve_actors = [e["name"] for e in ray.util.list_named_actors(all_namespaces=True)
                    if e["name"].startswith(("SERVE_CONTROLLER_ACTOR", "SERVE_PROXY_ACTOR"))]
    assert any(n.startswith("SERVE_PROXY_ACTOR") for n in serve_actors), serve_actors
    others = {n: probe(ray.get_actor(n, namespace="serve")) for n in serve_actors}
    assert not any(p["torch"] for p in others.values()), others
