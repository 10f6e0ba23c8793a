"""W2 batching study (docs/benchmarks.md): the arrival trace and the per-policy summary (pure Python, no torch).

The trace is a seeded Poisson process (exponential inter-arrival gaps at `rate_per_s`) of requests in
three classes with mixed prompt and output lengths (random token ids, exact output lengths:
ignore_eos), so that every policy sees byte-identical work. loadtest/bench_batching.py replays it.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass


@dataclass(frozen=True)
class RequestClass:
    name: str
    weight: float
    prompt_len: tuple[int, int]  # drawn log-uniformly in [lo, hi]
    output_len: tuple[int, int]  # drawn uniformly in [lo, hi]


# Many short chat-like requests, some medium, a few long generations: the output lengths within one
# batch differ by up to ~30x, which is what request-level (static/dynamic) batching pays for.
DEFAULT_CLASSES = (
    RequestClass("short", 0.6, (16, 96), (8, 48)),
    RequestClass("medium", 0.3, (48, 256), (64, 128)),
    RequestClass("long", 0.1, (128, 512), (192, 256)),
)


@dataclass(frozen=True)
class TraceRequest:
    index: int
    arrival_s: float  # seconds after the trace starts
    klass: str
    prompt_token_ids: tuple[int, ...]
    output_len: int

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)


def _log_uniform(rng: random.Random, lo: int, hi: int) -> int:
    return int(round(math.exp(rng.uniform(math.log(lo), math.log(hi)))))


def make_trace(
    num_requests: int,
    rate_per_s: float,
    seed: int = 0,
    vocab_size: int = 49152,
    min_token_id: int = 100,
    classes: tuple[RequestClass, ...] = DEFAULT_CLASSES,
) -> list[TraceRequest]:
    """A Poisson arrival trace; the same arguments always give the same trace."""
    if num_requests < 1:
        raise ValueError("num_requests: must be >= 1")
    if not rate_per_s > 0:
        raise ValueError("rate_per_s: must be > 0")
    rng = random.Random(seed)
    weights = [c.weight for c in classes]
    t = 0.0
    trace = []
    for i in range(num_requests):
        klass = rng.choices(classes, weights)[0]
        prompt_len = _log_uniform(rng, *klass.prompt_len)
        prompt = tuple(rng.randrange(min_token_id, vocab_size) for _ in range(prompt_len))
        trace.append(TraceRequest(i, t, klass.name, prompt, rng.randint(*klass.output_len)))
        t += rng.expovariate(rate_per_s)
    return trace


def describe_trace(trace: list[TraceRequest]) -> dict:
    """Totals and class counts (what the report prints about the workload)."""
    prompt = [r.prompt_len for r in trace]
    output = [r.output_len for r in trace]
    span = trace[-1].arrival_s - trace[0].arrival_s
    return {
        "num_requests": len(trace),
        "arrival_span_s": span,
        "offered_rate_per_s": (len(trace) - 1) / span if span > 0 else math.inf,
        "prompt_tokens": sum(prompt),
        "output_tokens": sum(output),
        "prompt_len": {"min": min(prompt), "mean": sum(prompt) / len(prompt), "max": max(prompt)},
        "output_len": {"min": min(output), "mean": sum(output) / len(output), "max": max(output)},
        "classes": {name: sum(r.klass == name for r in trace) for name in sorted({r.klass for r in trace})},
    }


# ---- per-policy summary --------------------------------------------------------------------------------
def quantile(values: list[float], q: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default)."""
    if not values:
        return None
    ordered = sorted(values)
    pos = q * (len(ordered) - 1)
    lo, hi = math.floor(pos), math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


@dataclass(frozen=True)
class RequestResult:
    """One replayed request, times in seconds since the trace's first arrival (engine clock)."""

    request_id: str
    index: int
    arrival_s: float
    first_scheduled_s: float | None
    first_token_s: float | None
    finished_s: float | None
    num_output_tokens: int
    num_preemptions: int = 0

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.arrival_s

    @property
    def e2e_s(self) -> float | None:
        return None if self.finished_s is None else self.finished_s - self.arrival_s

    @property
    def queue_s(self) -> float | None:
        return None if self.first_scheduled_s is None else self.first_scheduled_s - self.arrival_s


