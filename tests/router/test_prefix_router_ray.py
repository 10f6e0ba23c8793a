"""PrefixAwareRouter on a real Ray Serve app: 2 LLMServer replicas (small KV caches) behind 2 ingress
replicas, each with its own router.

Through the HTTP API (the ingress tokenizes, each ingress replica routes): a group of requests sharing
a long prefix lands on one replica and hits its cache; a 3-turn chat stays on its replica; a burst of
distinct prompts through both ingress replicas spreads; a hot prefix under saturation spills to the
second replica. Through a DeploymentHandle in this process (same router class, so its state can be
read): after the prefix is evicted on one replica the router sends it where it is still cached, and
the predicted cached tokens equal the engine's on a deterministic trace. Which replica ran each request
comes from the replica probe; cache hits from `usage.prompt_tokens_details.cached_tokens`.
"""

from __future__ import annotations

import asyncio
import random
import time

import httpx
import pytest

from tests.router.ray_helpers import (
    cancel_all,
    llm_replicas,
    router_app_args,
    send_direct,
    serve_app,
    served_by,
    wait_for,
)
from tests.serving.conftest import APP_NAME, MODEL_DIR, MODEL_NAME

pytestmark = pytest.mark.timeout(900)

BLOCK = 16
WORDS = ("alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar papa quebec "
         "romeo sierra tango uniform victor whiskey xray yankee zulu river stone cloud maple ember harbor").split()


def text(rng: random.Random, n_words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n_words))


@pytest.fixture(scope="module")
def app(local_ray, probe_dir):
    # statistics count as fresh for 30 s (default here 2 s): on a loaded 2-core machine a replica busy
    # prefilling publishes late, and these tests check the cache-aware choice, not the stale fallback
    args = router_app_args(router="prefix_aware", ingress_num_replicas=2, ingress_num_cpus=0,
                           engine={"num_blocks": 96, "max_num_seqs": 8}, router_kwargs={"max_stats_age_s": 30.0})
    with serve_app(args) as base_url:
        yield base_url


@pytest.fixture(scope="module")
def tokenizer():
    from serve_app.input_processor import InputProcessor

    return InputProcessor(str(MODEL_DIR), 49152, 2048)


async def _complete(client: httpx.AsyncClient, base_url: str, prompt: str, max_tokens: int = 4) -> dict:
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    response = await client.post(f"{base_url}/v1/completions", json=body)
    response.raise_for_status()
    return response.json()


def complete_all(base_url: str, prompts: list[str], concurrent: bool, max_tokens: int = 4) -> list[dict]:
    async def main() -> list[dict]:
        async with httpx.AsyncClient(timeout=300) as client:
            if concurrent:
                return list(await asyncio.gather(*(_complete(client, base_url, p, max_tokens) for p in prompts)))
            return [await _complete(client, base_url, p, max_tokens) for p in prompts]

    return asyncio.run(main())


def engine_ids(replies: list[dict]) -> list[str]:
    return [f"{r['id']}-0-0" for r in replies]


