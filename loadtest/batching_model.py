"""W2 batching study, the pure part (no torch): the arrival trace (a seeded Poisson process of requests in three
classes, random token ids, exact output lengths: every policy does identical work), each policy's summary, and the
step-cost model with the shortest makespan any admission policy could reach on the trace.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Any

from loadtest.stats import percentile, ratio


@dataclass(frozen=True)
class RequestClass:
    name: str
    weight: float
    prompt_len: tuple[int, int]  # drawn log-uniformly in [lo, hi]
    output_len: tuple[int, int]  # drawn uniformly in [lo, hi]


# output lengths within one batch differ by up to ~30x: what request-level (static/dynamic) batching pays for
DEFAULT_CLASSES = (RequestClass("short", 0.6, (16, 96), (8, 48)), RequestClass("medium", 0.3, (48, 256), (64, 128)),
                   RequestClass("long", 0.1, (128, 512), (192, 256)))


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


def make_trace(num_requests: int, rate_per_s: float, seed: int = 0, vocab_size: int = 49152) -> list[TraceRequest]:
    """A Poisson arrival trace of DEFAULT_CLASSES, token ids from 100 up; the same arguments always give the same trace."""
    if num_requests < 1 or not rate_per_s > 0:
        raise ValueError(f"num_requests >= 1 and rate_per_s > 0, got {num_requests}, {rate_per_s}")
    rng, t, trace = random.Random(seed), 0.0, []
    for i in range(num_requests):
        klass = rng.choices(DEFAULT_CLASSES, [c.weight for c in DEFAULT_CLASSES])[0]
        prompt_len = int(round(math.exp(rng.uniform(math.log(klass.prompt_len[0]), math.log(klass.prompt_len[1])))))
        prompt = tuple(rng.randrange(100, vocab_size) for _ in range(prompt_len))
        trace.append(TraceRequest(i, t, klass.name, prompt, rng.randint(*klass.output_len)))
        t += rng.expovariate(rate_per_s)
    return trace


def describe_trace(trace: list[TraceRequest]) -> dict[str, Any]:
    prompt, output = [r.prompt_len for r in trace], [r.output_len for r in trace]
    return {"num_requests": len(trace), "arrival_span_s": trace[-1].arrival_s - trace[0].arrival_s,
            "prompt_tokens": sum(prompt), "output_tokens": sum(output),
            "prompt_len": {"min": min(prompt), "mean": sum(prompt) / len(prompt), "max": max(prompt)},
            "output_len": {"min": min(output), "mean": sum(output) / len(output), "max": max(output)},
            "classes": {name: sum(r.klass == name for r in trace) for name in sorted({r.klass for r in trace})}}


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


def summarize_policy(requests: list[RequestResult], steps: list[StepRecord]) -> dict[str, Any]:
    """Throughput over the makespan (first arrival → last finish), latency percentiles, batch shape."""
    done = [r for r in requests if r.finished_s is not None]
    makespan = max((r.finished_s for r in done), default=0.0) - min((r.arrival_s for r in requests), default=0.0)
    tokens, busy = sum(r.num_output_tokens for r in done), sum(s.duration_s for s in steps)
    ttft = [r.first_token_s - r.arrival_s for r in done if r.first_token_s is not None]
    e2e = [r.finished_s - r.arrival_s for r in done]
    queue = [r.first_scheduled_s - r.arrival_s for r in done if r.first_scheduled_s is not None]
    return {"num_requests": len(requests), "num_finished": len(done), "makespan_s": makespan, "output_tokens": tokens,
            "output_tok_s": tokens / makespan if makespan > 0 else 0.0,
            "request_throughput": len(done) / makespan if makespan > 0 else 0.0,
            "ttft_p50_s": percentile(ttft, 0.5), "ttft_p99_s": percentile(ttft, 0.99), "e2e_p50_s": percentile(e2e, 0.5),
            "e2e_p99_s": percentile(e2e, 0.99), "queue_p50_s": percentile(queue, 0.5), "num_steps": len(steps),
            "mean_batch_size": sum(s.num_seqs for s in steps) / len(steps) if steps else 0.0,
            "time_weighted_batch_size": sum(s.num_seqs * s.duration_s for s in steps) / busy if busy > 0 else 0.0,
            "max_batch_size": max((s.num_seqs for s in steps), default=0), "mean_step_s": busy / len(steps) if steps else 0.0,
            "busy_fraction": busy / makespan if makespan > 0 else 0.0, "num_preemptions": sum(r.num_preemptions for r in requests)}


def compare(summaries: dict[str, dict[str, Any]], baseline: str = "static") -> dict[str, dict[str, float | None]]:
    """Ratios against the baseline policy: throughput (higher is better) and TTFT p50 (lower is better)."""
    base = summaries.get(baseline)
    return {name: {"output_tok_s_ratio": ratio(s["output_tok_s"], base["output_tok_s"]),
                   "ttft_p50_ratio": ratio(s["ttft_p50_s"], base["ttft_p50_s"])} for name, s in summaries.items()} if base else {}


def timeline_segments(steps: list[StepRecord]) -> dict[str, list[tuple[float, float, str]]]:
    """Per request: (start, end, "prefill" | "decode") spans of its steps, consecutive steps of a kind merged (gaps too)."""
    spans: dict[str, list[list]] = {}
    last: dict[str, int] = {}
    for i, step in enumerate(steps):
        for request_id, _, reads_prompt in step.batch:
            kind, mine = ("prefill" if reads_prompt else "decode"), spans.setdefault(request_id, [])
            if mine and mine[-1][2] == kind and last.get(request_id) == i - 1:
                mine[-1][1] = step.start_s + step.duration_s
            else:
                mine.append([step.start_s, step.start_s + step.duration_s, kind])
            last[request_id] = i
    return {rid: [tuple(s) for s in segs] for rid, segs in spans.items()}


def fit_step_cost(steps: list[dict]) -> tuple[float, float, float, float] | None:
    """Least squares: step seconds = fixed + per_decode x decode tokens + per_prompt x prompt tokens;
    (fixed, per_decode, per_prompt, R²), or None with fewer than 3 distinct step shapes."""
    import numpy as np

    x = np.array([[1.0, st["num_decode_tokens"], st["num_prefill_tokens"]] for st in steps]).reshape(-1, 3)
    if len(steps) < 3 or np.linalg.matrix_rank(x) < 3:
        return None
    y = np.array([st["duration_s"] for st in steps])
    coef = np.linalg.lstsq(x, y, rcond=None)[0]
    r2 = float(1 - ((y - x @ coef) ** 2).sum() / max(((y - y.mean()) ** 2).sum(), 1e-12))
    return float(coef[0]), float(coef[1]), float(coef[2]), r2


def makespan_lower_bound(requests: list[tuple[float, int, int]], fixed: float, per_decode: float, per_prompt: float,
                         cap: int, budget: int) -> dict[str, Any]:
    """The shortest makespan any admission policy could reach on `requests` ((arrival_s, prompt, output tokens)) at these
    step costs, `cap` sequences per step, `budget` prompt tokens: the larger of the work and the chain bound (docs/benchmarks.md)."""
    reqs = sorted(requests)
    t0, tok = reqs[0][0], [per_decode * (out - 1) + per_prompt * prompt for _, prompt, out in reqs]
    total_tok = sum(tok)
    work_s = chain_s = before_tok = suffix_tok = suffix_decodes = 0.0
    for i in range(len(reqs) - 1, -1, -1):
        suffix_decodes += reqs[i][2] - 1
        suffix_tok += tok[i]
        work_s = max(work_s, reqs[i][0] - t0 + math.ceil(suffix_decodes / cap) * fixed + suffix_tok)
    for i, (arrival, prompt, out) in enumerate(reqs):
        a = arrival - t0
        chain_s = max(chain_s, a + (math.ceil(prompt / budget) + out - 1) * fixed + total_tok - min(a, before_tok))
        before_tok += tok[i]
    return {"bound_s": max(work_s, chain_s), "work_bound_s": work_s, "chain_bound_s": chain_s,
            "binding": "work" if work_s >= chain_s else "chain"}


def step_cost_model(results: dict[str, Any]) -> dict[str, Any] | None:
    """The step-cost fit over every step, each policy's engine time as predicted, an ideal continuous batcher's, the
    makespan bound (given the workload's requests) and each policy against it at its own steps' costs; or None."""
    fit = fit_step_cost([st for p in results["policies"].values() for st in p["steps"]])
    if fit is None:
        return None
    fixed, per_decode, per_prompt, r2 = fit

    def predict(st: dict) -> float:
        return fixed + per_decode * st["num_decode_tokens"] + per_prompt * st["num_prefill_tokens"]

    w, cap = results["workload"], results["settings"]["max_num_seqs"]
    ideal_steps = math.ceil(w["output_tokens"] / cap)
    out: dict[str, Any] = {
        "fixed_ms": fixed * 1000, "per_decode_token_ms": per_decode * 1000, "per_prompt_token_ms": per_prompt * 1000, "r2": r2,
        "policies": {name: {"busy_s": sum(st["duration_s"] for st in p["steps"]), "predicted_busy_s": sum(map(predict, p["steps"])),
                            "num_steps": len(p["steps"])} for name, p in results["policies"].items()},
        "ideal_continuous": {"num_steps": ideal_steps,
                             "busy_s": ideal_steps * fixed + per_decode * w["output_tokens"] + per_prompt * w["prompt_tokens"]}}
    bound_s = out["ideal_continuous"]["busy_s"]
    if w.get("requests"):
        requests, budget = [tuple(r) for r in w["requests"]], results["settings"]["max_num_batched_tokens"]
        out["makespan_bound"] = makespan_lower_bound(requests, fixed, per_decode, per_prompt, cap, budget)
        bound_s, out["own_fits"] = out["makespan_bound"]["bound_s"], {}
        for name, p in results["policies"].items():
            if (f := fit_step_cost(p["steps"])) is not None:
                b = makespan_lower_bound(requests, f[0], f[1], f[2], cap, budget)["bound_s"]
                out["own_fits"][name] = {"fixed_ms": f[0] * 1000, "per_decode_token_ms": f[1] * 1000, "per_prompt_token_ms": f[2] * 1000,
                                         "r2": f[3], "bound_s": b, "share_of_bound": b / p["summary"]["makespan_s"]}
    if "static" in out["policies"]:
        out["throughput_bound_vs_static"] = results["policies"]["static"]["summary"]["makespan_s"] / bound_s
        out["fixed_only_bound_vs_static"] = out["policies"]["static"]["num_steps"] / ideal_steps
        out["prompt_share_of_static_busy"] = per_prompt * w["prompt_tokens"] / out["policies"]["static"]["busy_s"]
    return out
