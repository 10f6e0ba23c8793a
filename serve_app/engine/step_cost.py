"""Online fit of an engine's step cost: how long one step takes as a function of what it computes.

    step seconds ≈ fixed_s + per_prefill_token_s × prompt tokens + per_decode_token_s × decode tokens

Fit by least squares over the most recent `window` steps (a sliding window, so the fit follows the
machine's current speed: other tenants, thermal state). Anyone who must predict time from tokens
uses it: the router's predicted time to first token (a replica publishes its fit with its routing
stats), adaptive speculative decoding (what k more tokens per step cost).

Contract: `observe()` is called by the engine thread after each step; `cost()` may be called from
any thread (a lock guards the window) and returns a `StepCost` (frozen), or `None` until enough
distinct steps were seen to determine all three coefficients. Coefficients are clamped at 0 (a
noisy window can make least squares return a negative per-token cost; time never flows backwards).
This module imports only the standard library.
"""

from __future__ import annotations

import threading
from collections import Counter, deque
from dataclasses import asdict, dataclass

MIN_VARIED_STEPS = 8  # steps of another decode size than the usual one, to separate fixed from per-token cost


@dataclass(frozen=True)
class StepCost:
    """A fitted step-cost model (seconds)."""

    fixed_s: float
    per_prefill_token_s: float
    per_decode_token_s: float
    num_steps: int  # steps the fit used
    # False when the window cannot tell a step's fixed cost from its per-decode-token cost: fewer
    # than MIN_VARIED_STEPS steps with another number of decode tokens than the most common one
    # (e.g. a lone request decoding one token per step: fixed + per token is all it measures), or a
    # fit that made tokens free (noise). The numbers are then a guess, not a measurement.
    determined: bool = True

    def predict(self, num_prefill_tokens: int, num_decode_tokens: int) -> float:
        """Seconds for one step computing these tokens."""
        return self.fixed_s + self.per_prefill_token_s * num_prefill_tokens + self.per_decode_token_s * num_decode_tokens

    def as_dict(self) -> dict[str, float | int]:
        return asdict(self)


class StepCostFit:
    """Least-squares fit of `StepCost` over a sliding window of observed steps."""

    def __init__(self, window: int = 256, min_steps: int = 8) -> None:
        if window < 3:
            raise ValueError("window: must be >= 3")
        self.min_steps = max(3, min_steps)
        self._steps: deque[tuple[int, int, float]] = deque(maxlen=window)
        self._lock = threading.Lock()

    def observe(self, num_prefill_tokens: int, num_decode_tokens: int, duration_s: float) -> None:
        """Record one finished step."""
        if duration_s <= 0 or num_prefill_tokens + num_decode_tokens <= 0:
            return
        with self._lock:
            self._steps.append((num_prefill_tokens, num_decode_tokens, duration_s))

    def cost(self) -> StepCost | None:
        with self._lock:
            steps = list(self._steps)
        if len(steps) < self.min_steps:
            return None
        return fit_step_cost(steps)


def fit_step_cost(steps: list[tuple[int, int, float]]) -> StepCost | None:
    """Least squares of duration on (1, prefill tokens, decode tokens), by the normal equations.

    When the window does not tell prompt and decode tokens apart (e.g. only decode steps, or both
    always in the same proportion) both get the slope on total tokens; when every step computed the
    same number of tokens, or the fit says a token costs nothing or less (noise: a machine shared
    with other work), the step time is taken as proportional to its tokens (no fixed part), a
    per-token cost that is always positive. Either way, and when too few steps differ in their
    decode tokens to trust the split, the result says `determined=False`. None if empty.
    """
    if not steps:
        return None
    ones = [1.0] * len(steps)
    prefill = [float(p) for p, _, _ in steps]
    decode = [float(d) for _, d, _ in steps]
    y = [t for _, _, t in steps]
    total = [p + d for p, d in zip(prefill, decode, strict=True)]
    coef = _solve_least_squares([ones, prefill, decode], y)
    if coef is not None:
        fixed, per_prefill, per_decode = coef
    else:
        coef = _solve_least_squares([ones, total], y)
        fixed, per_prefill = coef if coef is not None else (0.0, 0.0)
        per_decode = per_prefill
    if per_prefill <= 0 or per_decode <= 0:
        per_token = sum(t * v for t, v in zip(total, y, strict=True)) / max(sum(t * t for t in total), 1.0)
        return StepCost(0.0, per_token, per_token, len(steps), determined=False)
    common = max(Counter(decode).values())
    return StepCost(max(fixed, 0.0), per_prefill, per_decode, len(steps), determined=len(decode) - common >= MIN_VARIED_STEPS)


def _solve_least_squares(columns: list[list[float]], y: list[float]) -> list[float] | None:
    """Solve (XᵀX) b = Xᵀy for a few columns by Gaussian elimination; None when singular."""
    k = len(columns)
    a = [[sum(ci * cj for ci, cj in zip(columns[i], columns[j], strict=True)) for j in range(k)] for i in range(k)]
    b = [sum(ci * yi for ci, yi in zip(columns[i], y, strict=True)) for i in range(k)]
    scale = max(abs(a[i][i]) for i in range(k)) or 1.0
    for col in range(k):
        pivot = max(range(col, k), key=lambda r: abs(a[r][col]))
        if abs(a[pivot][col]) <= 1e-12 * scale:
            return None
        a[col], a[pivot] = a[pivot], a[col]
        b[col], b[pivot] = b[pivot], b[col]
        for r in range(k):
            if r != col:
                f = a[r][col] / a[col][col]
                a[r] = [x - f * yv for x, yv in zip(a[r], a[col], strict=True)]
                b[r] -= f * b[col]
    return [b[i] / a[i][i] for i in range(k)]
