"""A step's sampling hand-off (step_sampler) on plain logits: which rows sample, dropping requests'
rows, verification of proposed tokens, logprobs, and a request whose sampling fails failing alone."""

from __future__ import annotations

import math

import torch

from serve_app.engine.outputs import ScheduledRequest
from serve_app.engine.step_sampler import SamplingContext, drop_requests, sample_step, sampled_rows, take_rows
from serve_app.faults import Stage
from serve_app.types import GenerateRequest, SamplingParams

VOCAB = 8
GREEDY = SamplingParams(temperature=0.0)


def sched(rid: str, num_tokens: int, sample: bool = True, spec: tuple[int, ...] = (), params: SamplingParams = GREEDY) -> ScheduledRequest:
    return ScheduledRequest(rid, tuple(range(num_tokens)), 0, (0,), sample, not spec, params, None, spec_token_ids=spec)


def peaked(*tokens: int) -> torch.Tensor:
    """One logits row per token, each peaked at it."""
    rows = torch.zeros(len(tokens), VOCAB)
    rows[range(len(tokens)), list(tokens)] = 5.0
    return rows


def ctx(fault_hook=None) -> SamplingContext:
    return SamplingContext(torch.Generator().manual_seed(0), fault_hook=fault_hook)


def test_sampled_rows_are_each_samplers_last_token_and_its_proposals():
    scheduled = [sched("decode", 1), sched("verify", 4, spec=(5, 6, 7)), sched("chunk", 6, sample=False), sched("prompt", 3)]
    samplers, rows = sampled_rows(scheduled)
    assert [s.request_id for s in samplers] == ["decode", "verify", "prompt"]
    assert rows == [0, 1, 2, 3, 4, 13]


def test_take_rows_skips_the_index_when_every_row_is_taken():
    x = torch.arange(12.0).view(4, 3)
    assert take_rows(x, [0, 1, 2, 3]) is x
    assert take_rows(x, [1, 3]).tolist() == [[3, 4, 5], [9, 10, 11]]


def test_dropped_requests_lose_their_rows_and_the_others_keep_theirs_in_order():
    samplers = [sched("a", 1), sched("b", 3, spec=(1, 2)), sched("c", 1)]
    logits = torch.arange(5.0).unsqueeze(1).expand(5, VOCAB)
    keep, kept = drop_requests(samplers, logits, {"b": "grammar failed"})
    assert [s.request_id for s in keep] == ["a", "c"] and kept[:, 0].tolist() == [0.0, 4.0]


def test_verified_proposals_are_kept_up_to_the_first_mismatch():
    samplers = [sched("plain", 1), sched("all", 3, spec=(4, 5)), sched("half", 3, spec=(6, 7))]
    # "all": the target's samples are 4 (matches), 5 (matches), then 1; "half": 6 (matches), 3 (differs)
    out = sample_step(samplers, peaked(2, 4, 5, 1, 6, 3, 0), ctx())
    assert out.request_ids == ("plain", "all", "half") and out.sampled_token_ids == (2, 4, 6)
    assert out.extra_token_ids == ((), (5, 1), (3,)) and out.failed == () and out.logprobs == ()


def test_logprobs_only_for_the_requests_that_ask():
    samplers = [sched("asks", 1, params=SamplingParams(temperature=0.0, logprobs=2)), sched("quiet", 1)]
    logits = peaked(3, 1)
    out = sample_step(samplers, logits, ctx())
    asks, quiet = out.logprobs
    assert quiet is None and asks.top_ids[0] == 3 and len(asks.top_ids) == 2
    assert math.isclose(asks.logprob, float(logits[0].log_softmax(-1)[3]), rel_tol=1e-6)


class FailOne:
    def __init__(self, request_id: str) -> None:
        self.request_id, self.checked = request_id, []

    def admit(self, request: GenerateRequest) -> None:
        pass

    def check(self, stage: Stage, request_id: str) -> None:
        self.checked.append((stage, request_id))
        if request_id == self.request_id:
            raise RuntimeError("made to fail")


def test_a_request_whose_sampling_fails_is_reported_and_the_others_keep_their_tokens():
    hook = FailOne("b")
    samplers = [sched("a", 1), sched("b", 1), sched("c", 3, spec=(4, 4))]
    out = sample_step(samplers, peaked(1, 2, 4, 4, 0), ctx(hook))
    assert out.request_ids == ("a", "c") and out.sampled_token_ids == (1, 4) and out.extra_token_ids == ((), (4, 0))
    assert out.failed == (("b", "RuntimeError: made to fail"),)
    assert hook.checked[:2] == [(Stage.SAMPLE, "a"), (Stage.SAMPLE, "b")]  # the batch, then one by one
