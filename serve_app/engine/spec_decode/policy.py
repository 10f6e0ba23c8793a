"""How many proposed tokens to verify per request in a step: fixed, or adaptive from measured costs.

Adaptive k maximises the step's expected output tokens per second. A request whose proposals are
accepted with probability p (per position, measured) gains p^j expected tokens from its j-th
proposed token, and every proposed token costs the fitted per-token step time. Starting from the
step as scheduled (T seconds for E tokens, one per sampling request), the policy adds proposed tokens
greedily, highest gain first, while a token's gain per second beats the step's current rate
(gain / per_token_s > E / T): cheap at low batch, where the fixed cost dominates T, and never at
full batch, where per-token time dominates and a rejected token is pure waste.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass

from serve_app.engine.step_cost import StepCost

MAX_ACCEPTANCE = 0.98  # a request that matched every time may still miss next time


@dataclass
class AcceptanceTracker:
    """Per-request acceptance probability per proposed position, from decayed counts, shrunk toward
    the proposer's running rate for requests with little history.

    Estimates go stale: a request the policy stopped verifying would otherwise keep its last (low)
    estimate for good, and so would the running rate new requests start from. So every step
    (`tick`) without an observation shrinks a request's counts by `stale_decay` and pulls the
    running rate back toward `prior`: a request re-tries after a while (where a proposal would pay
    at the prior rate: at low batch, where a wasted one is cheap), and the estimate follows text
    whose predictability changes.
    """

    decay: float = 0.9
    prior_weight: float = 2.0
    prior: float = 0.5
    stale_decay: float = 0.97  # per step without an observation: after ~23 steps, half the weight

    def __post_init__(self) -> None:
        self.global_rate = self.prior
        self._step = 0
        self._global_step = 0
        self._counts: dict[str, tuple[float, float, int]] = {}  # request id -> (accepted, evaluated positions, step)

    def tick(self) -> None:
        """One engine step passed."""
        self._step += 1

    def _running_rate(self) -> float:
        stale = self.stale_decay ** (self._step - self._global_step)
        return self.prior + (self.global_rate - self.prior) * stale

    def rate(self, request_id: str) -> float:
        accepted, evaluated, step = self._counts.get(request_id, (0.0, 0.0, self._step))
        stale = self.stale_decay ** (self._step - step)
        p = (accepted * stale + self.prior_weight * self._running_rate()) / (evaluated * stale + self.prior_weight)
        return min(p, MAX_ACCEPTANCE)

    def observe(self, request_id: str, num_proposed: int, num_accepted: int) -> None:
        """A verification: positions are evaluated up to the first rejection."""
        if num_proposed <= 0:
            return
        evaluated = num_accepted + (1 if num_accepted < num_proposed else 0)
        accepted, seen, step = self._counts.get(request_id, (0.0, 0.0, self._step))
        stale = self.stale_decay ** (self._step - step)
        self._counts[request_id] = (accepted * stale * self.decay + num_accepted, seen * stale * self.decay + evaluated, self._step)
        self.global_rate = 0.95 * self._running_rate() + 0.05 * num_accepted / evaluated
        self._global_step = self._step

    def forget(self, request_id: str) -> None:
        self._counts.pop(request_id, None)


def choose_k(
    acceptance: Sequence[float],
    max_k: Sequence[int],
    cost: StepCost | None,
    num_prefill_tokens: int,
    num_decode_tokens: int,
    num_sampling: int,
    budget: int,
) -> list[int]:
    """Proposed tokens per candidate request (aligned with `acceptance` / `max_k`).

    `num_*_tokens` and `num_sampling` describe the step as scheduled without speculation; `budget` is
    the step's remaining token budget. Without a cost fit yet (the engine's first steps), or with one
    that could not tell a step's fixed cost from its per-token cost (`StepCost.determined` False: e.g. a
    lone request decoding one token per step, every step the same size), every candidate gets its
    `max_k` within the budget: proposals vary the steps' sizes, which is what the fit needs to
    measure whether they pay (without them a policy that once chose 0 would never learn otherwise).
    A cost with no per-token part at all (never from a fit) proposes nothing.
    """
    ks = [0] * len(acceptance)
    if cost is None or not cost.determined:
        for i, m in enumerate(max_k):
            ks[i] = max(0, min(m, budget))
            budget -= ks[i]
        return ks
    if cost.per_decode_token_s <= 0:
        return ks
    per_token = cost.per_decode_token_s
    step_s = cost.predict(num_prefill_tokens, num_decode_tokens)
    tokens = float(num_sampling)
    heap = [(-p, i) for i, (p, m) in enumerate(zip(acceptance, max_k, strict=True)) if m > 0 and p > 0]
    heapq.heapify(heap)
    while heap and budget > 0:
        neg_gain, i = heapq.heappop(heap)
        gain = -neg_gain
        if gain * step_s <= per_token * tokens:  # gains only shrink from here: done
            break
        ks[i] += 1
        budget -= 1
        tokens += gain
        step_s += per_token
        if ks[i] < max_k[i]:
            heapq.heappush(heap, (-gain * acceptance[i], i))
    return ks
