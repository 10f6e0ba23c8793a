"""LLMServer: the Ray Serve deployment that owns one backend (one engine) per replica.

Called only through a `DeploymentHandle` (from `OpenAIIngress`):
- `generate(request)` (a streaming method: `handle.options(stream=True)`) yields `GenerationChunk`s,
  compact deltas made from the backend's `RequestOutput`s. Invalid input raises `ValueError`
  ("field: ...") on the first item; else the first item is an empty chunk confirming admission;
  cancelling the call (client disconnect) aborts the request in the engine and frees its KV blocks.
- `generate_muxed(request, channel)`: the same, except that the chunks after the first token go
  over the calling ingress's channel, multiplexed with its other streams (`serving.stream_mux`).
- `model_info()` → `ModelInfo` (served name, context length).
- Ray Serve calls `record_routing_stats()` every `request_routing_stats_period_s` and hands the dict
  (`kv_cache_usage`, `num_free_blocks`, `num_total_blocks`, `num_waiting`, `num_running`,
  `num_pending_prompt_tokens`, the step-cost fit, `sampled_at`, and the incremental prefix-cache
  view `kv_*` of `serve_app.engine.kv_events`, and `kv_pending`: the block keys of accepted prompts
  not prefilled yet, `serve_app.serving.pending_prefixes`)
  to request routers (`serve_app.serving.router`); and `check_health()` every `health_check_period_s`: it raises once the engine loop died,
  or once the engine has had work pending and finished no step for `engine_stall_timeout_s` (a
  hung step), and Serve replaces the replica.
- A dead engine leaves the routing at once (`EngineWatch`, serving/engine_watch.py): under Serve, the
  replica checks its backend every `ENGINE_WATCH_PERIOD_S`; once the engine is dead, in-flight
  streams get their error, calls that have sent nothing are held, and after `DEAD_EXIT_GRACE_S` the
  replica process exits. Handles then see the actor dead, routers drop it at once, the held calls are
  retried on another replica, and Serve starts a replacement.
- A failure belongs to its request: if sending one request's deltas raises (the `stream` stage), that
  request alone fails with `RequestFailedError` (its engine request is aborted, KV freed).
- Drain: once Serve begins shutting the replica down (scale-down, redeploy), its in-flight requests
  get up to `drain_timeout_s` to finish; the rest are then aborted in the engine (KV freed, their
  streams end with an `abort` finish, which the ingress reports as an error) before Serve's own
  deadline (`drain_timeout_s` + `ABORT_GRACE_S`) kills the process.

torch is imported only inside the replica (when the backend starts), never at module load.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import importlib
import logging
import os
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import ray
from ray import serve

from serve_app.backends import Backend, BackendDeadError, ModelInfo, make_backend
from serve_app.block_hash import prompt_block_keys
from serve_app.faults import Stage
from serve_app.metrics.loggers import RayStatLogger
from serve_app.serving.config import WORKER_NICENESS_ENV, ServeConfig
from serve_app.serving.delta_channel import ChannelAddress
from serve_app.serving.drain import shutdown_probe
from serve_app.serving.engine_watch import EngineWatch
from serve_app.serving.heap_trim import IdleHeapTrimmer
from serve_app.serving.pending_prefixes import PendingPrefixes
from serve_app.serving.stream_batching import GenerationChunk, batch_stream
from serve_app.serving.stream_mux import ChannelSenders
from serve_app.types import GenerateRequest, RequestFailedError

__all__ = ["GenerationChunk", "LLMServer", "batch_stream"]

logger = logging.getLogger("ray.serve")

# after the drain deadline: time for the aborted streams' last chunks to reach the ingress before
# Serve kills the replica
ABORT_GRACE_S = 5.0
DRAIN_POLL_S = 0.25


def import_attr(path: str) -> Any:
    """"package.module:attr" (or "package.module.attr") → the object."""
    module, sep, attr = path.partition(":")
    if not sep:
        module, _, attr = path.rpartition(".")
    return getattr(importlib.import_module(module), attr)


def configure_torch_threads(num_threads: int, in_this_process: bool = True) -> int:
    """Give torch `num_threads` intra-op threads (0: every core of the machine): torch in this process
    (unless `in_this_process` is False: the engine steps in a process of its own, which reads
    OMP_NUM_THREADS, and this one never loads torch).

    Ray sets OMP_NUM_THREADS=1 for actors with fractional CPUs, which would leave a CPU replica on a
    single core; the deployment's `num_cpus` is a scheduling hint, not a thread budget.
    """
    n = num_threads or os.cpu_count() or 1
    os.environ["OMP_NUM_THREADS"] = str(n)  # for anything that reads it later (an engine process, the kernel build)
    if in_this_process:
        import torch

        torch.set_num_threads(n)
    return n


def niceness_warning(niceness: int) -> str | None:
    """What to log when a CPU replica's process runs at `niceness` (None at 0 or below): at a positive one,
    every Ray daemon, client and build on the machine preempts the engine's threads."""
    if niceness <= 0:
        return None
    return (f"this replica runs at niceness {niceness}: any other process on the machine (Ray's daemons, clients) preempts "
            f"the engine's threads, which slows every step and first token; start Ray with {WORKER_NICENESS_ENV}=0 "
            "(make serve and the Docker image do)")


