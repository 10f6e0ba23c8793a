"""The C++ bf16 RMSNorm against HF's LlamaRMSNorm.

Only the order of the fp32 sum of squares differs from HF's, so outputs are bit-identical except for
rare one-step bf16 rounding flips (F.rms_norm, which it replaces, differs from HF on ~25% of elements).
"""

from __future__ import annotations

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from serve_app.engine import cpu_kernels

OP = cpu_kernels.op("rms_norm_bf16")
pytestmark = pytest.mark.skipif(OP is None, reason="the C++ ops could not be built here")


def bf16_steps_apart(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (a.view(torch.int16).int() - b.view(torch.int16).int()).abs()


@pytest.mark.parametrize("rows", [1, 7, 64, 300])  # serial and parallel row ranges
@pytest.mark.parametrize("hidden", [576, 96])
def test_matches_hf(rows, hidden):
    gen = torch.Generator().manual_seed(rows * hidden)
    norm = LlamaRMSNorm(hidden, eps=1e-5).to(torch.bfloat16)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(hidden, generator=gen) * 0.5 + 1)
        x = (torch.randn(rows, hidden, generator=gen) * 3).to(torch.bfloat16)
        ours, ref = OP(x, norm.weight, 1e-5), norm(x)
    steps = bf16_steps_apart(ours, ref)
    assert steps.max() <= 1
    assert (steps > 0).sum() <= max(1, ref.numel() // 10_000)


def test_non_contiguous_input_and_bad_dtype():
    x = torch.randn(4, 1000).to(torch.bfloat16)[:, :576]
    w = torch.ones(576, dtype=torch.bfloat16)
    ref = LlamaRMSNorm(576, eps=1e-6).to(torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(OP(x, w, 1e-6), ref(x))
    with pytest.raises(RuntimeError, match="bf16 only"):
        OP(x.float(), w.float(), 1e-6)
