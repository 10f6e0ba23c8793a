"""Request routers for the LLMServer deployment (Ray Serve's pluggable `RequestRouter`, alpha in 2.60).

- `KVCacheAwareRouter`: sends each request to the replica with the lowest estimated KV-cache
  occupancy: its last published `kv_cache_usage` sample (`LLMServer.record_routing_stats`, every
  `request_routing_stats_period_s`) plus the blocks of the requests this router sent there since
  that sample, so that a burst between two samples spreads instead of herding onto the replica that
  looked emptiest, or, if larger, its own requests there at their final size. The prompt tokens
  still to be read there (sampled + sent since) weigh in too: a request queued behind a long prefill
  waits for it. Ties go to the shorter waiting queue; replicas without a fresh sample make the router
  fall back to least in-flight. The policy (settings, estimates, ranking) lives in `routing_policy`,
  the bookkeeping it reads in `replica_sample`, `routing_ledger` and `request_size`; options come
  from `request_router_kwargs` (`KVRouterSettings`).
- `RoundRobinRouter`: each request to the next replica in turn (a baseline for benchmarks).
- Serve's default power-of-two-choices router stays available (`ServeConfig.router: pow2`).

Serve runs a router inside every `DeploymentHandle` (here: in each OpenAIIngress replica), on the
handle's event loop; every hook below runs on that loop, so the state needs no lock.
`choose_replicas` (`RankingRouter`, shared by all three) never awaits: it ranks from what is already in
memory and returns every candidate in order (one per rank), so that Serve falls through to the next one
when a replica is full.

Exported metrics (`serve_app.metrics.router_metrics`): `llm_router_routed_requests_total` and
`llm_router_stats_age_seconds`, per target replica.
"""

from __future__ import annotations

import logging
import random
from collections import Counter
from typing import Any

from ray.serve._private.constants import SERVE_LOGGER_NAME
from ray.serve.request_router import (
    FIFOMixin,
    PendingRequest,
    ReplicaID,
    ReplicaResult,
    RequestRouter,
    RunningReplica,
)

from serve_app.serving.replica_sample import ReplicaSample
from serve_app.serving.request_size import estimate_prompt_tokens, estimate_request_blocks, find_request
from serve_app.serving.routing_config import KVRouterSettings
from serve_app.serving.routing_ledger import InFlightLedger
from serve_app.serving.routing_policy import (
    ReplicaView,
    estimate_occupancy,
    estimate_score,
    rank_replicas,
    waiting_demand,
)

logger = logging.getLogger(SERVE_LOGGER_NAME)


def _make_metrics(kind: str, model_name: str) -> Any:
    """RouterMetrics for Ray or a private prometheus registry; None when off or unavailable."""
    if kind == "none":
        return None
    try:
        from serve_app.metrics.router_metrics import RouterMetrics

        name = model_name or "unknown"
        return RouterMetrics.for_ray(name) if kind == "ray" else RouterMetrics.for_registry(name)
    except Exception:  # noqa: BLE001 - metrics must never stop routing
        logger.exception("router metrics unavailable; routing without them")
        return None


