"""KV-cache-aware routing policy, free of Ray: request-size estimates, in-flight ledger, ranking (its
settings: `routing_config.KVRouterSettings`).

`serve_app.serving.router.KVCacheAwareRouter` is the Ray Serve adapter around these pieces
(docs/routing.md); keeping them here makes every decision testable without a cluster.

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

A request's blocks = ceil((prompt_weight × prompt tokens + output_weight × min(max_tokens,
max_expected_output_tokens)) / block_size). "Since that sample" means routed after
`sampled_at − sample_lag_s` (`sampled_at` is the replica's wall clock when it took the sample; the
lag covers transit and the time until the engine takes the request in, up to one engine step: on a
busy CPU that is most of a second, and a request missed by both the sample and the ledger is what
lets a burst herd). Requests the router sent earlier are in the sample: in its used blocks once
admitted, or among its `num_waiting` requests. The engine queues first-come first-served, so the
waiting ones are taken to be the newest of this router's requests there (counted with their own
estimated size, as a long prompt waiting for room is exactly what must not attract more); waiting
requests beyond those (other routers', preempted ones) count as the mean routed request. Finished
requests leave the ledger.

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
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from serve_app.serving.routing_config import KVRouterSettings

# ChatML overhead per message ("<|im_start|>role\n" ... "<|im_end|>\n") and for the assistant prefix
CHAT_TOKENS_PER_MESSAGE = 5
CHAT_TOKENS_FIXED = 3


# ---- request size ------------------------------------------------------------------------------------
def estimate_prompt_tokens(request: Any, chars_per_token: float = 4.0) -> int:
    """Prompt length of a `GenerateRequest`-like object (`prompt` text / token ids, or chat `messages`).

    Token ids (`prompt_token_ids` from the ingress, or a token prompt) are counted exactly; text is
    estimated from its length.
    Anything else (e.g. a `model_info()` call's empty arguments) is 0.
    """
    token_ids = getattr(request, "prompt_token_ids", None)
    if token_ids is not None:  # tokenized by the ingress
        return len(token_ids)
    prompt = getattr(request, "prompt", None)
    messages = getattr(request, "messages", None)
    if isinstance(prompt, list | tuple):
        return len(prompt)
    if isinstance(prompt, str):
        return math.ceil(len(prompt) / chars_per_token)
    if messages:
        chars = 0
        for message in messages:
            content = message.get("content") if isinstance(message, Mapping) else None
            if isinstance(content, str):
                chars += len(content)
            elif isinstance(content, list):  # OpenAI content parts
                chars += sum(len(p.get("text", "")) for p in content if isinstance(p, Mapping))
        return math.ceil(chars / chars_per_token) + CHAT_TOKENS_PER_MESSAGE * len(messages) + CHAT_TOKENS_FIXED
    return 0


def estimate_request_blocks(request: Any, settings: KVRouterSettings) -> int:
    """KV blocks the request will hold at its end (estimate; 0 for anything that is not a generation)."""
    prompt_tokens = estimate_prompt_tokens(request, settings.chars_per_token)
    if prompt_tokens == 0:
        return 0
    params = getattr(request, "sampling_params", None)
    max_tokens = getattr(params, "max_tokens", 0)
    if max_tokens is None:  # until the end of the context (chat without max_tokens)
        max_tokens = settings.max_expected_output_tokens
    output_tokens = min(int(max_tokens or 0), settings.max_expected_output_tokens)
    tokens = settings.prompt_weight * prompt_tokens + settings.output_weight * output_tokens
    return max(1, math.ceil(tokens / settings.block_size))


def find_request(args: Sequence[Any], kwargs: Mapping[str, Any]) -> Any:
    """The generation request among a handle call's arguments (`LLMServer.generate(request)`)."""
    for value in (*args, *kwargs.values()):
        if hasattr(value, "sampling_params") and (hasattr(value, "prompt") or hasattr(value, "messages")):
            return value
    return None


# ---- replica samples ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class ReplicaSample:
    """One replica's published routing stats (`LLMServer.record_routing_stats`)."""

    kv_cache_usage: float
    num_free_blocks: int
    num_total_blocks: int
    num_waiting: int
    num_running: int
    sampled_at: float | None  # replica wall clock (time.time()) when taken; None if not published
    num_pending_prompt_tokens: int = 0  # prompt tokens not yet computed (0 if not published)
    # the replica's step-cost fit (serve_app.engine.step_cost); 0 when not published yet
    step_fixed_s: float = 0.0
    prefill_s_per_token: float = 0.0
    decode_s_per_token: float = 0.0

    @property
    def num_used_blocks(self) -> int:
        return self.num_total_blocks - self.num_free_blocks

    def unread_prompt_tokens(self, age_s: float, step_token_budget: int) -> int:
        """`num_pending_prompt_tokens` less what the replica has read in the `age_s` seconds since
        the sample, at its fitted cost per prompt token (that token's share of a full step's fixed
        and decode cost included); all of them when it has no fit yet."""
        if self.prefill_s_per_token <= 0 or age_s <= 0:
            return self.num_pending_prompt_tokens
        per_step = self.step_fixed_s + self.num_running * self.decode_s_per_token
        s_per_token = self.prefill_s_per_token + per_step / max(step_token_budget, 1)
        return max(0, self.num_pending_prompt_tokens - int(age_s / s_per_token))

    @classmethod
    def parse(cls, stats: Mapping[str, Any] | None) -> ReplicaSample | None:
        """None when the dict is empty (no sample yet) or lacks the occupancy fields."""
        if not stats:
            return None
        try:
            total = int(stats["num_total_blocks"])
            usage = float(stats["kv_cache_usage"])
            free = int(stats.get("num_free_blocks", round(total * (1.0 - usage))))
            sampled_at = stats.get("sampled_at")
            return cls(usage, free, total, int(stats.get("num_waiting", 0)), int(stats.get("num_running", 0)),
                       None if sampled_at is None else float(sampled_at), int(stats.get("num_pending_prompt_tokens", 0)),
                       float(stats.get("step_fixed_s", 0.0)), float(stats.get("prefill_s_per_token", 0.0)),
                       float(stats.get("decode_s_per_token", 0.0)))
        except (KeyError, TypeError, ValueError):
            return None


# ---- in-flight ledger --------------------------------------------------------------------------------
@dataclass
class LedgerEntry:
    request_id: str
    replica_id: str
    blocks: int
    routed_at: float  # router wall clock
    prompt_tokens: int = 0
    confirmed: bool = False  # Serve reported it routed (accepted by the replica)
    pending: Any = None  # the PendingRequest of an unconfirmed choice (to notice cancellation)
    # when its prompt is predicted to have been read (routed_at + predicted TTFT, for routers that
    # predict it): from then on its prompt tokens no longer count as queued there
    prefill_done_at: float = math.inf


@dataclass
class InFlightLedger:
    """Requests this router sent (or is about to send) to each replica, until they complete.

    A choice is reserved when the router makes it (so concurrent routing decisions see it), confirmed
    when Serve reports the request routed, moved if Serve sent it elsewhere (the chosen replica was
    full), and dropped when the request completes, fails, is rejected or its routing is cancelled.
    """

    entries: dict[str, LedgerEntry] = field(default_factory=dict)
    by_replica: dict[str, dict[str, LedgerEntry]] = field(default_factory=dict)

    def _place(self, entry: LedgerEntry) -> None:
        self.entries[entry.request_id] = entry
        self.by_replica.setdefault(entry.replica_id, {})[entry.request_id] = entry

    def _unplace(self, entry: LedgerEntry) -> None:
        self.entries.pop(entry.request_id, None)
        on_replica = self.by_replica.get(entry.replica_id)
        if on_replica is not None:
            on_replica.pop(entry.request_id, None)

    def reserve(self, request_id: str, replica_id: str, blocks: int, now: float, pending: Any = None,
                prompt_tokens: int = 0, prefill_done_at: float = math.inf) -> None:
        old = self.entries.get(request_id)
        if old is not None:
            if old.confirmed:  # already routed: a duplicate choice changes nothing
                return
            self._unplace(old)
        self._place(LedgerEntry(request_id, replica_id, blocks, now, prompt_tokens, pending=pending,
                                prefill_done_at=prefill_done_at))

    def confirm(self, request_id: str, replica_id: str, blocks: int, now: float, prompt_tokens: int = 0) -> LedgerEntry:
        entry = self.entries.get(request_id)
        if entry is not None and entry.replica_id != replica_id:
            self._unplace(entry)
            entry = LedgerEntry(request_id, replica_id, entry.blocks, now, entry.prompt_tokens,
                                prefill_done_at=now + (entry.prefill_done_at - entry.routed_at))
            self._place(entry)
        elif entry is None:
            entry = LedgerEntry(request_id, replica_id, blocks, now, prompt_tokens)
            self._place(entry)
        entry.confirmed = True
        entry.pending = None
        return entry

    def complete(self, request_id: str, replica_id: str) -> bool:
        """Drop the request if it is on `replica_id` (a late callback for an earlier attempt on another
        replica leaves the current attempt alone)."""
        entry = self.entries.get(request_id)
        if entry is None or entry.replica_id != replica_id:
            return False
        self._unplace(entry)
        return True

    def expire(self, now: float, ttl_s: float, confirmed_ttl_s: float = math.inf) -> int:
        """Drop unconfirmed choices whose routing was cancelled or that Serve never followed up, and
        confirmed requests older than `confirmed_ttl_s` (their completion callback was lost: no
        request outlives the request timeout)."""
        def is_stale(e: LedgerEntry) -> bool:
            if e.confirmed:
                return now - e.routed_at > confirmed_ttl_s
            return now - e.routed_at > ttl_s or _cancelled(e.pending)

        stale = [e for e in self.entries.values() if is_stale(e)]
        for e in stale:
            self._unplace(e)
        return len(stale)

    def remove_replica(self, replica_id: str) -> None:
        for entry in list(self.by_replica.pop(replica_id, {}).values()):
            self.entries.pop(entry.request_id, None)

    def num_in_flight(self, replica_id: str) -> int:
        return len(self.by_replica.get(replica_id, ()))

    def newest_before(self, replica_id: str, t: float, n: int) -> tuple[int, int]:
        """(blocks, requests) of the newest `n` requests routed to the replica at or before time `t`."""
        if n <= 0:
            return 0, 0
        older = sorted((e for e in self.by_replica.get(replica_id, {}).values() if e.routed_at <= t),
                       key=lambda e: e.routed_at, reverse=True)[:n]
        return sum(e.blocks for e in older), len(older)

    def since(self, replica_id: str, t: float | None, now: float | None = None) -> tuple[int, int, int]:
        """(blocks, requests, prompt tokens) routed to the replica after time `t` (None: all in flight);
        with `now`, prompt tokens only of the requests whose prompt is not yet predicted read."""
        blocks = count = prompt_tokens = 0
        for entry in self.by_replica.get(replica_id, {}).values():
            if t is None or entry.routed_at > t:
                blocks += entry.blocks
                count += 1
                if now is None or now < entry.prefill_done_at:
                    prompt_tokens += entry.prompt_tokens
        return blocks, count, prompt_tokens


def _cancelled(pending: Any) -> bool:
    future = getattr(pending, "future", None)
    return future is not None and future.cancelled()


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
