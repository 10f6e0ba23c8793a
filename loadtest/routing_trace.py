"""W3 routing benchmark: traces and per-run summaries (pure Python; no Ray, no model).

A trace is a seeded Poisson arrival process over `duration_s` at `rate` requests/s. Each request has
random prompt token ids and a fixed output length (greedy, ignore_eos), so every router sees exactly
the same requests at exactly the same offsets.

- skewed: a few long requests (long prompt, long output: a big KV footprint held for long) among
  many short ones.
- uniform: every request the same size: the skewed mix's mean prompt and output length, so both
  traces offer the same token volume at the same rate.
"""

from __future__ import annotations

import math
import random
import statistics
from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class Mix:
    long_fraction: float = 0.12
    long_prompt: int = 384
    long_output: int = 128
    short_prompt: int = 48
    short_output: int = 16

    @property
    def mean_prompt(self) -> int:
        return round(self.long_fraction * self.long_prompt + (1 - self.long_fraction) * self.short_prompt)

    @property
    def mean_output(self) -> int:
        return round(self.long_fraction * self.long_output + (1 - self.long_fraction) * self.short_output)


@dataclass(frozen=True)
class TraceRequest:
    index: int
    arrival_s: float  # offset from the start of the trace
    kind: str  # "long" | "short" | "uniform"
    prompt: tuple[int, ...]
    max_tokens: int


def make_trace(name: str, mix: Mix, rate: float, duration_s: float, seed: int, vocab: int = 49152) -> list[TraceRequest]:
    """Poisson arrivals (`rate`/s for `duration_s`); `name` is "skewed" or "uniform"."""
    if name not in ("skewed", "uniform"):
        raise ValueError(f"trace: 'skewed' or 'uniform', got {name!r}")
    rng = random.Random(seed)
    out: list[TraceRequest] = []
    t = rng.expovariate(rate)
    while t < duration_s:
        if name == "uniform":
            kind, prompt_len, max_tokens = "uniform", mix.mean_prompt, mix.mean_output
        elif rng.random() < mix.long_fraction:
            kind, prompt_len, max_tokens = "long", mix.long_prompt, mix.long_output
        else:
            kind, prompt_len, max_tokens = "short", mix.short_prompt, mix.short_output
        prompt = tuple(rng.randrange(100, vocab) for _ in range(prompt_len))
        out.append(TraceRequest(len(out), t, kind, prompt, max_tokens))
        t += rng.expovariate(rate)
    return out


def pct(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (None for no values)."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


@dataclass
class RequestResult:
    index: int
    kind: str
    arrival_s: float  # scheduled offset
    ttft_s: float | None  # from the scheduled arrival to the first token
    e2e_s: float | None
    output_tokens: int
    error: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def summarize_run(results: list[RequestResult], wall_s: float, preemptions: int,
                  per_replica: dict[str, dict[str, int]]) -> dict[str, Any]:
    """Latency percentiles (all requests and per kind), output tok/s over the run, preemptions."""
    ok = [r for r in results if r.error is None and r.ttft_s is not None]
    ttft = [r.ttft_s for r in ok]
    e2e = [r.e2e_s for r in ok if r.e2e_s is not None]
    tokens = sum(r.output_tokens for r in ok)
    summary: dict[str, Any] = {
        "num_requests": len(results), "num_errors": len(results) - len(ok),
        "errors": sorted({r.error for r in results if r.error})[:5],
        "ttft_p50_s": pct(ttft, 0.50), "ttft_p90_s": pct(ttft, 0.90), "ttft_p99_s": pct(ttft, 0.99),
        "ttft_mean_s": statistics.fmean(ttft) if ttft else None,
        "e2e_p50_s": pct(e2e, 0.50), "e2e_p99_s": pct(e2e, 0.99),
        "output_tokens": tokens, "wall_s": wall_s, "output_tok_s": tokens / wall_s if wall_s > 0 else None,
        "preemptions": preemptions, "per_replica": per_replica, "by_kind": {},
    }
    for kind in sorted({r.kind for r in results}):
        of_kind = [r for r in ok if r.kind == kind]
        summary["by_kind"][kind] = {"n": len(of_kind), "ttft_p50_s": pct([r.ttft_s for r in of_kind], 0.5),
                                    "ttft_p99_s": pct([r.ttft_s for r in of_kind], 0.99),
                                    "e2e_p99_s": pct([r.e2e_s for r in of_kind if r.e2e_s is not None], 0.99)}
    return summary


def compare(summaries: dict[str, dict[str, Any]], baseline: str = "pow2", candidate: str = "kv_aware") -> dict[str, Any]:
    """candidate ÷ baseline for TTFT p99, e2e p99 and output tok/s (None where either is missing)."""
    def ratio(key: str) -> float | None:
        a, b = summaries.get(candidate, {}).get(key), summaries.get(baseline, {}).get(key)
        return a / b if a is not None and b else None

    return {"ttft_p99_ratio": ratio("ttft_p99_s"), "ttft_p50_ratio": ratio("ttft_p50_s"),
            "e2e_p99_ratio": ratio("e2e_p99_s"), "output_tok_s_ratio": ratio("output_tok_s")}