class RankingRouter(FIFOMixin, RequestRouter):
    """What the routers here share: `choose_replicas` returns every candidate, one per rank, in the
    order `rank` gives (it never awaits); routed requests are counted, and exported when `metrics`."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.metrics: Any = None
        self.num_routed: Counter[str] = Counter()

    def rank(self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None) -> list[RunningReplica]:
        """Every candidate (at least one), best first."""
        raise NotImplementedError

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        return [[r] for r in self.rank(candidate_replicas, pending_request)]

    def _record_routed(self, replica_id: ReplicaID, stats_age_s: float | None = None) -> None:
        self.num_routed[replica_id.unique_id] += 1
        if self.metrics is not None:
            self.metrics.record_routed(replica_id.unique_id, stats_age_s)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        before = set(self._replicas)
        super().update_replicas(replicas)
        after = set(self._replicas)
        for replica_id in before - after:
            self._forget(replica_id)
        if self.metrics is not None:
            for replica_id in after - before:
                self.metrics.add_replica(replica_id.unique_id)

    def _forget(self, replica_id: ReplicaID) -> None:
        """Drop what the router keeps about a replica that left."""


class KVCacheAwareRouter(RankingRouter):
    """Ranks replicas by estimated KV occupancy (see `serve_app.serving.routing_policy`).

    With `FIFOMixin` (as Serve's own power-of-two router), a replica found for one request goes to
    the oldest pending request when no request matches exactly: handle calls made while serving one
    HTTP request share Serve's internal request id, and without it all but one of them would never be
    routed. The ledger follows what Serve reports (`on_request_routed` moves a reservation to where
    the request really went); it keys requests by that internal id, so callers should give
    concurrent calls their own (the ingress does, per choice).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._configure(KVRouterSettings(metrics="none"))

    def initialize_state(self, **kwargs: Any) -> None:
        """Called by Serve with the deployment's `request_router_kwargs`."""
        self._configure(KVRouterSettings.from_kwargs(kwargs))
        logger.info("KVCacheAwareRouter: %s", self.settings)

    def _configure(self, settings: KVRouterSettings) -> None:
        self.settings = settings
        self.ledger = InFlightLedger()
        self.metrics = _make_metrics(settings.metrics, settings.model_name)
        self._rng = random.Random(settings.seed)
        self._receipts: dict[str, tuple[dict, float]] = {}  # replica → (stats dict, when first seen)
        self._mean_request_blocks = 0.0
        self._num_sized = 0
        self.num_routed.clear()
        self.num_decisions: Counter[str] = Counter()  # by mode: "kv" / "fallback"
        self.last_ranking: list[ReplicaView] = []

    # ---- state for one decision ---------------------------------------------------------------
    def _size(self, pending_request: PendingRequest) -> tuple[int, int]:
        """(KV blocks, prompt tokens) of the request (0, 0 for calls that are not a generation)."""
        request = find_request(pending_request.args, pending_request.kwargs)
        if request is None:
            return 0, 0
        return estimate_request_blocks(request, self.settings), estimate_prompt_tokens(request, self.settings.chars_per_token)

    def _sample_time(self, replica_id: str, stats: dict, sample: ReplicaSample, now: float) -> float:
        """When the sample was taken: published `sampled_at`, else when this router first saw it."""
        if sample.sampled_at is not None:
            return sample.sampled_at
        seen = self._receipts.get(replica_id)
        if seen is None or seen[0] != stats:
            seen = self._receipts[replica_id] = (dict(stats), now)
        return seen[1]

    def _view(self, replica: RunningReplica, now: float) -> ReplicaView:
        replica_id = replica.replica_id.unique_id
        stats = replica.routing_stats or {}
        sample = ReplicaSample.parse(stats)
        in_flight = self.ledger.num_in_flight(replica_id)
        if sample is None:
            return ReplicaView(replica_id, None, None, in_flight)
        taken = self._sample_time(replica_id, stats, sample, now)
        cut = taken - self.settings.sample_lag_s
        blocks, requests, prompt_tokens = self.ledger.since(replica_id, cut, now)
        own_blocks, own_requests = self.ledger.newest_before(replica_id, cut, sample.num_waiting)
        waiting = waiting_demand(sample, own_blocks, own_requests, self._mean_request_blocks)
        own_final_blocks = self.ledger.since(replica_id, None)[0]
        occupancy = estimate_occupancy(sample, blocks, waiting, self.settings, own_final_blocks)
        age = max(0.0, now - taken)
        backlog = sample.unread_prompt_tokens(age, self.settings.step_token_budget) + prompt_tokens
        return ReplicaView(replica_id, sample, age, in_flight, blocks, requests, waiting, occupancy,
                           backlog, estimate_score(sample, occupancy, backlog, self.settings))

    def _stats_age(self, replica_id: ReplicaID, now: float) -> float | None:
        replica = self._replicas.get(replica_id)
        if replica is None:
            return None
        stats = replica.routing_stats or {}
        sample = ReplicaSample.parse(stats)
        if sample is None:
            return None
        return max(0.0, now - self._sample_time(replica_id.unique_id, stats, sample, now))

    # ---- RequestRouter ------------------------------------------------------------------------
    def rank(self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None) -> list[RunningReplica]:
        now = self._get_curr_time_s()
        self.ledger.expire(now, self.settings.reservation_ttl_s, self.settings.confirmed_ttl_s)
        self._refresh(candidate_replicas, now)
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        return [by_id[replica_id] for replica_id in self._order([self._view(r, now) for r in candidate_replicas], pending_request, now)]

    def _refresh(self, candidate_replicas: list[RunningReplica], now: float) -> None:
        """Bring what the router knows of the candidates up to date before their views are taken."""

    def _order(self, views: list[ReplicaView], pending_request: PendingRequest | None, now: float) -> list[str]:
        """The replica ids, best first; the request reserved on the first."""
        ranked, mode = rank_replicas(views, self.settings, self._rng)
        self.num_decisions[mode] += 1
        self.last_ranking = ranked
        if pending_request is not None:
            # reserve the choice now: routing tasks run concurrently, and Serve confirms it
            # (on_request_routed) only after the replica accepted, a round trip later
            blocks, prompt_tokens = self._size(pending_request)
            self.ledger.reserve(pending_request.metadata.internal_request_id, ranked[0].replica_id, blocks, now,
                                pending=pending_request, prompt_tokens=prompt_tokens)
        return [v.replica_id for v in ranked]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: ReplicaResult) -> None:
        now = self._get_curr_time_s()
        blocks, prompt_tokens = self._size(pending_request)
        entry = self.ledger.confirm(pending_request.metadata.internal_request_id, replica_id.unique_id, blocks, now,
                                    prompt_tokens)
        if entry.blocks > 0:
            self._num_sized += 1
            self._mean_request_blocks += (entry.blocks - self._mean_request_blocks) / min(self._num_sized, 100)
        self._record_routed(replica_id, self._stats_age(replica_id, now))

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        self.ledger.complete(internal_request_id, replica_id.unique_id)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._forget(replica_id)

    def _forget(self, replica_id: ReplicaID) -> None:
        self.ledger.remove_replica(replica_id.unique_id)
        self._receipts.pop(replica_id.unique_id, None)


class RoundRobinRouter(RankingRouter):
    """Each request to the next replica in turn (by replica id); a full replica passes its turn on."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._next = 0

    def initialize_state(self, model_name: str = "", metrics: str = "ray") -> None:
        if metrics not in ("ray", "prometheus", "none"):
            raise ValueError("metrics: must be 'ray', 'prometheus' or 'none'")
        self.metrics = _make_metrics(metrics, model_name)

    def rank(self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None) -> list[RunningReplica]:
        ordered = sorted(candidate_replicas, key=lambda r: r.replica_id.unique_id)
        start = self._next % len(ordered)
        self._next += 1
        return ordered[start:] + ordered[:start]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: ReplicaResult) -> None:
        self._record_routed(replica_id)
