"""The adaptive speculation length, the acceptance tracker, the n-gram proposer and the acceptance rule."""

from __future__ import annotations

import pytest

from serve_app.engine.config import EngineConfig
from serve_app.engine.spec_decode.acceptance import accept
from serve_app.engine.spec_decode.config import SpeculativeConfig
from serve_app.engine.spec_decode.policy import AcceptanceTracker, choose_k
from serve_app.engine.spec_decode.proposer import NgramProposer, Proposal, SpecCandidate
from serve_app.engine.spec_decode.speculator import Speculator
from serve_app.engine.step_cost import StepCost, StepCostFit

# a step on 2 CPU cores: 20 ms fixed (Python and ops over 30 layers), 1.5 ms per decode token
CPU_COST = StepCost(fixed_s=0.020, per_prefill_token_s=0.0004, per_decode_token_s=0.0015, num_steps=100)


def test_batch_of_one_with_high_acceptance_speculates_to_max_k():
    assert choose_k([0.8], [4], CPU_COST, 0, 1, 1, budget=2048) == [4]


def test_full_batch_turns_speculation_off():
    ks = choose_k([0.8] * 64, [4] * 64, CPU_COST, 0, 64, 64, budget=2048)
    assert ks == [0] * 64
    # where tokens are nearly free next to the fixed cost (a GPU's memory-bound decode), it pays again
    gpu = StepCost(fixed_s=0.010, per_prefill_token_s=0.0, per_decode_token_s=0.00002, num_steps=100)
    assert min(choose_k([0.8] * 64, [4] * 64, gpu, 0, 64, 64, budget=2048)) > 0


def test_k_falls_as_batch_grows_and_with_acceptance():
    totals = [sum(choose_k([0.8] * n, [4] * n, CPU_COST, 0, n, n, budget=2048)) / n for n in (1, 4, 16, 64)]
    assert totals == sorted(totals, reverse=True) and totals[0] > totals[-1]
    low, high = choose_k([0.1, 0.9], [4, 4], CPU_COST, 0, 16, 16, budget=2048)
    assert high > low


def test_budget_and_missing_fit():
    assert sum(choose_k([0.9] * 3, [4] * 3, CPU_COST, 0, 3, 3, budget=5)) == 5
    assert choose_k([0.2, 0.9], [3, 2], None, 0, 2, 2, budget=100) == [3, 2]  # no fit yet: max_k
    free_tokens = StepCost(fixed_s=0.02, per_prefill_token_s=0.0, per_decode_token_s=0.0, num_steps=50)
    assert choose_k([0.9], [4], free_tokens, 0, 1, 1, budget=100) == [0]  # a degenerate fit: no evidence, no guess


class CountingDraft:
    """A full-length proposer (like a draft model): records what it was asked to propose."""

    full_length = True

    def __init__(self):
        self.asked = []

    def propose(self, candidates):
        self.asked.append([(c.request_id, c.max_k) for c in candidates])
        return {c.request_id: Proposal((1,) * c.max_k) for c in candidates}

    def forget(self, request_id):
        pass


def fitted(cost: StepCost) -> StepCostFit:
    fit = StepCostFit()
    for n in (1, 8, 32, 64, 1, 16) * 4:  # steps that cost exactly what `cost` says
        fit.observe(0, n, cost.fixed_s + n * cost.per_decode_token_s)
    return fit


def test_with_a_draft_model_adaptive_k_is_chosen_before_proposing():
    """A draft pass per proposed token is not free: at full batch the draft is not even asked."""
    draft = CountingDraft()
    speculator = Speculator(SpeculativeConfig(method="draft", draft_model="d", max_k=4), fitted(CPU_COST), draft)
    candidates = [SpecCandidate(f"r{i}", [1, 2, 3], 4) for i in range(64)]
    assert speculator.plan(candidates, 0, 64, 64, budget=2048) == {} and draft.asked == []
    plan = speculator.plan(candidates[:1], 0, 1, 1, budget=2048)  # alone: asked for the k the policy chose, no more
    ((rid, k),) = draft.asked[0]
    assert rid == "r0" and 0 < k <= 4 and plan["r0"].token_ids == (1,) * k


