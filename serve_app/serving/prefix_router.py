"""`PrefixAwareRouter`: Ray Serve request router that ranks LLMServer replicas by predicted time to
first token, knowing what each replica's prefix cache holds (policy: `serving.prefix_policy`).

It extends `KVCacheAwareRouter` (same ledger, occupancy projection, hooks) with the following. Stale
load samples do not switch it to least in-flight (a loaded machine delays Serve's broadcasts by
seconds, and least in-flight would scatter every prefix group): what a replica's cache holds stays
true until its next update says otherwise, so it keeps ranking by predicted TTFT on the newest sample
and its own ledger; a replica with no sample at all counts as idle, and decisions then are labelled
`fallback`.
- a `PrefixIndex` per router, fed by the `kv_*` keys of each replica's routing stats (exact cache
  contents, incremental, resynced on gaps and restarts; `serve_app.engine.kv_events`);
- `RecentPrefixes`: prompt blocks it routed to a replica that the replica's stats may not show yet;
- each replica's `kv_pending` (`serve_app.serving.pending_prefixes`): prompt blocks any router sent
  there that are not prefilled yet, so routers in other ingress replicas follow a new prefix group
  before its blocks reach the cache;
- the request's block keys, hashed from the `prompt_token_ids` the ingress put in the request, with
  the engine's own chained hash and salt (`serve_app.block_hash`), so they are the engine's keys.
  A request without token ids (another caller) is routed as the occupancy router does;
- predicted-vs-actual cached tokens: each replica publishes what its engine found for finished
  requests (`cached_tokens`), matched here by request id against what was predicted at routing.

Backends that publish no cache events (vLLM) are routed from `RecentPrefixes` alone (what this
router sent there, never told of evictions): their predictions are labelled `approximate`.
"""

from __future__ import annotations

import asyncio
import math
from collections import OrderedDict
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, ReplicaResult, RunningReplica

from serve_app.block_hash import leading_run, prompt_block_keys
from serve_app.serving.expiring_map import ExpiringMap
from serve_app.serving.prefix_index import PrefixIndex
from serve_app.serving.prefix_policy import (
    PrefixCandidate,
    RecentPrefixes,
    StickyUsers,
    affinity,
    fleet_costs,
    make_candidate,
    rank_by_ttft,
)
from serve_app.serving.request_size import estimate_request_blocks, find_request
from serve_app.serving.router import KVCacheAwareRouter, logger
from serve_app.serving.routing_config import KVRouterSettings
from serve_app.serving.routing_policy import ReplicaView, rank_replicas

EXPIRE_PER_DECISION = 256  # expiry records one decision may look at (more than one decision ever adds)


