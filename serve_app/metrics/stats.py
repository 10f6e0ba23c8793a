"""Engine statistics as plain data, made where the data lives (the scheduler).

Per-request timings are `serve_app.types.RequestMetrics`, attached to each finished output.

Exporting them (Prometheus through Ray or prometheus_client) is a logger's job, elsewhere.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SchedulerStats:
    """One engine step."""

    step_index: int
    step_start_time: float  # monotonic
    step_duration_s: float
    num_scheduled_seqs: int  # batch size of the step
    num_prefill_tokens: int  # tokens of requests still reading their prompt
    num_decode_tokens: int
    num_running: int
    num_waiting: int
    num_preempted: int  # preemptions made in this step
    kv_cache_usage: float  # used / total blocks after the step
    num_free_blocks: int
    num_total_blocks: int
    prefix_cache_queries: int  # tokens looked up in this step
    prefix_cache_hits: int
    # (request_id, num_tokens computed, prompt still being read) for each request in the batch:
    # enough to draw who was in which batch (W2 timelines)
    batch: tuple[tuple[str, int, bool], ...] = ()
    # speculative decoding: decoding requests that could have been verified with proposed tokens,
    # those that were, their proposed tokens and how many of those were accepted
    spec_num_candidates: int = 0
    spec_num_seqs: int = 0
    spec_num_proposed: int = 0
    spec_num_accepted: int = 0
    # structured outputs: the step's grammar mask time, check + fill + apply (None: no constrained row), and
    # the compile time of each grammar that finished compiling since the previous step
    grammar_mask_s: float | None = None
    grammar_compile_s: tuple[float, ...] = ()

    @property
    def num_tokens(self) -> int:
        return self.num_prefill_tokens + self.num_decode_tokens


@dataclass(frozen=True)
class EngineLoad:
    """A snapshot of the engine's load (for routing, and for gauges between steps)."""

    kv_cache_usage: float
    num_free_blocks: int
    num_total_blocks: int
    num_running: int
    num_waiting: int
    # prompt tokens not yet computed (waiting and part-read prompts; a preempted request's recompute):
    # the prefill work queued ahead of a new request, which on a CPU is most of its time to first token
    num_pending_prompt_tokens: int = 0