class _Tally:
    """What a request produced so far (for its log line); its first token marks its prompt prefilled."""

    def __init__(self, on_first_token: Callable[[], None]) -> None:
        self._on_first_token = on_first_token
        self.num_tokens = 0
        self.num_chunks = 0  # items the backend produced (the first is the admission delta)
        self.reason: str | None = None

    def add(self, num_tokens: int, reason: str | None) -> None:
        if num_tokens and not self.num_tokens:
            self._on_first_token()
        self.num_chunks += 1
        self.num_tokens += num_tokens
        self.reason = reason

    def cut(self, request: GenerateRequest) -> GenerationChunk:
        """The drain cut the request (the engine did not answer its abort): end the stream with an
        abort the caller can report, rather than a stream that just stops."""
        self.reason = "abort"
        return GenerationChunk("", (), True, "abort", len(request.prompt_token_ids or ()))


@serve.deployment(name="LLMServer")
class LLMServer:
    """One replica = one backend. Deployment options (replicas, CPUs, GPUs, limits, routing-stats
    period, health checks) are applied from the `ServeConfig` in `serve_app.serving.app`."""

    async def __init__(self, config: ServeConfig) -> None:
        self.config = config
        if config.backend_config.device == "cpu":
            threads = configure_torch_threads(config.torch_num_threads,
                                              not getattr(config.backend_config.options, "core_process", False))
        else:
            threads = 0
        # engine metrics on Ray's metrics port (ray_llm_*, names in serve_app.metrics.names), plus any extras
        stat_loggers = [RayStatLogger(config.model_name)]
        stat_loggers += [import_attr(path)(config) for path in config.stat_logger_factories]
        self._stat_loggers = stat_loggers
        # tests only: per-request fault injection (serve_app/faults.py)
        self._faults = import_attr(config.fault_hook_factory)(config) if config.fault_hook_factory else None
        self.backend: Backend = make_backend(config.backend_config, stat_loggers, self._faults)
        await self.backend.start()
        self._info = self.backend.model_info()
        self._in_flight: dict[str, asyncio.Task] = {}  # open `generate` calls by request id
        self._pending = PendingPrefixes(config.backend_config.kv_block_size)  # prompts not yet prefilled (routers read them)
        self._heap = IdleHeapTrimmer()
        self._cut: set[str] = set()  # requests the drain cancelled (their streams end with an abort chunk)
        # multiplexed streams, per ingress
        self._senders = ChannelSenders(config.stream_batch_interval_s, ray.get_runtime_context().get_node_id())
        self._drain_task = asyncio.get_running_loop().create_task(self._drain_on_shutdown())
        # None outside Serve (in-process tests), or when switched off (then only the health check acts)
        self._watch = EngineWatch.under_serve(self.backend.check_health) if config.exit_on_engine_death else None
        niceness = os.getpriority(os.PRIO_PROCESS, 0)
        if config.backend_config.device == "cpu" and (warning := niceness_warning(niceness)):
            logger.warning(warning)
        logger.info("LLMServer replica ready: model %s, context %d tokens, torch threads %s, niceness %d",
                    self._info.name, self._info.max_model_len, threads or "n/a", niceness)

    async def generate(self, request: GenerateRequest) -> AsyncIterator[GenerationChunk]:
        request = self._arrived(request)
        with self._tracked(request) as tally:
            try:
                async with contextlib.aclosing(batch_stream(self.backend.generate(request), self.config.stream_batch_interval_s)) as chunks:
                    async for chunk in chunks:
                        tally.add(len(chunk.token_ids), chunk.finish_reason)
                        self._check_stream(request)
                        yield chunk
            except asyncio.CancelledError:
                if request.request_id not in self._cut:
                    raise  # the caller went away
                yield tally.cut(request)
            except BackendDeadError:
                await self._hold_if_leaving(tally)
                raise

    async def _hold_if_leaving(self, tally: _Tally) -> None:
        """A call that sent nothing yet while the engine is dead waits for the replica to exit (if it
        is leaving): its caller then sees the actor dead and retries elsewhere, once routers have
        dropped this replica, instead of retrying into it."""
        if self._watch is not None and not tally.num_chunks:
            await self._watch.wait_for_exit()

    def _check_stream(self, request: GenerateRequest) -> None:
        """The `stream` stage's fault hook (tests only); a failure there is the request's own."""
        if self._faults is None:
            return
        try:
            self._faults.check(Stage.STREAM, request.request_id)
        except Exception as exc:  # noqa: BLE001 - the request's own fault: it alone fails (its engine request is aborted)
            logger.exception("streaming request %s failed; it is aborted", request.request_id)
            raise RequestFailedError(f"{Stage.STREAM} failed: {type(exc).__name__}: {exc}", Stage.STREAM) from exc

    async def generate_muxed(self, request: GenerateRequest, channel: ChannelAddress) -> AsyncIterator[GenerationChunk]:
        """`generate` with stream multiplexing (serving.stream_mux): the admission chunk and every
        delta up to the first token come on this call; every later delta goes over `channel` to the
        caller's ingress, together with that ingress's other streams. The call stays open while the
        request runs and ends with it (a stream the drain cut ends with its abort chunk here); it
        fails if the channel does, so the ingress never waits for deltas that cannot come."""
        request = self._arrived(request)
        sender = await self._senders.get(channel)
        with self._tracked(request) as tally:
            try:
                async with contextlib.aclosing(self.backend.generate(request)) as outputs:
                    token_sent = False
                    async for out in outputs:  # the first is the admission delta; invalid input raises there
                        tally.add(len(out.token_ids), out.finish_reason)
                        self._check_stream(request)
                        if token_sent:
                            sender.check()
                            sender.add(request.request_id, out)
                            continue
                        yield GenerationChunk.from_output(out)
                        if out.token_ids and not out.finished:
                            token_sent = True
                            sender.token_sent(request.request_id)
                if token_sent:
                    # the finish is due at once: its flush is already queued on the loop and runs
                    # before this resumes, so a channel that failed then fails this call
                    await asyncio.sleep(0)
                    sender.check()
            except BaseException as exc:  # cancelled (caller gone or the drain cut it) or failed: drop what is pending
                sender.forget(request.request_id)
                if isinstance(exc, BackendDeadError):
                    await self._hold_if_leaving(tally)
                if not isinstance(exc, asyncio.CancelledError) or request.request_id not in self._cut:
                    raise
                yield tally.cut(request)

    def _arrived(self, request: GenerateRequest) -> GenerateRequest:
        # the engine's timings (TTFT, queue time) start when the request reaches this replica: the
        # ingress's monotonic clock may be another machine's
        request = dataclasses.replace(request, arrival_time=time.monotonic())
        if self._faults is not None:
            self._faults.admit(request)
        return request

    @contextlib.contextmanager
    def _tracked(self, request: GenerateRequest) -> Iterator[_Tally]:
        """A request's bookkeeping while it runs: the drain's view of in-flight requests, the
        pending prefix routers see until its first token, idle heap trimming, and its log line."""
        tally = _Tally(lambda: self._pending.done(request.request_id))
        task = asyncio.current_task()
        if task is not None:
            self._in_flight[request.request_id] = task
        if request.prompt_token_ids is not None:
            self._pending.add(request.request_id, prompt_block_keys(
                request.prompt_token_ids, self._pending.block_size, request.cache_salt))
        try:
            yield tally
        finally:
            self._cut.discard(request.request_id)
            self._in_flight.pop(request.request_id, None)
            self._pending.done(request.request_id)
            self._heap.served()
            if self.config.log_requests:
                logger.info("request %s: prompt %r → %d tokens (%s)", request.request_id,
                            request.prompt if request.messages is None else request.messages, tally.num_tokens, tally.reason)
            else:
                logger.debug("request %s: %d tokens (%s)", request.request_id, tally.num_tokens, tally.reason)

    def model_info(self) -> ModelInfo:
        return self._info

    def routing_stats(self) -> dict[str, float | int]:
        """The same numbers `record_routing_stats` publishes (for probes and tests)."""
        return self.backend.routing_stats().as_dict()

    def record_routing_stats(self) -> dict[str, float | int]:
        # `sampled_at` (this machine's wall clock) lets the router tell how old the sample is and which
        # of its requests the sample already includes; it also makes every sample differ, so Serve's
        # controller re-broadcasts each one (it only pushes changed stats)
        # the prefix-cache update (`kv_*` keys, serve_app.engine.kv_events) goes only here: it is
        # incremental, and a probe calling `routing_stats()` must not consume a poll's delta
        self._heap.maybe_trim(len(self._in_flight))  # polled every period: an idle replica gives back freed heap
        return {**self.backend.routing_stats().as_dict(), **self.backend.prefix_cache_update(),
                "kv_pending": self._pending.published(), "sampled_at": time.time()}

    def check_health(self) -> None:
        self.backend.check_health()
        stalled_s = self.backend.seconds_without_progress()
        if stalled_s > self.config.engine_stall_timeout_s:
            raise BackendDeadError(f"engine stalled: requests pending and no step finished for {stalled_s:.0f} s "
                                   f"(engine_stall_timeout_s={self.config.engine_stall_timeout_s:g})")

    async def _drain_on_shutdown(self) -> None:
        started = shutdown_probe()
        if started is None:  # not under Serve (tests), or a Serve whose internals changed
            return
        while not started():
            await asyncio.sleep(DRAIN_POLL_S)
        await self.drain(self.config.drain_timeout_s)

    async def drain(self, timeout_s: float) -> int:
        """Let the in-flight requests finish for up to `timeout_s` (not at all if the engine is
        unhealthy), then abort the rest: their KV blocks are free when this returns, or, if the
        engine does not answer within `ABORT_GRACE_S` / 2 (hung), their calls are cancelled.
        Returns how many requests were cut."""
        healthy = self._is_healthy()
        logger.info("draining: %d in-flight request(s), up to %.0f s%s", len(self._in_flight), timeout_s,
                    "" if healthy else " (engine unhealthy: not waiting)")
        deadline = time.monotonic() + (timeout_s if healthy else 0.0)
        while self._in_flight and time.monotonic() < deadline:
            await asyncio.sleep(DRAIN_POLL_S)
        left = dict(self._in_flight)
        if left:
            logger.warning("drain: aborting %d request(s) still running", len(left))
            aborts = asyncio.gather(*(self.backend.abort(request_id) for request_id in left), return_exceptions=True)
            try:
                await asyncio.wait_for(aborts, ABORT_GRACE_S / 2)
            except TimeoutError:
                for request_id, task in left.items():
                    self._cut.add(request_id)
                    task.cancel()
        return len(left)

    def _is_healthy(self) -> bool:
        try:
            self.check_health()
        except Exception:  # noqa: BLE001 - any failure means: do not wait for this engine
            return False
        return True

    def __del__(self) -> None:
        task = getattr(self, "_drain_task", None)
        if task is not None:
            task.cancel()
        watch = getattr(self, "_watch", None)
        if watch is not None:
            watch.stop()
        backend = getattr(self, "backend", None)
        if backend is not None:
            backend.shutdown()
        # stop re-publishing gauges: a replica class used in-process (tests) would otherwise keep
        # exporting them from the driver into whatever Ray instance that process joins next
        for stat_logger in getattr(self, "_stat_loggers", ()):
            if hasattr(stat_logger, "close"):
                stat_logger.close()
