"""Row-count invariance of a projection: `linear(x[:M])[:m] == linear(x[:m])` bit for bit.

A request's hidden states go through the same projections whatever else is in its step, but a
matmul library may pick another kernel (another summation order) for another row count: oneDNN's
bf16 matmul on a CPU without AMX changes kernels past 8 rows for the down projection (K = 1536),
with AMX past 32 rows; torch's fp32 matmul (MKL) already between 1 and 2 rows. Then the same prompt
computed alone, in a bigger batch or after a prefix-cache hit differs by a rounding step, and near
ties between tokens flip.

`invariant_tiling` measures, for one projection on this machine, how to call it so that every row
comes out as it does alone: untiled, on tiles of at most N rows, or on fixed tiles padded to exactly
N rows; `row_tiled` then calls it so. The inputs spread over 2^16 of magnitudes, so a change of
summation order shows in many outputs, not in one of 10^4 as with unit-scale data.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

Linear = Callable[..., torch.Tensor]  # (x [M, K], *weights) -> [M, N]

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
    """The first row count in `counts` at which `fn` gives a row other than it gives that row alone
    (checked for the first 64 rows, the rows any call has) or other than the largest call gives it
    (every row); None when there is none. `x` has at least max(counts) rows. (A change of kernel shows
    in a few outputs of a few rows only, so whole rows are compared.)"""
    largest = fn(x[: max(counts)], *args)
    alone = [fn(x[i : i + 1], *args) for i in range(min(64, max(counts)))]
    for m in counts:
        out = fn(x[:m], *args)
        head = min(m, 64)
        if not (torch.equal(out[:head], torch.cat(alone[:head])) and torch.equal(out, largest[:m])):
            return m
    return None


@dataclass(frozen=True)
class RowTiling:
    """How a projection is called: on at most `rows` rows at a time (0: any number), each call
    padded to exactly `rows` rows when `padded` (a library whose result for a row depends on the
    call's row count but not on the row's place in it: oneDNN without AMX, from 2 rows on)."""

    rows: int = 0
    padded: bool = False

    def __str__(self) -> str:
        return "all" if self.rows == 0 else f"{self.rows}{' padded' if self.padded else ''}"


UNTILED = RowTiling()
# tried in this order after UNTILED: large tiles, then fixed padded tiles (a padded call costs up to
# `rows` rows of compute, little where a small call is bound by reading the weight), then small tiles
TILINGS = (*(RowTiling(n) for n in (1024, 256, 64, 32, 16)), *(RowTiling(n, True) for n in (32, 16, 8)),
           *(RowTiling(n) for n in (8, 4, 2, 1)))


def row_tiled(fn: Linear, tiling: RowTiling) -> Linear:
    """`fn` called as `tiling` says."""
    rows = tiling.rows
    if rows == 0:
        return fn

    def tiled(x: torch.Tensor, *args) -> torch.Tensor:
        n = x.shape[0]
        if tiling.padded and n % rows:
            x = F.pad(x, (0, 0, 0, rows - n % rows))
        if x.shape[0] <= rows:
            return fn(x, *args)[:n]
        return torch.cat([fn(x[i : i + rows], *args) for i in range(0, x.shape[0], rows)])[:n]

    return tiled


@dataclass(frozen=True)
class Projection:
    """One way to run a projection: `fn(x, pack(weight))`, named by `key` (the implementation, not the
    weights: the kernel a library picks depends on shapes, never on values)."""

    key: str
    fn: Linear
    pack: Callable[[torch.Tensor], torch.Tensor]


# measured tilings per (implementation, out_features, in_features, dtype, max_rows): a process builds
# many engines over the same shapes (tests, a draft model), and measuring takes a second or more
_MEASURED: dict[tuple, RowTiling] = {}


def invariant_tiling(proj: Projection, out_features: int, in_features: int, dtype: torch.dtype, max_rows: int) -> RowTiling:
    """The first tiling (UNTILED, then `TILINGS` in order) at which `row_tiled(proj.fn, tiling)` is
    row-count invariant up to `max_rows` rows on this machine, measured on spread weights of this
    shape; single rows always are."""
    key = (proj.key, out_features, in_features, dtype, max_rows)
    if key not in _MEASURED:
        # (a large weight repeats a block of 1024 rows: the kernel's choice depends on the shape alone)
        block = spread_inputs(min(out_features, 1024), in_features, dtype, seed=out_features) / 16
        weight = proj.pack(block.repeat(-(-out_features // block.shape[0]), 1)[:out_features].contiguous())
        x = spread_inputs(max_rows, in_features, dtype, seed=in_features)
        _MEASURED[key] = next((t for t in (UNTILED, *TILINGS) if t.rows < max_rows and first_variant_rows(
            row_tiled(proj.fn, t), (weight,), x, row_counts(max_rows if t.rows == 0 else min(max_rows, 4 * t.rows))) is None),
            RowTiling(1))
    return _MEASURED[key]