class PrefixAwareRouter(KVCacheAwareRouter):
    """Ranks replicas by predicted TTFT from their exact cache contents (see module docstring)."""

    def _configure(self, settings: KVRouterSettings) -> None:
        super()._configure(settings)
        self.index = PrefixIndex()
        self.recent = RecentPrefixes()
        self.users = StickyUsers()
        self._stats_seen: dict[str, int] = {}  # replica → id() of the stats dict last folded in
        self._pending: dict[str, frozenset[int]] = {}  # replica → block keys of prompts it holds, not yet prefilled
        # internal id → (request, chosen replica, predicted cached tokens by replica), until Serve confirms;
        # a choice whose routing was cancelled goes with its ledger reservation's TTL
        self._choices: ExpiringMap[str, tuple[Any, str, dict[str, int]]] = ExpiringMap(settings.reservation_ttl_s)
        # request id → (predicted cached tokens, source, at), until the replica reports; a report that
        # never comes (lost, the replica left) ends with the request's own lifetime
        self.predictions: ExpiringMap[str, tuple[int, str, float]] = ExpiringMap(settings.confirmed_ttl_s)
        # request id → (predicted, actual cached tokens, prompt tokens), the newest 10k (tests, benchmarks)
        self.matched_predictions: OrderedDict[str, tuple[int, int, int]] = OrderedDict()
        self.last_candidates: list[PrefixCandidate] = []
        self._sync_task: asyncio.Task | None = None

    def initialize_state(self, **kwargs: Any) -> None:
        self._configure(KVRouterSettings.from_kwargs(kwargs))
        logger.info("PrefixAwareRouter: %s", self.settings)

    # ---- replica updates ------------------------------------------------------------------------
    def _sync(self, replica: RunningReplica, now: float) -> None:
        """Fold the replica's latest stats into the index (once per broadcast) and match its reports."""
        replica_id = replica.replica_id.unique_id
        stats = replica.routing_stats or {}
        if self._stats_seen.get(replica_id) == id(stats):
            return
        self._stats_seen[replica_id] = id(stats)
        self.index.apply(replica_id, stats)
        self._pending[replica_id] = frozenset(stats.get("kv_pending", ()))
        for request_id, actual, prompt_tokens in stats.get("cached_tokens", ()):
            predicted = self.predictions.pop(request_id, None)
            if predicted is not None:
                self._record_prediction(replica_id, request_id, predicted[0], int(actual), int(prompt_tokens), predicted[1])
        sampled_at = stats.get("sampled_at")
        # entries go once the replica's own (synced) cache view covers them; until then they are all
        # this router knows of what is about to be cached there
        if sampled_at is not None and self.index.is_synced(replica_id):
            in_flight = self.ledger.by_replica.get(replica_id, {})
            self.recent.prune(replica_id, float(sampled_at) - self.settings.sample_lag_s, in_flight)

    def _record_prediction(self, replica_id: str, request_id: str, predicted: int, actual: int, prompt_tokens: int,
                           source: str) -> None:
        self.matched_predictions[request_id] = (predicted, actual, prompt_tokens)
        while len(self.matched_predictions) > 10_000:
            self.matched_predictions.popitem(last=False)
        if self.metrics is not None:
            self.metrics.record_prediction(replica_id, predicted, actual, source)

    def _start_sync(self) -> None:
        """From the first decision on (on the router's event loop), fold every replica's broadcast in
        each stats period even when nothing is being routed: the cached-token reports of the last
        requests of a burst are matched (and exported) without waiting for the next request."""
        if self._sync_task is None:
            self._sync_task = asyncio.get_running_loop().create_task(self._sync_periodically())

    async def _sync_periodically(self) -> None:
        while True:
            await asyncio.sleep(self.settings.stats_period_s)
            try:
                now = self._get_curr_time_s()
                for replica in list(self._replicas.values()):
                    self._sync(replica, now)
            except Exception:  # noqa: BLE001 - a bad broadcast must not stop later ones from being read
                logger.exception("PrefixAwareRouter: folding in a replica update failed")

    # ---- decisions ------------------------------------------------------------------------------
    def _request_keys(self, request: Any) -> list[int] | None:
        """Block keys of the request's cacheable prompt blocks (None without token ids)."""
        ids = getattr(request, "prompt_token_ids", None)
        if ids is None:
            return None
        return prompt_block_keys(ids, self.settings.block_size, getattr(request, "cache_salt", None))

    def _cached_blocks(self, replica_id: str, keys: list[int]) -> int:
        """Leading blocks of `keys` the replica will hold when the request's turn comes: cached there
        (its published cache), sent there by this router since, or queued there by any router (its
        published pending prompts)."""
        return max(self.index.num_cached_blocks(replica_id, keys), self.recent.matched_blocks(replica_id, keys),
                   leading_run(keys, self._pending.get(replica_id, frozenset())))

    def _refresh(self, candidate_replicas: list[RunningReplica], now: float) -> None:
        self._start_sync()
        self._expire_predictions(now)
        for replica in candidate_replicas:
            self._sync(replica, now)

    def _order(self, views: list[ReplicaView], pending_request: PendingRequest | None, now: float) -> list[str]:
        request = find_request(pending_request.args, pending_request.kwargs) if pending_request is not None else None
        keys = self._request_keys(request) if request is not None else None
        if keys is None:  # not a generation with token ids: as the occupancy router
            ranked, mode = rank_replicas(views, self.settings, self._rng)
            reason = "fallback" if mode == "fallback" else "load"
            order = [v.replica_id for v in ranked]
            cached = dict.fromkeys(order, 0)
            prompt_tokens = self._size(pending_request)[1] if pending_request is not None else 0
            uncached = dict.fromkeys(order, prompt_tokens)
            ttft: dict[str, float] = {}
        else:
            num_tokens = len(request.prompt_token_ids)
            blocks = estimate_request_blocks(request, self.settings)
            fallback = fleet_costs(views, self.settings)
            candidates = [make_candidate(v, self._cached_blocks(v.replica_id, keys), num_tokens, blocks, self.settings, fallback)
                          for v in views]
            noise = affinity(keys, [v.replica_id for v in views], self.settings.affinity_blocks)
            ordered, reason = rank_by_ttft(candidates, self.settings, noise, self.users.get(request.user))
            if any(v.sample is None for v in views):
                reason = "fallback"  # ranked on what this router knows: cache events, own routes, affinity
            self.last_candidates = ordered
            order = [c.view.replica_id for c in ordered]
            cached = {c.view.replica_id: c.cached_tokens for c in ordered}
            uncached = {c.view.replica_id: num_tokens - c.cached_tokens for c in ordered}
            ttft = {c.view.replica_id: c.ttft_s for c in ordered}
        self.num_decisions[reason] += 1
        if self.metrics is not None:
            self.metrics.record_decision(reason, order[0])
        self.last_ranking = sorted(views, key=lambda v: order.index(v.replica_id))
        if pending_request is not None:
            # reserve now (concurrent decisions see it); Serve confirms it in on_request_routed
            internal_id = pending_request.metadata.internal_request_id
            blocks = estimate_request_blocks(request, self.settings) if request is not None else 0
            # its prompt counts as queued there until its predicted first token (+ one stats period:
            # by then a sample shows what is really still queued)
            done_at = now + ttft[order[0]] + self.settings.stats_period_s if order[0] in ttft else math.inf
            self.ledger.reserve(internal_id, order[0], blocks, now, pending=pending_request, prompt_tokens=uncached[order[0]],
                                prefill_done_at=done_at)
            if keys is not None:
                self.recent.add(order[0], now, keys, internal_id)
                self._choices.set(internal_id, (request, order[0], cached), now)
        return order

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: ReplicaResult) -> None:
        super().on_request_routed(pending_request, replica_id, result)
        internal_id = pending_request.metadata.internal_request_id
        choice = self._choices.pop(internal_id, None)
        if choice is None:
            return
        request, chosen, cached = choice
        target = replica_id.unique_id
        if target != chosen:  # the chosen replica was full: the prefix goes to the cache of this one
            self.recent.add(target, self._get_curr_time_s(), self._request_keys(request), internal_id)
        source = "exact" if self.index.tracks(target) else "approximate"
        now = self._get_curr_time_s()
        self.predictions.set(request.request_id, (cached.get(target, 0), source, now), now)
        self.users.set(request.user, target)

    def _expire_predictions(self, now: float) -> None:
        """Forget predictions never matched by a report and choices never confirmed: amortized O(1)
        per decision (`ExpiringMap`), not a scan of everything outstanding; a decision looks at no more
        than `EXPIRE_PER_DECISION` records of each, so entries that fall due together are spread over
        later decisions instead of stalling one."""
        self.predictions.expire(now, EXPIRE_PER_DECISION)
        self._choices.expire(now, EXPIRE_PER_DECISION)

    def _forget(self, replica_id: ReplicaID) -> None:
        super()._forget(replica_id)
        self.index.remove(replica_id.unique_id)
        self.recent.remove(replica_id.unique_id)
        self._pending.pop(replica_id.unique_id, None)
        self._stats_seen.pop(replica_id.unique_id, None)
