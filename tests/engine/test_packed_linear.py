"""The bf16 CPU projections run on oneDNN-packed weights with their rows padded to a few bucket
sizes (`linear_rows_bucket`): results are bit-identical to the unpadded matmul and to F.linear, and
every token count up to a 2048-token step maps to at most 47 shapes (oneDNN builds and caches a
primitive per shape; unbucketed, a serving replica's memory grew until its cache was full)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from serve_app.engine.models.llama import _packed_linear, linear_rows_bucket


def test_buckets_are_few_and_never_smaller_than_the_rows():
    buckets = {linear_rows_bucket(n) for n in range(1, 2049)}
    assert len(buckets) == 8 + 7 + 31  # 1..8, 16..64 by 8, 128..2048 by 64
    assert all(linear_rows_bucket(n) >= n and linear_rows_bucket(n) - n < 64 for n in range(1, 2049))
    assert [linear_rows_bucket(n) for n in (1, 8, 9, 64, 65, 129)] == [1, 8, 16, 64, 128, 192]


@pytest.mark.skipif(not torch.ops.mkldnn._is_mkldnn_bf16_supported(), reason="oneDNN bf16 not supported on this CPU")
@pytest.mark.parametrize("rows", [1, 7, 9, 37, 65, 300, 1000])
def test_padded_packed_matmul_is_bit_identical(rows):
    torch.manual_seed(rows)
    weight = torch.randn(1536, 576).bfloat16()
    bias = torch.randn(1536).bfloat16()
    packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)
    x = torch.randn(rows, 576).bfloat16()
    out = _packed_linear(x, packed, bias)
    assert out.shape == (rows, 1536)
    assert torch.equal(out, torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], ""))
    assert torch.equal(out, F.linear(x, weight, bias))
