"""Prefix-cache-aware routing policy, free of Ray: predicted time to first token (seconds) per replica.

For a request with prompt block keys K (`serve_app.block_hash`, the engine's own chained hashes, so
the router looks up exactly what the engine will) and `n` prompt tokens, on replica r:

    cached_r   = leading blocks of K that r holds: its published cache (`PrefixIndex`, exact) or
                 that this router sent there since r's last sample (`RecentPrefixes`: about to be
                 cached there), × block size; capped as the engine caps it (the last prompt token is
                 always computed)
    queued_r   = prompt tokens r still has to read (its sample) + uncached prompt tokens of the
                 requests this router sent there since that sample (the ledger)
    tokens_r   = queued_r + (n − cached_r)
    TTFT_r     = tokens_r × prefill s/token + steps_r × (step fixed s + running × decode s/token),
                 steps_r = ceil(tokens_r / step_token_budget): the prefill work ahead of the first
                 token, plus the decode steps of the batch it joins, interleaved with it

    cost_r     = TTFT_r + recompute_weight × (max over replicas of cached − cached_r) × prefill s/token

with each replica's own step-cost fit (published with its routing stats; until it has one, the mean
of the other replicas' fits, or the `default_*` settings when none has one). The second term of
cost_r is the prefill a replica would spend recomputing blocks another replica already holds: it
is taken from every request queued behind this one there, and the copy evicts other prefixes, so
the request's own TTFT alone (greedy) would scatter prefix groups whenever the two queues differ by
about one prompt. Replicas are ranked by cost_r; the KV occupancy projection of the occupancy router
(`routing_policy`) is a constraint: a replica where the request would push the projection past
`max_occupancy` (forcing preemption) ranks after every replica that has room. "Stick to the warm
replica until the cold one is faster" falls out: a hot prefix spills to a second replica once the
first one's queue costs more than reading the prefix again (three times, by default), and then it is
cached there too. Costs within `ttft_tie_ratio` × the best + `ttft_tie_tolerance_s` are ties, broken by the replica that
last served the request's `user` (a session), then by more cached tokens, then by rendezvous hashing
of the prompt's first `affinity_blocks` blocks over the replica ids: with nothing cached anywhere yet
(or not yet published), every router — one per ingress replica — independently sends prompts that
start alike to the same replica, and different prompts spread evenly (no herding, no scatter). For a
request no replica is known to hold any of (cold), the band is `cold_tie_ratio` (wider): only load
and the replicas' step-cost fits tell them apart then, two routers see those at different moments,
and with a narrow band a small change in between (a fit moving after one slow step) sends the next
turn of a chat, routed by another ingress replica before the first turn's blocks are published, to
a different replica than the first. A real queue (a prompt ahead) still costs more than the band.

Each decision has a reason (metrics): `cache_hit` (sent where its prefix is cached), `spill`
(another replica held more of its prefix but was slower), `load` (no replica held any of it),
`fallback` (stale statistics: least in-flight, as the occupancy router).
"""

from __future__ import annotations

import hashlib
import math
from collections import Counter, OrderedDict, deque
from collections.abc import Container, Sequence
from dataclasses import dataclass

from serve_app.block_hash import leading_run, max_cacheable_blocks
from serve_app.serving.routing_config import KVRouterSettings
from serve_app.serving.routing_policy import ReplicaView


@dataclass(frozen=True)
class PrefixCandidate:
    """One replica's predicted cost for the request at hand."""

    view: ReplicaView
    cached_tokens: int  # predicted prompt tokens the engine will find cached there
    queued_tokens: int  # prompt tokens it must read before this request's own
    ttft_s: float  # predicted time to first token
    prefill_s_per_token: float  # the replica's cost of reading one prompt token (its fit, or the fleet's)
    occupancy_after: float  # KV occupancy projection with this request added
    has_room: bool


@dataclass(frozen=True)
class StepCosts:
    """Seconds per engine step: fixed, per prompt token, per decode token."""

    fixed_s: float
    prefill_s: float
    decode_s: float


