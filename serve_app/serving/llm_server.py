"""LLMServer: the Ray Serve deployment that owns one backend (one engine) per replica.

Called only through a `DeploymentHandle` (from `OpenAIIngress`):
- `generate(request)` (a streaming method: `handle.options(stream=True)`) yields `GenerationChunk`s,
  compact deltas made from the backend's `RequestOutput`s. Invalid input raises `ValueError`
  ("field: ...") on the first item; else the first item may be an empty chunk confirming admission; cancelling the call (client disconnect) aborts the request in the
  engine and frees its KV blocks.
- `model_info()` → `ModelInfo` (served name, context length).
- Ray Serve calls `record_routing_stats()` every `request_routing_stats_period_s` and hands the dict
  (`kv_cache_usage`, `num_free_blocks`, `num_total_blocks`, `num_waiting`, `num_running`,
  `num_pending_prompt_tokens`, `sampled_at`)
  to request routers (`serve_app.serving.router`); and `check_health()` every `health_check_period_s`: it raises once the engine loop died,
  and Serve replaces the replica.

torch is imported only inside the replica (when the backend starts), never at module load.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import logging
import os
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from ray import serve

from serve_app.backends import Backend, ModelInfo, make_backend
from serve_app.config import ServeConfig
from serve_app.metrics.loggers import RayStatLogger
from serve_app.types import GenerateRequest, RequestOutput, TokenLogprob

logger = logging.getLogger("ray.serve")


@dataclass(frozen=True)
class GenerationChunk:
    """What crosses the replica → ingress hop for each delta (no prompt ids, no metrics objects)."""

    text: str
    token_ids: tuple[int, ...]
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" on the last chunk
    num_prompt_tokens: int
    logprobs: tuple[TokenLogprob, ...] | None = None  # one per token when the request asked for logprobs

    @classmethod
    def from_output(cls, out: RequestOutput) -> GenerationChunk:
        reason = None if out.finish_reason is None else str(out.finish_reason)
        return cls(out.text, tuple(out.token_ids), out.finished, reason, out.num_prompt_tokens, out.logprobs)

    def merge(self, later: GenerationChunk) -> GenerationChunk:
        """This delta followed by a later one, as a single delta."""
        logprobs = None if self.logprobs is None else self.logprobs + (later.logprobs or ())
        return GenerationChunk(self.text + later.text, self.token_ids + later.token_ids, later.finished,
                               later.finish_reason, later.num_prompt_tokens, logprobs)


async def batch_stream(outputs: AsyncIterator[RequestOutput], interval_s: float) -> AsyncIterator[GenerationChunk]:
    """Deltas as chunks; with `interval_s` > 0, deltas arriving within `interval_s` of the previous
    yield are merged into the next one. The admission delta, the first token and the finish are
    yielded at once, so TTFT and end-to-end latency are untouched; a held delta waits at most
    `interval_s` + one engine step."""
    pending: GenerationChunk | None = None
    last_yield = -float("inf")
    first = True
    async with contextlib.aclosing(outputs):  # leaving early closes the backend stream: abort, free KV
        async for out in outputs:
            chunk = GenerationChunk.from_output(out)
            pending = chunk if pending is None else pending.merge(chunk)
            now = time.monotonic()
            if first or pending.finished or interval_s <= 0 or now - last_yield >= interval_s:
                yield pending
                first = first and not pending.token_ids  # after the (token-less) admission delta: the first token
                pending, last_yield = None, now
    if pending is not None:  # pragma: no cover - a backend stream always ends with a finished delta
        yield pending


def import_attr(path: str) -> Any:
    """"package.module:attr" (or "package.module.attr") → the object."""
    module, sep, attr = path.partition(":")
    if not sep:
        module, _, attr = path.rpartition(".")
    return getattr(importlib.import_module(module), attr)


def configure_torch_threads(num_threads: int) -> int:
    """Give torch `num_threads` intra-op threads (0: every core of the machine).

    Ray sets OMP_NUM_THREADS=1 for actors with fractional CPUs, which would leave a CPU replica on a
    single core; the deployment's `num_cpus` is a scheduling hint, not a thread budget.
    """
    import torch

    n = num_threads or os.cpu_count() or 1
    torch.set_num_threads(n)
    os.environ["OMP_NUM_THREADS"] = str(n)  # for anything that reads it later (e.g. the kernel build)
    return n


@serve.deployment(name="LLMServer")
class LLMServer:
    """One replica = one backend. Deployment options (replicas, CPUs, GPUs, limits, routing-stats
    period, health checks) are applied from the `ServeConfig` in `serve_app.serving.app`."""

    async def __init__(self, config: ServeConfig) -> None:
        self.config = config
        if config.device == "cpu":
            threads = configure_torch_threads(config.torch_num_threads)
        else:
            threads = 0
        # engine metrics on Ray's metrics port (ray_llm_*, names in serve_app.metrics.names), plus any extras
        stat_loggers = [RayStatLogger(config.model_name)]
        stat_loggers += [import_attr(path)(config) for path in config.stat_logger_factories]
        self._stat_loggers = stat_loggers
        self.backend: Backend = make_backend(config, stat_loggers)
        await self.backend.start()
        self._info = self.backend.model_info()
        logger.info("LLMServer replica ready: model %s, context %d tokens, torch threads %s",
                    self._info.name, self._info.max_model_len, threads or "n/a")

    async def generate(self, request: GenerateRequest) -> AsyncIterator[GenerationChunk]:
        # the engine's timings (TTFT, queue time) start when the request reaches this replica: the
        # ingress's monotonic clock may be another machine's
        request = dataclasses.replace(request, arrival_time=time.monotonic())
        num_tokens = 0
        reason = None
        try:
            async with contextlib.aclosing(batch_stream(self.backend.generate(request), self.config.stream_batch_interval_s)) as chunks:
                async for chunk in chunks:
                    num_tokens += len(chunk.token_ids)
                    reason = chunk.finish_reason
                    yield chunk
        finally:
            if self.config.log_requests:
                logger.info("request %s: prompt %r → %d tokens (%s)", request.request_id,
                            request.prompt if request.messages is None else request.messages, num_tokens, reason)
            else:
                logger.debug("request %s: %d tokens (%s)", request.request_id, num_tokens, reason)

    def model_info(self) -> ModelInfo:
        return self._info

    def routing_stats(self) -> dict[str, float | int]:
        """The same numbers `record_routing_stats` publishes (for probes and tests)."""
        return self.backend.routing_stats().as_dict()

    def record_routing_stats(self) -> dict[str, float | int]:
        # `sampled_at` (this machine's wall clock) lets the router tell how old the sample is and which
        # of its requests the sample already includes; it also makes every sample differ, so Serve's
        # controller re-broadcasts each one (it only pushes changed stats)
        return {**self.backend.routing_stats().as_dict(), "sampled_at": time.time()}

    def check_health(self) -> None:
        self.backend.check_health()

    def __del__(self) -> None:
        backend = getattr(self, "backend", None)
        if backend is not None:
            backend.shutdown()
        # stop re-publishing gauges: a replica class used in-process (tests) would otherwise keep
        # exporting them from the driver into whatever Ray instance that process joins next
        for stat_logger in getattr(self, "_stat_loggers", ()):
            if hasattr(stat_logger, "close"):
                stat_logger.close()
