"""The C++ bf16 projection kernels (csrc/linear_bf16.cpp): the plain matmul (with and without bias)
against F.linear, within one bf16 ulp (they sum in another order: about one output in 10^4 rounds
the other way) and as close to the exact product; the fused gate/up matmul + SiLU·mul, bit for bit
against the kernel's own matmul followed by torch's silu and mul; the lm_head's fp32 logits against
the bf16 matmul widened; every row count of a tile's tail; and the real model's logits on the
kernels no further from fp32 than on oneDNN's packed matmuls."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from serve_app.engine import cpu_kernels

SUPPORTED = cpu_kernels.op("linear_bf16_supported")
pytestmark = pytest.mark.skipif(SUPPORTED is None or not SUPPORTED(), reason="needs the C++ ops built with AVX512-BF16")
pack = cpu_kernels.op("pack_linear_bf16")


def weights(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(n, k, generator=gen) * 0.05).bfloat16(), (torch.randn(n, generator=gen) * 0.5).bfloat16()


def assert_matches_f_linear(out: torch.Tensor, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> None:
    """Within one bf16 ulp of F.linear everywhere, equal nearly everywhere, and as close to the exact
    (float64) product."""
    expected = F.linear(x, w, bias)
    torch.testing.assert_close(out.float(), expected.float(), atol=1e-6, rtol=2**-7)
    assert (out != expected).float().mean() < 2e-3
    exact = F.linear(x.double(), w.double(), None if bias is None else bias.double())
    assert (out.double() - exact).abs().mean() <= 1.01 * (expected.double() - exact).abs().mean() + 1e-9


@pytest.mark.parametrize("rows", [1, 3, 8, 9, 64, 67, 300])
@pytest.mark.parametrize(("n", "k"), [(960, 576), (576, 1536), (32, 2), (80, 64)])  # 80 = 5 blocks: 3 + a 2-block tile
def test_linear_matches_f_linear(rows, n, k):
    w, bias = weights(n, k, rows + n)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).bfloat16()
    packed = pack(w)
    assert packed.shape == (n // 16, k // 2, 16, 2)
    assert_matches_f_linear(cpu_kernels.op("linear_bf16")(x, packed), x, w)
    assert_matches_f_linear(cpu_kernels.op("linear_bf16")(x, packed, bias), x, w, bias)


def test_linear_reads_rows_with_a_stride_and_handles_no_rows():
    w, _ = weights(96, 64, 0)
    wide = torch.randn(5, 128).bfloat16()
    x = wide[:, :64]  # rows 128 elements apart
    assert torch.equal(cpu_kernels.op("linear_bf16")(x, pack(w)), cpu_kernels.op("linear_bf16")(x.contiguous(), pack(w)))
    assert_matches_f_linear(cpu_kernels.op("linear_bf16")(x, pack(w)), x, w)
    assert cpu_kernels.op("linear_bf16")(torch.empty(0, 64, dtype=torch.bfloat16), pack(w)).shape == (0, 96)


@pytest.mark.parametrize("rows", [1, 7, 64, 129])
def test_fused_silu_mul_matches_linear_then_silu_mul(rows):
    inter, hidden = 1536, 576
    w, _ = weights(2 * inter, hidden, rows)
    x = (torch.randn(rows, hidden, generator=torch.Generator().manual_seed(rows)) * 4).bfloat16()
    gate, up = cpu_kernels.op("linear_bf16")(x, pack(w)).chunk(2, dim=-1)
    out = cpu_kernels.op("linear_silu_mul_bf16")(x, pack(w, interleave=True))
    assert out.shape == (rows, inter)
    assert torch.equal(out, F.silu(gate) * up)  # torch's rounding after the matmul, silu and mul, bit for bit


def test_logits_are_the_fp32_accumulators_never_rounded_to_bf16():
    """The lm_head's logits are the same sums as the bf16 matmul's, before its rounding: rounded,
    they are its result bit for bit; unrounded, nearer the exact product, and ties of the bf16
    result (two tokens on the same bf16 value) mostly separate."""
    w, _ = weights(49152 // 16, 576, 1)
    x = torch.randn(37, 576).bfloat16()
    logits = cpu_kernels.op("linear_logits_bf16")(x, pack(w))
    rounded = cpu_kernels.op("linear_bf16")(x, pack(w))
    assert logits.dtype == torch.float32
    assert torch.equal(logits.bfloat16(), rounded)
    assert (logits != rounded.float()).float().mean() > 0.9  # not bf16 values widened
    exact = F.linear(x.double(), w.double())
    assert (logits.double() - exact).abs().max() < (rounded.double() - exact).abs().max() / 10


def test_pack_rejects_shapes_the_layout_cannot_hold():
    with pytest.raises(RuntimeError, match="multiple of 16"):
        pack(torch.zeros(24, 64, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="K even"):
        pack(torch.zeros(32, 63, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="multiple of 16 \\(32 interleaved\\)"):
        pack(torch.zeros(48, 64, dtype=torch.bfloat16), interleave=True)
    assert cpu_kernels.linear_kernels([960, 576, 3072, 49152], [576, 576, 1536]) is not None
    assert cpu_kernels.linear_kernels([960, 576, 3072, 49155], [576, 576, 1536]) is None  # a vocab the layout cannot pad


@pytest.mark.heavy  # the whole model, every path
def test_model_logits_on_the_kernels_no_further_from_fp32_than_on_onednn(model_dir, prompt_ids):
    """bf16, real model, one step prefilling 8 prompts (every projection, the lm_head on 8 rows): on
    the kernels the logits are within bf16 noise of the fp32 engine's and no further from them than
    those of the same engine on oneDNN's packed matmuls (both forced: an AMX machine picks oneDNN)."""
    from serve_app.engine import LLM
    from serve_app.engine.outputs import ScheduledRequest
    from serve_app.types import SamplingParams

    greedy = SamplingParams(temperature=0.0, max_tokens=4)
    scheduled, first = [], 0
    for i, ids in enumerate(prompt_ids):
        blocks = tuple(range(first, first + -(-len(ids) // 16)))
        first += len(blocks)
        scheduled.append(ScheduledRequest(f"r{i}", tuple(ids), 0, blocks, True, True, greedy, None))

    def logits(dtype: str, **paths) -> tuple[str, torch.Tensor]:
        runner = LLM(model_dir, dtype=dtype, kv_cache_memory_gib=0.1, max_num_batched_tokens=1024, **paths).engine.core.model_runner
        return runner.linear_impl, runner.sampling_logits(scheduled)[1]

    impl, on_kernels = logits("bfloat16", linear_backend="kernels")
    assert impl == "kernels"
    _, fp32 = logits("float32")
    impl, on_onednn = logits("bfloat16", linear_backend="onednn")
    assert impl == "onednn"
    err_kernels, err_onednn = (on_kernels - fp32).abs(), (on_onednn - fp32).abs()
    assert err_kernels.max() < 0.05 * fp32.abs().max()  # bf16 noise (logits reach ~30 here)
    assert err_kernels.max() <= 1.5 * err_onednn.max() and err_kernels.mean() <= 1.05 * err_onednn.mean()
    assert (on_kernels.argmax(-1) == fp32.argmax(-1)).sum() >= (on_onednn.argmax(-1) == fp32.argmax(-1)).sum() - 1
