"""What one replica last published for routing (`LLMServer.record_routing_stats`), as the routers read it."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


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
