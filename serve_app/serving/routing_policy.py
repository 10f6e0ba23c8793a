"""KV-cache-aware routing policy, free of Ray: each replica's estimated occupancy and prefill
backlog, and the ranking (its settings: `routing_config.KVRouterSettings`).

`serve_app.serving.router.KVCacheAwareRouter` is the Ray Serve adapter around these pieces
(docs/routing.md); keeping them free of Ray makes every decision testable without a cluster. The
bookkeeping they read is elsewhere: what each replica published (`replica_sample`), what this router
sent where (`routing_ledger`), and what a request will cost (`request_size`).

Estimated occupancy of a replica (fraction of its KV blocks, may exceed 1 when demand exceeds room):

    max(used blocks in its last published sample
        + waiting_weight × blocks of the sample's waiting requests     # queued demand, not yet in the cache
        + blocks of the requests this router sent there since that sample,
        blocks of all this router's requests in flight there, at their estimated final size)
    / num_total_blocks

The second term is what the sample cannot show: a request that has just started decoding holds its
prompt's blocks but will grow to its full size (three long generations that hold 75% of a cache now
will fill it before they finish, and a request sent there waits for one of them to end). It counts
only this router's requests, so with several routers (one per ingress replica) the sample-based
term, which counts everyone's, is the floor.

A request's blocks are those it will hold at its end (`request_size.estimate_request_blocks`). "Since
that sample" means routed after `sampled_at − sample_lag_s` (`sampled_at` is the replica's wall clock
when it took the sample; the lag covers transit and the time until the engine takes the request in,
up to one engine step: on a busy CPU that is most of a second, and a request missed by both the
sample and the ledger (`routing_ledger`) is what lets a burst herd). Requests the router sent earlier
are in the sample: in its used blocks once admitted, or among its `num_waiting` requests. The engine
queues first-come first-served, so the waiting ones are taken to be the newest of this router's
requests there (counted with their own estimated size, as a long prompt waiting for room is exactly
what must not attract more); waiting requests beyond those (other routers', preempted ones) count as
the mean routed request. Finished requests leave the ledger.

Estimated prefill backlog of a replica (tokens it must read before a new request's first token):

    prompt tokens not yet computed in its last sample (`num_pending_prompt_tokens`), less what the
      replica has read since at its own fitted rate (`unread_prompt_tokens`: a sample taken while
      a long prompt was being read says nothing of the next second, when it may be done)
    + prompt tokens of the requests this router sent there since that sample

Score = occupancy + prefill_weight × backlog / (num_total_blocks × block_size). Occupancy alone treats
a prompt being read and one already read alike, but a request sent behind a long prompt waits for
that prompt's prefill (on a CPU, most of a second per few hundred tokens) before its own first
token: the backlog term steers it to a replica that will start it sooner. prefill_weight 0 ranks by
KV occupancy alone.

Ranking: if every candidate has a sample younger than `max_stats_age_s`, the replicas are ordered by
score; those within `tie_tolerance` of the best form the first group and are ordered by
(waiting requests + requests routed since the sample, in-flight requests). Otherwise (some replica
has no sample yet or only a stale one) every candidate is ordered by this router's in-flight count
(least first). Either way the result is a full order, so Serve falls through to the next replica when
one has no free slot (max_ongoing_requests).
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

from serve_app.serving.replica_sample import ReplicaSample
from serve_app.serving.routing_config import KVRouterSettings


# ---- ranking -----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ReplicaView:
    """What the ranking knows about one candidate at decision time."""

    replica_id: str
    sample: ReplicaSample | None
    stats_age_s: float | None  # None: no sample
    num_in_flight: int  # this router's requests on it (routed, not completed)
    pending_blocks: int = 0  # blocks routed since its sample
    pending_requests: int = 0  # requests routed since its sample
    waiting_blocks: float = 0.0  # estimated blocks of the sample's waiting requests
    occupancy: float = math.inf  # estimated, see module docstring (inf without a fresh sample)
    prefill_backlog: int = 0  # estimated prompt tokens it must read first (see module docstring)
    score: float = math.inf  # what the ranking orders by: occupancy + weighted backlog


def waiting_demand(sample: ReplicaSample, own_blocks: int, own_requests: int, mean_request_blocks: float) -> float:
    """Blocks the sample's waiting requests will need: this router's own (newest) ones by their size,
    any others as the mean routed request."""
    return own_blocks + max(sample.num_waiting - own_requests, 0) * mean_request_blocks


def estimate_occupancy(sample: ReplicaSample, pending_blocks: int, waiting_blocks: float,
                       settings: KVRouterSettings, own_final_blocks: int = 0) -> float:
    total = max(sample.num_total_blocks, 1)
    sampled = sample.num_used_blocks + settings.waiting_weight * waiting_blocks + pending_blocks
    return max(sampled, own_final_blocks) / total


def estimate_score(sample: ReplicaSample, occupancy: float, prefill_backlog: int, settings: KVRouterSettings) -> float:
    cache_tokens = max(sample.num_total_blocks * settings.block_size, 1)
    return occupancy + settings.prefill_weight * prefill_backlog / cache_tokens


def rank_replicas(views: Sequence[ReplicaView], settings: KVRouterSettings,
                  rng: random.Random | None = None) -> tuple[list[ReplicaView], str]:
    """Candidates best first, and the mode used: "kv" (score) or "fallback" (least in-flight)."""
    rng = rng or random
    noise = {v.replica_id: rng.random() for v in views}
    fresh = all(v.sample is not None and v.stats_age_s is not None and v.stats_age_s <= settings.max_stats_age_s
                for v in views)
    if not views:
        return [], "kv"
    if not fresh:
        return sorted(views, key=lambda v: (v.num_in_flight, v.score, noise[v.replica_id])), "fallback"
    best = min(v.score for v in views)
    tied = [v for v in views if v.score <= best + settings.tie_tolerance]
    rest = [v for v in views if v.score > best + settings.tie_tolerance]
    tied.sort(key=lambda v: (v.sample.num_waiting + v.pending_requests, v.num_in_flight, v.score, noise[v.replica_id]))
    rest.sort(key=lambda v: (v.score, v.num_in_flight, noise[v.replica_id]))
    return tied + rest, "kv"
