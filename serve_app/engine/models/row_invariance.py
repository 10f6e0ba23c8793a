"""Row-count invariance of a projection: `linear(x[:M])[:m] == linear(x[:m])` bit for bit.

A request's hidden states go through the same projections whatever else is in its step, but a
matmul library may pick another kernel (another summation order) for another row count: oneDNN's
bf16 matmul on a CPU without AMX changes kernels past 8 rows for the down projection (K = 1536),
with AMX past 32 rows; torch's fp32 matmul (MKL) already between 1 and 2 rows. Then the same prompt
computed alone, in a bigger batch or after a prefix-cache hit differs by a rounding step, and near
ties between tokens flip.

`invariant_tile` measures, for one projection on this machine, the largest number of rows per call
for which every row comes out as it does alone; `row_tiled` then never calls it with more. The
inputs spread over 2^16 of magnitudes, so a change of summation order shows in many outputs, not
in one of 10^4 as with unit-scale data.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

Linear = Callable[..., torch.Tensor]  # (x [M, K], *weights) -> [M, N]

# Row tiles tried, largest first: every row count a step can send in one call, then smaller tiles.
TILE_CANDIDATES = (1024, 256, 64, 32, 16, 8, 4, 2, 1)


def spread_inputs(rows: int, cols: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """[rows, cols] normal values scaled by 2^-8 .. 2^8 elementwise."""
    gen = torch.Generator().manual_seed(seed)
    scale = torch.exp2(torch.randint(-8, 9, (rows, cols), generator=gen).float())
    return (torch.randn(rows, cols, generator=gen) * scale).to(dtype)


def row_counts(max_rows: int) -> list[int]:
    """The row counts a check covers up to `max_rows`: every count to 17, each side of the thresholds
    where matmul libraries switch kernels (multiples of 8 up to 64 and their successors), then
    powers of two and `max_rows` itself."""
    counts = set(range(1, 18)) | {c + d for c in (24, 32, 40, 48, 56, 64) for d in (0, 1)}
    counts |= {2**p for p in range(7, max_rows.bit_length())} | {max_rows}
    return sorted(c for c in counts if c <= max_rows)


def first_variant_rows(fn: Linear, args: Sequence, x: torch.Tensor, counts: Sequence[int]) -> int | None:
    """The first row count in `counts` at which `fn` gives some row other than it gives that row
    alone; None when there is none. `x` has at least max(counts) rows. (A change of kernel shows in a
    few outputs of a few rows only, so every row is compared.)"""
    alone: list[torch.Tensor] = []
    for m in counts:
        alone.extend(fn(x[i : i + 1], *args) for i in range(len(alone), m))
        if not torch.equal(fn(x[:m], *args), torch.cat(alone[:m])):
            return m
    return None


def row_tiled(fn: Linear, tile: int) -> Linear:
    """`fn` called on at most `tile` rows at a time (0: unbounded)."""
    if tile == 0:
        return fn

    def tiled(x: torch.Tensor, *args) -> torch.Tensor:
        if x.shape[0] <= tile:
            return fn(x, *args)
        return torch.cat([fn(x[i : i + tile], *args) for i in range(0, x.shape[0], tile)])

    return tiled


@dataclass(frozen=True)
class Projection:
    """One way to run a projection: `fn(x, pack(weight))`, named by `key` (the implementation, not the
    weights: the kernel a library picks depends on shapes, never on values)."""

    key: str
    fn: Linear
    pack: Callable[[torch.Tensor], torch.Tensor]


# measured tiles per (implementation, out_features, in_features, dtype, max_rows): a process builds
# many engines over the same shapes (tests, a draft model), and measuring takes a second or two
_MEASURED: dict[tuple, int] = {}


def invariant_tile(proj: Projection, out_features: int, in_features: int, dtype: torch.dtype, max_rows: int) -> int:
    """The largest row tile (0: no tiling needed up to `max_rows`) for which `row_tiled(proj.fn, tile)`
    is row-count invariant on this machine, measured on spread weights of this shape; 1 always is
    (every row alone)."""
    key = (proj.key, out_features, in_features, dtype, max_rows)
    if key not in _MEASURED:
        # (a large weight repeats a block of 1024 rows: the kernel's choice depends on the shape alone)
        block = spread_inputs(min(out_features, 1024), in_features, dtype, seed=out_features) / 16
        weight = proj.pack(block.repeat(-(-out_features // block.shape[0]), 1)[:out_features].contiguous())
        _MEASURED[key] = _measure(proj.fn, (weight,), spread_inputs(max_rows, in_features, dtype, seed=in_features), max_rows)
    return _MEASURED[key]


def _measure(fn: Linear, args: Sequence, x: torch.Tensor, max_rows: int) -> int:
    if first_variant_rows(fn, args, x, row_counts(max_rows)) is None:
        return 0
    for tile in TILE_CANDIDATES:
        if tile < max_rows and (tile == 1 or first_variant_rows(row_tiled(fn, tile), args, x, row_counts(min(max_rows, 4 * tile))) is None):
            return tile
    return 1