def published_costs(view: ReplicaView) -> StepCosts | None:
    sample = view.sample
    if sample is None or sample.prefill_s_per_token <= 0:
        return None
    return StepCosts(sample.step_fixed_s, sample.prefill_s_per_token, sample.decode_s_per_token)


def fleet_costs(views: Sequence[ReplicaView], settings: KVRouterSettings) -> StepCosts:
    """The mean of the replicas' published fits: the cost assumed for a replica that has none yet (a
    new replica runs on the same hardware; the configured defaults would make it look faster or
    slower than it is). The defaults only when no replica has a fit."""
    fits = [c for v in views if (c := published_costs(v)) is not None]
    if not fits:
        return StepCosts(settings.default_step_fixed_s, settings.default_prefill_s_per_token, settings.default_decode_s_per_token)
    n = len(fits)
    return StepCosts(sum(c.fixed_s for c in fits) / n, sum(c.prefill_s for c in fits) / n, sum(c.decode_s for c in fits) / n)


def predict_ttft_s(view: ReplicaView, tokens: int, settings: KVRouterSettings, fallback: StepCosts) -> float:
    """Seconds until the first token of a request behind `tokens` prompt tokens on that replica."""
    costs = published_costs(view) or fallback
    running = view.sample.num_running if view.sample else 0
    steps = max(1, math.ceil(tokens / settings.step_token_budget))
    return tokens * costs.prefill_s + steps * (costs.fixed_s + running * costs.decode_s)


def make_candidate(view: ReplicaView, cached_blocks: int, num_prompt_tokens: int, request_blocks: int,
                   settings: KVRouterSettings, fallback: StepCosts) -> PrefixCandidate:
    """`view.prefill_backlog` is the replica's queued prompt tokens: its sample's unread ones plus the
    uncached tokens this router sent there since (the ledger holds each request's uncached tokens)."""
    cached_blocks = min(cached_blocks, max_cacheable_blocks(num_prompt_tokens, settings.block_size))
    cached = cached_blocks * settings.block_size
    sample = view.sample
    queued = view.prefill_backlog
    ttft = predict_ttft_s(view, queued + num_prompt_tokens - cached, settings, fallback)
    total = max(sample.num_total_blocks, 1) if sample else 1
    after = view.occupancy + max(request_blocks - cached_blocks, 0) / total if sample else math.inf
    prefill_s = (published_costs(view) or fallback).prefill_s
    return PrefixCandidate(view, cached, queued, ttft, prefill_s, after, after <= settings.max_occupancy)


def affinity(keys: Sequence[int], replica_ids: Sequence[str], affinity_blocks: int) -> dict[str, float]:
    """Rendezvous-hash weight of each replica for a prompt (the same in every router and process);
    lower wins. Prompts shorter than a block get no affinity (all 0)."""
    if not keys:
        return dict.fromkeys(replica_ids, 0.0)
    anchor = keys[min(len(keys), affinity_blocks) - 1]
    return {r: int.from_bytes(hashlib.blake2b(f"{anchor}:{r}".encode(), digest_size=8).digest(), "little") / 2**64
            for r in replica_ids}


