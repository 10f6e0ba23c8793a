"""The scheduler's view of speculative decoding: proposals for a step's decoding requests, sized by
the policy (fixed or adaptive k), and the acceptance bookkeeping that feeds the policy."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from serve_app.engine.spec_decode.config import SpeculativeConfig
from serve_app.engine.spec_decode.policy import AcceptanceTracker, choose_k
from serve_app.engine.spec_decode.proposer import NgramProposer, Proposal, Proposer, SpecCandidate
from serve_app.engine.step_cost import StepCostFit


class Speculator:
    """`proposer` defaults to the n-gram proposer; a draft-model proposer is built by the engine
    (`spec_decode.draft.DraftProposer`), which owns the model runner it needs."""

    def __init__(self, config: SpeculativeConfig, step_cost: StepCostFit, proposer: Proposer | None = None) -> None:
        self.config = config
        self.step_cost = step_cost
        self.proposer = proposer or NgramProposer(config.ngram_min, config.ngram_max)
        self.acceptance = AcceptanceTracker()

    def plan(
        self,
        candidates: Sequence[SpecCandidate],
        num_prefill_tokens: int,
        num_decode_tokens: int,
        num_sampling: int,
        budget: int,
    ) -> dict[str, Proposal]:
        """Proposals per request id (requests without one are left out)."""
        self.acceptance.tick()
        limit = self.config.k or self.config.max_k
        candidates = [c for c in candidates if c.max_k > 0]
        if not candidates:
            return {}
        candidates = [c if c.max_k <= limit else dataclasses.replace(c, max_k=limit) for c in candidates]
        adaptive = not self.config.k
        if adaptive and self.proposer.full_length:  # choose k first: proposing costs a model pass per token
            ks = self._choose_k([(c.request_id, c.max_k) for c in candidates], num_prefill_tokens, num_decode_tokens,
                                num_sampling, budget)
            candidates = [dataclasses.replace(c, max_k=k) for c, k in zip(candidates, ks, strict=True) if k > 0]
            adaptive = False
        by_id = self.proposer.propose(candidates) if candidates else {}
        proposals = [(c.request_id, by_id[c.request_id]) for c in candidates if c.request_id in by_id]
        if not proposals:
            return {}
        if adaptive:  # from the proposals' lengths: a short n-gram match leaves room to others
            ks = self._choose_k([(rid, len(p.token_ids)) for rid, p in proposals], num_prefill_tokens, num_decode_tokens,
                                num_sampling, budget)
        else:
            ks = [len(p.token_ids) for _, p in proposals]
        plan = {}
        for (rid, proposal), k in zip(proposals, ks, strict=True):
            k = min(k, budget)
            if k > 0:
                plan[rid] = proposal.truncated(k)
                budget -= k
        return plan

    def _choose_k(self, lengths: list[tuple[str, int]], num_prefill_tokens: int, num_decode_tokens: int, num_sampling: int,
                  budget: int) -> list[int]:
        return choose_k([self.acceptance.rate(rid) for rid, _ in lengths], [n for _, n in lengths], self.step_cost.cost(),
                        num_prefill_tokens, num_decode_tokens, num_sampling, budget)

    def observe(self, request_id: str, num_proposed: int, num_accepted: int) -> None:
        self.acceptance.observe(request_id, num_proposed, num_accepted)

    def forget(self, request_id: str) -> None:
        self.acceptance.forget(request_id)
        self.proposer.forget(request_id)
