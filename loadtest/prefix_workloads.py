"""W4 workloads (docs/benchmarks.md): scripts of requests sharing prefixes, sized against one replica's KV cache
(a script is one request or a multi-turn chat re-sending its history and the previous reply; a workload runs
`concurrency` scripts at once), and their ideal prefix-cache hits: every request after its group's first finds
the group's prefix cached (full blocks, the last prompt token excluded); `evict` as the best static partition
allows; a chat turn, the blocks common with the previous turn's prompt + reply.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

WORDS = ("alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar papa quebec romeo sierra tango "
         "uniform victor whiskey xray yankee zulu river stone cloud maple ember harbor meadow canyon glacier prairie summit valley island "
         "desert forest lagoon tundra").split()
BLOCK = 16


@dataclass(frozen=True)
class Step:
    """One request of a script: a prompt, or a chat turn's user message (added to the history at run time)."""

    prompt: str | None = None
    question: str | None = None
    max_tokens: int = 4


@dataclass(frozen=True)
class Script:
    kind: str  # workload name
    group: int  # requests of one group share a prefix (-1: shares nothing)
    steps: tuple[Step, ...]
    system: str | None = None  # chats: the system prompt


@dataclass(frozen=True)
class WorkloadSpec:
    name: str
    concurrency: int
    scripts: tuple[Script, ...]


def make_workloads(cache_tokens: int, seed: int, scale: float = 1.0, shared_factor: float = 1.6, evict_factor: float = 1.5,
                   prefix_words: int = 360) -> dict[str, WorkloadSpec]:
    """The five workloads for replicas of `cache_tokens` KV tokens each: distinct prefixes ≈ `shared_factor` × one
    cache (shared, chat) or `evict_factor` × the cluster's (evict); `scale` multiplies request counts."""
    rng = random.Random(seed)
    prefix_tokens = prefix_words * 1.55  # these words are ~1.55 tokens each with SmolLM2's tokenizer

    def words(k: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(k))

    def n(x: float) -> int:
        return max(2, round(x * scale))

    def groups(num_groups: int, per_group: int, kind: str) -> tuple[Script, ...]:
        scripts = []
        for g in range(num_groups):
            prefix = f"System {kind} {g}: " + words(prefix_words)
            scripts += [Script(kind, g, (Step(prompt=f"{prefix}\nQuestion {q}: {words(6)}?"),)) for q in range(per_group)]
        rng.shuffle(scripts)
        return tuple(scripts)

    # chats: system prompts and histories (~1.4x a system prompt by the last turn) ≈ shared_factor x one cache
    chats = tuple(Script("chat", c, tuple(Step(question=f"Turn {t}: {words(8)}?", max_tokens=8) for t in range(rng.randint(3, 6))),
                         system=f"Chat {c} system: " + words(prefix_words // 2))
                  for c in range(max(2, round(shared_factor * cache_tokens / (prefix_tokens * 0.7) * scale))))
    hot_prefix = "Hot system prompt: " + words(prefix_words)
    hot = [Script("hot", 0, (Step(prompt=f"{hot_prefix}\nQ{i}: {words(6)}?", max_tokens=32),)) for i in range(n(40))]
    hot += [Script("hot", -1, (Step(prompt=words(80), max_tokens=32),)) for _ in range(n(8))]
    rng.shuffle(hot)
    w3 = tuple(Script("w3", -1, (Step(prompt=words(340), max_tokens=64) if rng.random() < 0.12 else Step(prompt=words(44), max_tokens=16),))
               for _ in range(n(32)))
    # (drawn after the others: the same seed gives the same texts as ever)
    shared = groups(max(2, round(shared_factor * cache_tokens / prefix_tokens)), max(2, n(4)), "shared")
    evict = groups(max(3, round(evict_factor * 2 * cache_tokens / prefix_tokens)), max(2, n(3)), "evict")
    return {"shared": WorkloadSpec("shared", 4, shared), "chat": WorkloadSpec("chat", 4, chats), "hot": WorkloadSpec("hot", 16, tuple(hot)),
            "w3": WorkloadSpec("w3", 8, w3), "evict": WorkloadSpec("evict", 4, evict)}


def common_blocks(a: list[int], b: list[int]) -> int:
    """Full blocks of the longest common prefix of two token-id lists."""
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))) // BLOCK


def cacheable(prompt_ids: list[int]) -> int:
    return max(len(prompt_ids) - 1, 0) // BLOCK


def group_ideal_hits(requests: list[tuple[int, list[int]]]) -> dict[int, int]:
    """Per group: the ideal cached tokens of its requests after the first (in arrival order), each against the
    group's first. `requests`: (group, prompt ids); group -1 shares nothing."""
    first, hits = {}, {}  # group → its first prompt's ids, the hit tokens of its later ones
    for group, ids in (r for r in requests if r[0] >= 0):
        if group in first:
            hits[group] += min(common_blocks(first[group], ids), cacheable(ids)) * BLOCK
        else:
            first[group], hits[group] = ids, 0
    return hits


def best_static_partition(groups: dict[int, tuple[int, int]], cache_tokens: int, num_replicas: int,
                          reserve_tokens: int = 0) -> tuple[int, dict[int, int]]:
    """(total hit tokens, group → replica) of a greedy static partition of `groups` ({group: (hit tokens if cached, prefix
    tokens)}): most hits per cached token first, each into the replica with the most room less `reserve_tokens`."""
    room, placed, total = [cache_tokens - reserve_tokens] * num_replicas, {}, 0
    for group, (hits, size) in sorted(groups.items(), key=lambda kv: -kv[1][0] / max(kv[1][1], 1)):
        r = max(range(num_replicas), key=lambda i: room[i])
        if size <= room[r] and hits > 0:
            room[r], placed[group], total = room[r] - size, r, total + hits
    return total, placed