def cached(reply: dict) -> int:
    return reply["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_a_shared_prefix_group_lands_on_one_replica_and_hits(app, probe_dir, tokenizer):
    rng = random.Random(1)
    prefix = text(rng, 300)
    prompts = [f"{prefix} question {i}: {text(rng, 6)}" for i in range(5)]
    replies = complete_all(app, prompts, concurrent=False)  # one after another, alternating ingress replicas
    where = served_by(probe_dir, engine_ids(replies))
    assert len(set(where.values())) == 1, where
    shared = len(tokenizer.tokenize(prefix + " question")) // BLOCK * BLOCK  # full blocks common to the group
    assert shared >= 256
    assert [cached(r) >= shared for r in replies[1:]] == [True] * 4, [cached(r) for r in replies]


def test_a_three_turn_chat_stays_on_its_replica(app, probe_dir):
    rng = random.Random(2)
    messages = [{"role": "system", "content": text(rng, 200)}]
    replies = []

    async def main() -> None:
        async with httpx.AsyncClient(timeout=300) as client:
            for turn in range(3):
                messages.append({"role": "user", "content": f"turn {turn}: {text(rng, 8)}"})
                body = {"model": MODEL_NAME, "messages": messages, "max_tokens": 8, "temperature": 0}
                response = await client.post(f"{app}/v1/chat/completions", json=body)
                response.raise_for_status()
                reply = response.json()
                replies.append(reply)
                messages.append({"role": "assistant", "content": reply["choices"][0]["message"]["content"]})

    asyncio.run(main())
    where = served_by(probe_dir, engine_ids(replies))
    assert len(where) == 3 and len(set(where.values())) == 1, where
    # turns 2 and 3 reuse at least the blocks of the previous turn's prompt
    assert cached(replies[1]) >= replies[0]["usage"]["prompt_tokens"] // BLOCK * BLOCK - BLOCK
    assert cached(replies[2]) >= replies[1]["usage"]["prompt_tokens"] // BLOCK * BLOCK - BLOCK


def test_two_ingress_replicas_spread_a_burst_of_distinct_prompts(app, probe_dir):
    rng = random.Random(3)
    replies = complete_all(app, [text(rng, 40) for _ in range(16)], concurrent=True)
    where = served_by(probe_dir, engine_ids(replies))
    counts = {rid: list(where.values()).count(rid) for rid in set(where.values())}
    assert len(counts) == 2 and min(counts.values()) >= 4, counts


def test_a_hot_prefix_spills_when_its_replica_saturates(app, probe_dir):
    rng = random.Random(4)
    prefix = text(rng, 300)
    first = complete_all(app, [f"{prefix} warm"], concurrent=False)
    # 24 at once, 32 tokens each: one replica (8 sequences at a time) queues most of them
    replies = complete_all(app, [f"{prefix} q{i} {text(rng, 4)}" for i in range(24)], concurrent=True, max_tokens=32)
    where = served_by(probe_dir, engine_ids(first + replies))
    counts = {rid: list(where.values()).count(rid) for rid in set(where.values())}
    assert len(counts) == 2 and min(counts.values()) >= 3, counts
    warm = where[engine_ids(first)[0]]
    spilled = [r for r, rid in zip(replies, engine_ids(replies), strict=True) if where[rid] != warm]
    assert any(cached(r) > 0 for r in spilled)  # the prefix got cached on the second replica too


# ---- through a handle in this process (its router's state is readable) -----------------------------
def _handle():
    from ray import serve

    return serve.get_deployment_handle("LLMServer", app_name=APP_NAME)


def _send(handle, request_id: str, token_ids: list[int], max_tokens: int = 2) -> int:
    """Generate through the handle (the router decides); returns the engine's cached tokens."""
    from serve_app.types import GenerateRequest, SamplingParams

    request = GenerateRequest(request_id, prompt=token_ids, prompt_token_ids=tuple(token_ids),
                              sampling_params=SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))

    async def main() -> int:
        n = 0
        async for chunk in handle.options(stream=True).generate.remote(request):
            n = chunk.num_cached_tokens if chunk.finished else n
        return n

    return asyncio.run(main())


def test_predicted_cached_tokens_equal_the_engines_and_evictions_redirect(app, probe_dir, tokenizer):
    handle = _handle()
    rng = random.Random(5)
    groups = [tokenizer.tokenize(text(rng, 200)) for _ in range(3)]
    actual = []
    for i in range(9):  # a deterministic trace: one at a time, 3 groups × 3 requests
        ids = groups[i % 3] + tokenizer.tokenize(f" q{i} {text(rng, 3)}")
        actual.append(_send(handle, f"det-{i}", ids))
    router = handle._router._asyncio_router.request_router
    assert type(router).__name__ == "PrefixAwareRouter"
    ids = [f"det-{i}" for i in range(9)]
    nudges = iter(range(10**6))

    def routed_until(predicate, message: str) -> None:
        """The router folds the replicas' updates in when it routes: keep it routing (one-token prompts)."""
        def check() -> bool:
            if predicate():
                return True
            _send(handle, f"nudge-{next(nudges)}", tokenizer.tokenize("hi"), max_tokens=1)
            return False

        wait_for(check, 90, interval_s=0.5, message=message)

    routed_until(lambda: all(i in router.matched_predictions for i in ids), "the replicas' cached-token reports")
    errors = [router.matched_predictions[i] for i in ids]
    assert [p for p, _, _ in errors] == [a for _, a, _ in errors], errors  # predicted == actual, request by request
    assert sum(a for _, a, _ in errors) > 0 and sorted(a for _, a, _ in errors) == sorted(actual)

    # eviction: the prefix is cached on both replicas, then evicted on one; the router follows
    where = served_by(probe_dir, ["det-0"])
    warm = where["det-0"]
    replicas = llm_replicas()
    cold = next(r for r in replicas if r != warm)
    keys = router._request_keys(type("R", (), {"prompt_token_ids": groups[0] + [1], "cache_salt": None})())
    _drain(send_direct(replicas[cold], "copy-0", groups[0] + [7, 7, 7], 1))  # now cached on `cold` too
    routed_until(lambda: router.index.num_cached_blocks(cold, keys) == len(keys), "prefix on both replicas")
    floods = [send_direct(replicas[warm], f"flood-{i}", [rng.randrange(1000, 40000) for _ in range(700)], 1) for i in range(2)]
    try:
        for gen in floods:
            _drain(gen)
    finally:
        cancel_all(floods)
    routed_until(lambda: router.index.num_cached_blocks(warm, keys) < len(keys), "the eviction reaching the router")
    for i in range(3):
        _send(handle, f"after-{i}", groups[0] + tokenizer.tokenize(f" again {i}"))
    where = served_by(probe_dir, [f"after-{i}" for i in range(3)])
    assert set(where.values()) == {cold}, (where, warm, cold)


def _drain(gen) -> None:
    import ray

    deadline = time.monotonic() + 120
    for ref in gen:
        ray.get(ref, timeout=max(1.0, deadline - time.monotonic()))
