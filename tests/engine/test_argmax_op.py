"""The CPU argmax op (csrc/argmax.cpp) gives torch.argmax's answer, ties and NaN included, and greedy
sampling through it picks the same tokens."""

from __future__ import annotations

import pytest
import torch

from serve_app.engine import cpu_kernels
from serve_app.engine.sampler import sample
from serve_app.types import SamplingParams

ARGMAX = cpu_kernels.op("argmax_rows")
pytestmark = pytest.mark.skipif(ARGMAX is None, reason="the C++ ops could not be built here")


@pytest.mark.parametrize("shape", [(1, 1), (1, 15), (3, 16), (5, 17), (64, 49152), (2, 1000)])
def test_matches_torch_on_random_rows(shape):
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(shape[1]))
    assert torch.equal(ARGMAX(x), x.argmax(dim=-1))


def test_ties_nan_and_infinities():
    x = torch.zeros(6, 100)
    x[1, 50] = x[1, 70] = x[1, 99] = 1.0  # a tie: the first wins, across vector lanes and chunks
    x[2, 3] = x[2, 90] = float("nan")  # the first NaN wins, as in torch
    x[3] = float("-inf")  # all -inf: index 0
    x[4, 98] = float("inf")
    x[5] = -1.0
    x[5, 17] = x[5, 33] = 0.0  # same lane, two chunks
    assert ARGMAX(x).tolist() == x.argmax(dim=-1).tolist() == [0, 50, 3, 0, 98, 17]
    rounded = torch.randn(16, 4099, generator=torch.Generator().manual_seed(1)).bfloat16().float()  # many equal values
    assert torch.equal(ARGMAX(rounded), rounded.argmax(dim=-1))


def test_rejects_what_it_does_not_handle():
    with pytest.raises(RuntimeError, match="float32"):
        ARGMAX(torch.zeros(2, 8, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="contiguous"):
        ARGMAX(torch.zeros(8, 2).t())


def test_greedy_sampling_through_the_op():
    logits = torch.randn(9, 300, generator=torch.Generator().manual_seed(2))
    params = [SamplingParams(temperature=0.0)] * 9
    gen = torch.Generator().manual_seed(0)
    assert sample(logits, params, [None] * 9, gen, ARGMAX) == sample(logits, params, [None] * 9, gen) == logits.argmax(-1).tolist()
