"""The statistics every benchmark reports: one percentile definition, spreads over repeats, paired ratios.

Percentile: linear interpolation between the closest ranks (numpy's default, Hyndman & Fan type 7).
For values sorted as x[0] <= ... <= x[n-1], the q-quantile (0 <= q <= 1) is x[i] + f (x[i+1] - x[i])
with i + f = q (n - 1): p50 is the median, p0 the minimum, p100 the maximum, a single value is every
percentile of itself, and a p99 over fewer than 100 values lies between the two largest.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence


def percentile(values: Iterable[float], q: float) -> float | None:
    """The q-quantile (0 <= q <= 1) as defined above; None for no values."""
    if not 0 <= q <= 1:
        raise ValueError(f"q: must be in [0, 1], got {q!r}")
    ordered = sorted(values)
    if not ordered:
        return None
    pos = q * (len(ordered) - 1)
    lo, hi = math.floor(pos), math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def spread(values: Iterable[float]) -> dict[str, float] | None:
    """{"median", "min", "max", "n"} of repeated measurements; None for none."""
    values = list(values)
    return {"median": percentile(values, 0.5), "min": min(values), "max": max(values), "n": len(values)} if values else None


def ratio(a: float | None, b: float | None) -> float | None:
    """a / b, None when either is missing or b is 0."""
    return a / b if a is not None and b else None


def interleaved(names: Sequence[str], repeat: int) -> list[str]:
    """`names` rotated by one each repeat: a drift in the machine's speed during a run hits every compared system alike."""
    k = repeat % len(names) if names else 0
    return [*names[k:], *names[:k]]


def paired_ratios(runs: dict[str, dict[int, float]], a: str, b: str) -> list[float]:
    """a ÷ b per repeat, over the repeats both ran (`runs`: system → repeat → value)."""
    return [runs[a][r] / runs[b][r] for r in sorted(runs.get(a, {})) if r in runs.get(b, {}) and runs[b][r]]