def test_a_stale_low_estimate_recovers_so_the_policy_tries_again():
    """A request whose proposals kept failing stops being verified at batch 1; without new
    observations its estimate (and the rate new requests start from) drifts back to the prior, so
    after a while it is tried again; at full batch the prior still proposes nothing."""
    tracker = AcceptanceTracker()
    for _ in range(30):
        tracker.tick()
        tracker.observe("chat", 4, 0)
    low = tracker.rate("chat")
    assert choose_k([low], [4], CPU_COST, 0, 1, 1, budget=2048) == [0]
    assert tracker.rate("new") < 0.25  # the running rate fell too
    for _ in range(60):  # steps in which nothing was verified
        tracker.tick()
    assert tracker.rate("chat") > 3 * low and tracker.rate("new") > 0.4
    assert choose_k([tracker.rate("chat")], [4], CPU_COST, 0, 1, 1, budget=2048)[0] > 0
    assert choose_k([tracker.rate("chat")] * 64, [4] * 64, CPU_COST, 0, 64, 64, budget=2048) == [0] * 64


def test_a_lone_request_that_stopped_speculating_explores_again():
    """One request decoding one token per step: every step is the same size, so the fit cannot tell
    the fixed cost from the per-token cost. The policy then proposes (which varies the step sizes)
    instead of taking 'proportional' per-token costs as a measurement and never proposing again."""
    fit = StepCostFit(window=64)
    for _ in range(64):
        fit.observe(0, 1, CPU_COST.predict(0, 1))
    assert not fit.cost().determined
    assert choose_k([0.5], [4], fit.cost(), 0, 1, 1, budget=2048) == [4]
    for k in (4, 2, 0, 3) * 4:  # steps with proposals: now it measures that the fixed cost dominates
        fit.observe(0, 1 + k, CPU_COST.predict(0, 1 + k))
    cost = fit.cost()
    assert cost.determined and cost.fixed_s == pytest.approx(CPU_COST.fixed_s)
    assert choose_k([0.5], [4], cost, 0, 1, 1, budget=2048)[0] > 0
    assert choose_k([0.5] * 64, [4] * 64, cost, 0, 64, 64, budget=2048) == [0] * 64


def test_acceptance_tracker_learns_per_request():
    tracker = AcceptanceTracker()
    for _ in range(20):
        tracker.observe("copy", 4, 4)
        tracker.observe("chat", 4, 0)
    assert tracker.rate("copy") > 0.9 and tracker.rate("chat") < 0.15
    tracker.forget("copy")
    assert tracker.rate("copy") == pytest.approx(min(tracker.global_rate, 0.98))


def test_ngram_proposer_prefers_longest_then_latest_match():
    tokens = [1, 2, 3, 4, 9, 2, 3, 5, 6, 1, 2, 3]
    assert NgramProposer(min_n=2, max_n=3).lookup(tokens, 2) == [4, 9]  # [1, 2, 3] matched at the start
    assert NgramProposer(min_n=2, max_n=2).lookup(tokens, 3) == [5, 6, 1]  # the latest [2, 3]
    assert NgramProposer(min_n=2, max_n=3).lookup([1, 2, 3], 4) == []
    assert NgramProposer().lookup(tokens, 0) == []


def test_accept_keeps_samples_up_to_first_mismatch():
    assert accept([5, 6, 7], [5, 6]) == (5, 6, 7)
    assert accept([5, 9, 7], [5, 6]) == (5, 9)
    assert accept([4, 6, 7], [5, 6]) == (4,)
    with pytest.raises(ValueError):
        accept([1], [1])


@pytest.mark.parametrize("value, field", [
    ({"method": "medusa"}, "speculative.method"),
    ({"method": "ngram", "max_k": 0}, "speculative.max_k"),
    ({"method": "ngram", "k": 5}, "speculative.k"),
    ({"method": "ngram", "ngram_min": 3, "ngram_max": 2}, "speculative.ngram_min"),
    ({"num_speculative_tokens": 4}, "speculative.num_speculative_tokens"),
    ("ngram", "speculative"),
    ({"method": "draft"}, "speculative.draft_model"),
    ({"method": "ngram", "draft_model": "models/d"}, "speculative.draft_model"),
    ({"method": "ngram", "acceptance": "rejection"}, "speculative.acceptance"),
    ({"method": "draft", "draft_model": "models/d", "acceptance": "typical"}, "speculative.acceptance"),
    ({"method": "draft", "draft_model": "models/d", "draft_kv_cache_memory_gib": 0}, "speculative.draft_kv_cache_memory_gib"),
])
def test_bad_options_name_the_field(value, field):
    with pytest.raises(ValueError, match=f"^{field}:"):
        EngineConfig.from_kwargs("m", speculative=value)


def test_options_default_off_and_mapping_defaults_to_ngram():
    assert not EngineConfig.from_kwargs("m").speculative.enabled
    assert EngineConfig.from_kwargs("m", speculative={"max_k": 6}).speculative == SpeculativeConfig(method="ngram", max_k=6)
