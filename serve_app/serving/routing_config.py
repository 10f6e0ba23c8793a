"""The routing layer's configuration: which Serve request router places LLMServer requests, with
which settings, validated once where the serving config is loaded.

`RoutingConfig.build` turns the serving config's `router`, `request_router_class`, `router_kwargs`
and `request_routing_stats_period_s` into one object; for our own routers (`prefix_aware`,
`kv_aware`) it completes the settings with what the deployment knows (model name, the engine's KV
block size and step token budget, the stats period, the request timeout) and validates them. Serve
hands a router its `request_router_kwargs` as JSON, so those settings travel as their fields
(`RoutingConfig.request_router_kwargs`) and the router rebuilds the same object from them. No Ray
import here.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any

from serve_app.validation import require

# The routers `router` selects (import paths, so this module needs no Ray import).
ROUTER_CLASSES: dict[str, str] = {
    "prefix_aware": "serve_app.serving.prefix_router:PrefixAwareRouter",
    "kv_aware": "serve_app.serving.router:KVCacheAwareRouter",
    "round_robin": "serve_app.serving.router:RoundRobinRouter",
    "pow2": "ray.serve._private.request_router:PowerOfTwoChoicesRequestRouter",  # Serve's default
}


@dataclass(frozen=True)
class KVRouterSettings:
    """The settings of our KV-cache-aware and prefix-aware routers (`router_kwargs`, completed by
    `RoutingConfig.build`); unknown names or bad values raise ValueError."""

    model_name: str = ""  # the `model` label of the router metrics
    block_size: int = 16  # tokens per KV block (the engine's `block_size`)
    prompt_weight: float = 1.0  # weight of prompt tokens in a request's block estimate
    output_weight: float = 1.0  # expected fraction of max_tokens that a request generates
    max_expected_output_tokens: int = 1024  # caps max_tokens (chat defaults it to the whole context)
    chars_per_token: float = 4.0  # text prompts are not tokenized by the router
    waiting_weight: float = 1.0  # weight of a replica's waiting queue (× mean request blocks); 0: tie-break only
    prefill_weight: float = 1.0  # weight of a replica's unread prompt tokens (÷ its cache's tokens); 0: KV only
    tie_tolerance: float = 0.02  # occupancies within this of the best are ties
    max_stats_age_s: float = 0.0  # older samples are stale; 0: max(2 s, 10 × stats_period_s)
    stats_period_s: float = 0.5  # the deployment's request_routing_stats_period_s
    sample_lag_s: float = 1.0  # a request routed this long before a sample may still be missing from it
    reservation_ttl_s: float = 60.0  # drop a choice Serve never confirmed (routed / completed) after this
    # drop a confirmed request whose completion was never reported after this (a lost callback must
    # not make a replica look full forever); the app sets it from request_timeout_s
    confirmed_ttl_s: float = 900.0
    # prefix-aware router (prefix_policy): predicted time to first token, in seconds
    step_token_budget: int = 512  # tokens per engine step (the engine's max_num_batched_tokens)
    default_prefill_s_per_token: float = 0.001  # until a replica publishes its own step-cost fit
    default_decode_s_per_token: float = 0.001
    default_step_fixed_s: float = 0.02
    max_occupancy: float = 1.0  # a projection above this forces preemption: only if no replica has room
    ttft_tie_tolerance_s: float = 0.01  # predicted TTFTs within ratio × best + this are ties (user, cached, affinity)
    ttft_tie_ratio: float = 0.1
    cold_tie_ratio: float = 0.5  # the same for a request no replica is known to hold any of (prefix_policy)
    # seconds of prefill a replica would spend recomputing prefix blocks another replica holds count
    # this many times against it (the work is taken from the requests queued behind it, and the copy
    # evicts other prefixes there): 0 ranks by this request's predicted TTFT alone
    recompute_weight: float = 2.0
    affinity_blocks: int = 4  # ties go by a rendezvous hash of the prompt's first this many blocks
    metrics: str = "ray"  # "ray" (ray.serve.metrics), "prometheus" (own registry, for tests) or "none"
    seed: int | None = None  # random tie-break among equal replicas

    def __post_init__(self) -> None:
        require(isinstance(self.block_size, int) and self.block_size >= 1, "block_size", "must be an integer >= 1")
        for name in ("prompt_weight", "output_weight", "waiting_weight", "prefill_weight", "tie_tolerance", "sample_lag_s",
                     "max_stats_age_s", "default_prefill_s_per_token", "default_decode_s_per_token", "default_step_fixed_s",
                     "ttft_tie_tolerance_s", "ttft_tie_ratio", "cold_tie_ratio", "recompute_weight"):
            value = getattr(self, name)
            require(isinstance(value, int | float) and value >= 0 and math.isfinite(value), name, "must be a finite number >= 0")
        require(isinstance(self.max_expected_output_tokens, int) and self.max_expected_output_tokens >= 0,
                 "max_expected_output_tokens", "must be an integer >= 0")
        for name in ("step_token_budget", "affinity_blocks"):
            require(isinstance(getattr(self, name), int) and getattr(self, name) >= 1, name, "must be an integer >= 1")
        for name in ("chars_per_token", "stats_period_s", "reservation_ttl_s", "confirmed_ttl_s", "max_occupancy"):
            value = getattr(self, name)
            require(isinstance(value, int | float) and value > 0, name, "must be > 0")
        require(self.metrics in ("ray", "prometheus", "none"), "metrics", "must be 'ray', 'prometheus' or 'none'")
        if self.max_stats_age_s == 0:
            # lenient: on a busy machine the controller's poll and broadcast lag by a second or more,
            # and a needless fallback to least-in-flight ignores load this router did not send
            object.__setattr__(self, "max_stats_age_s", max(2.0, 10 * self.stats_period_s))

    @classmethod
    def from_kwargs(cls, kwargs: Mapping[str, Any] | None = None) -> KVRouterSettings:
        kwargs = dict(kwargs or {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ValueError(f"{unknown[0]}: not a KVCacheAwareRouter option (known: {', '.join(sorted(known))})")
        return cls(**kwargs)


SETTINGS_ROUTERS = ("prefix_aware", "kv_aware")  # the routers that take `KVRouterSettings`


def _router_name(router_class: str) -> str | None:
    """Which of `ROUTER_CLASSES` an import path ("module:Class" or "module.Class") names, if any."""
    dotted = router_class.replace(":", ".")
    return next((name for name, path in ROUTER_CLASSES.items() if path.replace(":", ".") == dotted), None)


@dataclass(frozen=True)
class RoutingConfig:
    """How LLMServer requests are placed: `router_class`, the Serve `RequestRouter`'s import path;
    `settings`, our routers' complete settings (None for any other router); `model_name`, the
    metrics label of the round-robin router (else ""); `stats_period_s`, how often replicas publish
    routing stats."""

    router_class: str
    stats_period_s: float
    settings: KVRouterSettings | None = None
    model_name: str = ""

    @classmethod
    def build(cls, router: str, request_router_class: str, router_kwargs: Mapping[str, Any], stats_period_s: float, *,
              model_name: str, block_size: int, step_token_budget: int | None, request_timeout_s: float) -> RoutingConfig:
        """`request_router_class` (an import path) overrides `router` (a `ROUTER_CLASSES` name);
        `router_kwargs` (`KVRouterSettings` names) apply to our routers only, and override what the
        deployment fills in."""
        require(router in ROUTER_CLASSES, "router", f"must be one of {tuple(ROUTER_CLASSES)}, got {router!r}")
        if request_router_class:
            require("." in request_router_class or ":" in request_router_class, "request_router_class", "expected an import path")
        if router_kwargs:
            require(router in SETTINGS_ROUTERS and not request_router_class, "router_kwargs",
                    "only the prefix_aware and kv_aware routers take options")
        router_class = request_router_class or ROUTER_CLASSES[router]
        chosen = _router_name(router_class)
        if chosen in SETTINGS_ROUTERS:
            known = {"model_name": model_name, "block_size": block_size, "stats_period_s": stats_period_s,
                     # no request outlives its timeout: a ledger entry older than that lost its completion
                     "confirmed_ttl_s": request_timeout_s + 60.0}
            if chosen == "prefix_aware" and step_token_budget is not None:
                known["step_token_budget"] = step_token_budget
            return cls(router_class, stats_period_s, KVRouterSettings.from_kwargs({**known, **router_kwargs}))
        return cls(router_class, stats_period_s, model_name=model_name if chosen == "round_robin" else "")

    @property
    def request_router_kwargs(self) -> dict[str, Any]:
        """What Serve passes to the router's `initialize_state` (JSON-serializable, as Serve requires)."""
        if self.settings is not None:
            return asdict(self.settings)
        return {"model_name": self.model_name} if self.model_name else {}
