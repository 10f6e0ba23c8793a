"""W4 prefix-routing workloads: scripts of requests sharing prefixes, and the ideal prefix-cache hits.

A workload is a list of `Script`s replayed closed-loop (`concurrency` scripts in flight, in the
workload's shuffled order). A script is one request, or a multi-turn chat whose turns run one after
another (each turn re-sends the history with the previous reply). Sizes are relative to one
replica's KV cache (`cache_tokens`):

- shared: groups sharing a long system prompt; distinct prefixes ≈ `shared_factor` × one replica's
  cache (they fit in the cluster only if partitioned); short questions and outputs;
- chat: multi-turn chats (3-6 turns), each with its own system prompt (half a shared prefix), history
  re-sent; enough chats that their histories ≈ `shared_factor` × one replica's cache;
- hot: one prefix carrying most of the load (plus some one-off prompts), many in flight;
- w3: W3's skewed traces (random prompts, nothing shared): the regression check;
- evict: like shared, distinct prefixes ≈ `evict_factor` × the whole cluster's cache.

Ideal hits: every request after the first of its group finds the group's common prefix (in full
blocks, the last prompt token excluded, as the engine caps it) cached. For `evict` only a static
partition can be ideal: `best_static_partition` packs groups (most hit tokens per cached token
first) into each replica's cache. Chats: a turn's ideal is the blocks common with the previous
turn's prompt + reply, as the engine caches them (computed at run time, from the actual tokens).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

WORDS = ("alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar papa quebec "
         "romeo sierra tango uniform victor whiskey xray yankee zulu river stone cloud maple ember harbor meadow "
         "canyon glacier prairie summit valley island desert forest lagoon tundra").split()
BLOCK = 16


@dataclass
class Step:
    """One request of a script; `messages` (chat) grow with the replies at run time."""

    prompt: str | None = None
    question: str | None = None  # chat turn: the user message added to the history
    max_tokens: int = 4


@dataclass
class Script:
    kind: str  # workload name
    group: int  # requests of one group share a prefix (-1: shares nothing)
    steps: list[Step]
    system: str | None = None  # chats: the system prompt
    meta: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class WorkloadSpec:
    name: str
    concurrency: int
    scripts: tuple[Script, ...]


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def _groups(rng: random.Random, num_groups: int, prefix_words: int, per_group: int, max_tokens: int, kind: str) -> list[Script]:
    scripts = []
    for g in range(num_groups):
        prefix = f"System {kind} {g}: " + words(rng, prefix_words)
        for q in range(per_group):
            scripts.append(Script(kind, g, [Step(prompt=f"{prefix}\nQuestion {q}: {words(rng, 6)}?", max_tokens=max_tokens)]))
    rng.shuffle(scripts)
    return scripts


def make_workloads(cache_tokens: int, seed: int, scale: float = 1.0, shared_factor: float = 1.6,
                   evict_factor: float = 1.5, prefix_words: int = 360) -> dict[str, WorkloadSpec]:
    """The five workloads for replicas of `cache_tokens` KV tokens each (`scale` shrinks request counts)."""
    rng = random.Random(seed)
    prefix_tokens = prefix_words * 1.55  # these words are ~1.55 tokens each with SmolLM2's tokenizer
    n = lambda x: max(2, round(x * scale))  # noqa: E731
    shared_groups = max(2, round(shared_factor * cache_tokens / prefix_tokens))
    evict_groups = max(3, round(evict_factor * 2 * cache_tokens / prefix_tokens))
    # chats: their system prompts and histories (~1.4x a system prompt by the last turn) ≈ shared_factor x
    # one replica's cache, so they too stay cached only if partitioned
    chats = []
    for c in range(max(2, round(shared_factor * cache_tokens / (prefix_tokens * 0.7) * scale))):
        turns = rng.randint(3, 6)
        chats.append(Script("chat", c, [Step(question=f"Turn {t}: {words(rng, 8)}?", max_tokens=8) for t in range(turns)],
                            system=f"Chat {c} system: " + words(rng, prefix_words // 2)))
    hot_prefix = "Hot system prompt: " + words(rng, prefix_words)
    hot = [Script("hot", 0, [Step(prompt=f"{hot_prefix}\nQ{i}: {words(rng, 6)}?", max_tokens=32)]) for i in range(n(40))]
    hot += [Script("hot", -1, [Step(prompt=words(rng, 80), max_tokens=32)]) for _ in range(n(8))]
    rng.shuffle(hot)
    w3 = []
    for _ in range(n(32)):
        long = rng.random() < 0.12
        w3.append(Script("w3", -1, [Step(prompt=words(rng, 340 if long else 44), max_tokens=64 if long else 16)], meta={"long": long}))
    return {
        "shared": WorkloadSpec("shared", 4, tuple(_groups(rng, shared_groups, prefix_words, max(2, n(4)), 4, "shared"))),
        "chat": WorkloadSpec("chat", 4, tuple(chats)),
        "hot": WorkloadSpec("hot", 16, tuple(hot)),
        "w3": WorkloadSpec("w3", 8, tuple(w3)),
        "evict": WorkloadSpec("evict", 4, tuple(_groups(rng, evict_groups, prefix_words, max(2, n(3)), 4, "evict"))),
    }


# ---- ideal hits ------------------------------------------------------------------------------------------
def common_blocks(a: list[int], b: list[int]) -> int:
    """Full blocks of the longest common prefix of two token-id lists."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n // BLOCK


def cacheable(prompt_ids: list[int]) -> int:
    return max(len(prompt_ids) - 1, 0) // BLOCK


def group_ideal_hits(requests: list[tuple[int, list[int]]]) -> dict[int, int]:
    """Per group: ideal cached tokens of its requests after the first (arrival order), each against the
    group's first request. `requests` are (group, prompt ids); group -1 shares nothing."""
    first: dict[int, list[int]] = {}
    hits: dict[int, int] = {}
    for group, ids in requests:
        if group < 0:
            continue
        if group not in first:
            first[group] = ids
            hits[group] = 0
            continue
        hits[group] += min(common_blocks(first[group], ids), cacheable(ids)) * BLOCK
    return hits


def best_static_partition(groups: dict[int, tuple[int, int]], cache_tokens: int, num_replicas: int,
                          reserve_tokens: int = 0) -> tuple[int, dict[int, int]]:
    """Ideal hits of a static partition when not every prefix fits: `groups` = {group: (hit tokens if
    its prefix stays cached, prefix tokens)}. Greedy: groups by hit tokens per cached token, each into
    the replica with the most room left (`reserve_tokens` kept free for running requests). Returns
    (total ideal hit tokens, group → replica index)."""
    room = [cache_tokens - reserve_tokens] * num_replicas
    placed: dict[int, int] = {}
    total = 0
    for group, (hits, size) in sorted(groups.items(), key=lambda kv: -kv[1][0] / max(kv[1][1], 1)):
        r = max(range(num_replicas), key=lambda i: room[i])
        if size <= room[r] and hits > 0:
            room[r] -= size
            placed[group] = r
            total += hits
    return total, placed
