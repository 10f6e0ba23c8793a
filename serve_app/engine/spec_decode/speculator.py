"""The scheduler's view of speculative decoding: proposals for a step's decoding requests, sized by
the policy (fixed or adaptive k), and the acceptance bookkeeping that feeds the policy."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from serve_app.config import SpeculativeConfig
from serve_app.engine.spec_decode.policy import AcceptanceTracker, choose_k
from serve_app.engine.spec_decode.proposer import NgramProposer, Proposer
from serve_app.engine.step_cost import StepCostFit


@dataclass(frozen=True)
class SpecCandidate:
    """A decoding request that may be verified with up to `max_k` proposed tokens this step."""

    request_id: str
    token_ids: Sequence[int]  # prompt + output so far
    max_k: int


def make_proposer(config: SpeculativeConfig) -> Proposer:
    if config.method == "ngram":
        return NgramProposer(config.ngram_min, config.ngram_max)
    raise ValueError(f"speculative.method: no proposer for {config.method!r}")


class Speculator:
    def __init__(self, config: SpeculativeConfig, step_cost: StepCostFit, proposer: Proposer | None = None) -> None:
        self.config = config
        self.step_cost = step_cost
        self.proposer = proposer or make_proposer(config)
        self.acceptance = AcceptanceTracker()

    def plan(
        self,
        candidates: Sequence[SpecCandidate],
        num_prefill_tokens: int,
        num_decode_tokens: int,
        num_sampling: int,
        budget: int,
    ) -> dict[str, tuple[int, ...]]:
        """Proposed tokens per request id (requests without a proposal are left out)."""
        proposals = []
        for c in candidates:
            tokens = self.proposer.propose(c.token_ids, min(c.max_k, self.config.max_k)) if c.max_k > 0 else []
            if tokens:
                proposals.append((c.request_id, tokens))
        if not proposals:
            return {}
        if self.config.k:
            ks = [min(self.config.k, len(tokens)) for _, tokens in proposals]
        else:
            ks = choose_k([self.acceptance.rate(rid) for rid, _ in proposals], [len(t) for _, t in proposals],
                          self.step_cost.cost(), num_prefill_tokens, num_decode_tokens, num_sampling, budget)
        plan = {}
        for (rid, tokens), k in zip(proposals, ks, strict=True):
            k = min(k, budget)
            if k > 0:
                plan[rid] = tuple(tokens[:k])
                budget -= k
        return plan

    def observe(self, request_id: str, num_proposed: int, num_accepted: int) -> None:
        self.acceptance.observe(request_id, num_proposed, num_accepted)

    def forget(self, request_id: str) -> None:
        self.acceptance.forget(request_id)