def rank_by_ttft(candidates: Sequence[PrefixCandidate], settings: KVRouterSettings, noise: dict[str, float],
                 sticky_replica: str | None = None) -> tuple[list[PrefixCandidate], str]:
    """Best first, and the decision's reason (see module docstring; not `fallback`, which the caller
    decides when statistics are stale). `noise`: the last tie-break per replica (`affinity`)."""
    if not candidates:
        return [], "load"
    some_room = any(c.has_room for c in candidates)
    most_cached = max(c.cached_tokens for c in candidates)
    cost = {c.view.replica_id: c.ttft_s + settings.recompute_weight * (most_cached - c.cached_tokens) * c.prefill_s_per_token
            for c in candidates}

    def key(c: PrefixCandidate) -> tuple:
        blocked = some_room and not c.has_room
        return (blocked, cost[c.view.replica_id], c.view.replica_id)

    ordered = sorted(candidates, key=key)
    best = cost[ordered[0].view.replica_id]
    best_room = ordered[0].has_room or not some_room
    ratio = settings.ttft_tie_ratio if most_cached > 0 else settings.cold_tie_ratio
    tied = [c for c in ordered if (c.has_room or not some_room) == best_room
            and cost[c.view.replica_id] <= best * (1 + ratio) + settings.ttft_tie_tolerance_s]
    tied.sort(key=lambda c: (c.view.replica_id != sticky_replica, -c.cached_tokens, noise.get(c.view.replica_id, 0.0)))
    ordered = tied + [c for c in ordered if c not in tied]
    chosen = ordered[0]
    if chosen.cached_tokens > 0 and chosen.cached_tokens == most_cached:
        reason = "cache_hit"
    elif most_cached > chosen.cached_tokens:
        reason = "spill"
    else:
        reason = "load"
    return ordered, reason


class RecentPrefixes:
    """Prompt block keys this router sent to each replica, until that replica's samples include them.

    An entry counts while its request is in flight (a queued request's prefix is not computed yet,
    so the replica's cache events cannot show it), while it is younger than the replica's last
    sample minus `sample_lag_s`, or while the router's view of that replica's cache is not synced;
    after that the replica's published cache is the truth (it may have evicted the prefix since). For a replica that publishes no cache events the caller does not
    prune, and this is all the router knows of it: the newest `max_per_replica` requests
    (approximate, never told of evictions). Keys are chained hashes, so a key stands for its whole
    prefix, and a leading run is a walk down the keys.
    """

    def __init__(self, max_per_replica: int = 4096) -> None:
        self.max_per_replica = max_per_replica
        self._entries: dict[str, deque[tuple[float, tuple[int, ...], str]]] = {}
        self._counts: dict[str, Counter[int]] = {}

    def add(self, replica_id: str, routed_at: float, keys: Sequence[int], request_id: str = "") -> None:
        entries = self._entries.setdefault(replica_id, deque())
        counts = self._counts.setdefault(replica_id, Counter())
        entries.append((routed_at, tuple(keys), request_id))
        counts.update(keys)
        if len(entries) > self.max_per_replica:
            self._drop(counts, entries.popleft())

    @staticmethod
    def _drop(counts: Counter[int], entry: tuple[float, tuple[int, ...], str]) -> None:
        counts.subtract(entry[1])
        for key in entry[1]:
            if counts[key] <= 0:
                del counts[key]

    def prune(self, replica_id: str, cut: float, in_flight: Container[str] = ()) -> None:
        """Drop entries routed at or before `cut` whose request is no longer in flight."""
        entries = self._entries.get(replica_id)
        if not entries or entries[0][0] > cut:
            return
        counts = self._counts[replica_id]
        kept: deque[tuple[float, tuple[int, ...], str]] = deque()
        for entry in entries:
            if entry[0] > cut or entry[2] in in_flight:
                kept.append(entry)
            else:
                self._drop(counts, entry)
        self._entries[replica_id] = kept

    def matched_blocks(self, replica_id: str, keys: Sequence[int]) -> int:
        """Longest leading run of `keys` that some recent request to the replica shares."""
        return leading_run(keys, self._counts.get(replica_id, ()))

    def remove(self, replica_id: str) -> None:
        self._entries.pop(replica_id, None)
        self._counts.pop(replica_id, None)


class StickyUsers:
    """The replica each `user` was last sent to (bounded, least recently used dropped first)."""

    def __init__(self, capacity: int = 10_000) -> None:
        self.capacity = capacity
        self._last: OrderedDict[str, str] = OrderedDict()

    def get(self, user: str | None) -> str | None:
        return None if not user else self._last.get(user)

    def set(self, user: str | None, replica_id: str) -> None:
        if not user:
            return
        self._last[user] = replica_id
        self._last.move_to_end(user)
        while len(self._last) > self.capacity:
            self._last.popitem(last=False)