@dataclass(frozen=True)
class StepRecord:
    """One engine step, `start_s` since the trace's first arrival; `batch` as in SchedulerStats."""

    start_s: float
    duration_s: float
    num_seqs: int
    num_prefill_tokens: int
    num_decode_tokens: int
    num_waiting: int
    batch: tuple[tuple[str, int, bool], ...]


def summarize_policy(requests: list[RequestResult], steps: list[StepRecord]) -> dict:
    """Throughput over the makespan (first arrival → last finish), latency percentiles, batch shape."""
    done = [r for r in requests if r.finished_s is not None]
    makespan = max((r.finished_s for r in done), default=0.0) - min((r.arrival_s for r in requests), default=0.0)
    out_tokens = sum(r.num_output_tokens for r in done)
    ttft = [r.ttft_s for r in done if r.ttft_s is not None]
    e2e = [r.e2e_s for r in done]
    queue = [r.queue_s for r in done if r.queue_s is not None]
    busy = sum(s.duration_s for s in steps)
    return {
        "num_requests": len(requests),
        "num_finished": len(done),
        "makespan_s": makespan,
        "output_tokens": out_tokens,
        "output_tok_s": out_tokens / makespan if makespan > 0 else 0.0,
        "request_throughput": len(done) / makespan if makespan > 0 else 0.0,
        "ttft_p50_s": quantile(ttft, 0.5),
        "ttft_p99_s": quantile(ttft, 0.99),
        "e2e_p50_s": quantile(e2e, 0.5),
        "e2e_p99_s": quantile(e2e, 0.99),
        "queue_p50_s": quantile(queue, 0.5),
        "num_steps": len(steps),
        "mean_batch_size": sum(s.num_seqs for s in steps) / len(steps) if steps else 0.0,
        "time_weighted_batch_size": sum(s.num_seqs * s.duration_s for s in steps) / busy if busy > 0 else 0.0,
        "max_batch_size": max((s.num_seqs for s in steps), default=0),
        "mean_step_s": busy / len(steps) if steps else 0.0,
        "busy_fraction": busy / makespan if makespan > 0 else 0.0,
        "num_preemptions": sum(r.num_preemptions for r in requests),
    }


def compare(results: dict[str, dict], baseline: str = "static") -> dict[str, dict]:
    """Ratios against the baseline policy: throughput (higher is better) and TTFT p50 (lower is better)."""
    base = results.get(baseline)
    out = {}
    if not base:
        return out
    for name, r in results.items():
        out[name] = {
            "output_tok_s_ratio": r["output_tok_s"] / base["output_tok_s"] if base["output_tok_s"] else None,
            "ttft_p50_ratio": (r["ttft_p50_s"] / base["ttft_p50_s"]) if base["ttft_p50_s"] and r["ttft_p50_s"] is not None else None,
        }
    return out


def timeline_segments(steps: list[StepRecord]) -> dict[str, list[tuple[float, float, str]]]:
    """Per request: (start, end, "prefill" | "decode") spans of the steps it was in; runs of consecutive
    steps of the same kind are merged into one span (so a span covers the engine's time between them)."""
    spans: dict[str, list[list]] = {}
    last_step: dict[str, int] = {}
    for i, step in enumerate(steps):
        end = step.start_s + step.duration_s
        for request_id, _num_tokens, reads_prompt in step.batch:
            kind = "prefill" if reads_prompt else "decode"
            mine = spans.setdefault(request_id, [])
            if mine and mine[-1][2] == kind and last_step.get(request_id) == i - 1:
                mine[-1][1] = end
            else:
                mine.append([step.start_s, end, kind])
            last_step[request_id] = i
    return {rid: [tuple(s) for s in segs] for rid, segs in spans.items()}
