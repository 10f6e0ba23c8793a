"""AsyncLLMEngine: the engine behind an asyncio server.

The step loop runs in a background thread (torch releases the GIL in its kernels), so the event
loop is never blocked by a step. Requests and aborts reach the thread through a queue; outputs come
back to each request's asyncio queue with `call_soon_threadsafe`.

Contracts:
- `generate(request)` validates at once (ValueError naming the field) and then yields
  `RequestOutput` deltas until one has `finished=True`. With `announce=True` the first item is an
  empty delta (no tokens, not finished) yielded as soon as the request is queued, so a server can
  answer before the first token.
- Leaving the iteration early (client disconnect, cancellation) aborts the request; `abort()`
  returns once the request's KV blocks are free.
- A failure belongs to its request: if admitting, sampling or detokenizing one request raises, its
  caller gets `RequestFailedError` (the request is aborted, its KV blocks freed) and the engine goes
  on with the others (`LLMEngine`).
- If a step itself raises, every waiting caller gets `EngineDeadError` (no hang) and `check_health()`
  raises from then on; so does a request registered after the loop ended (at once, not at its
  timeout), and one still open when the engine is shut down.
- Heartbeat: `seconds_without_progress()` is how long the loop has had work (a request in the
  engine or on its way there) without coming round (finishing a step); 0 while it waits idle for
  requests. A hung step makes it grow; the replica's health check compares it with a bound.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass

from serve_app.engine.config import EngineConfig
from serve_app.engine.llm_engine import LLMEngine, StatLogger
from serve_app.engine.request import Request
from serve_app.faults import FaultHook, Stage
from serve_app.metrics.stats import EngineLoad
from serve_app.types import GenerateRequest, RequestFailedError, RequestOutput

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine loop stopped after an error; the replica must be replaced."""


@dataclass(frozen=True)
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue

    def put(self, item: RequestOutput | BaseException) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


class AsyncLLMEngine:
    def __init__(self, config: EngineConfig, stat_loggers: Iterable[StatLogger] = (), fault_hook: FaultHook | None = None) -> None:
        self.engine = LLMEngine(config, stat_loggers, fault_hook)
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}
        # prompt tokens of requests in the inbox (sent, not yet in the scheduler: it takes them in
        # between steps), so that `load()` counts them among the prompt tokens still to be read
        self._inbox_lock = threading.Lock()
        self._inbox_prompt_tokens = 0
        self._error: BaseException | None = None
        self._stopped = threading.Event()
        # heartbeat: when the loop last came round (a step finished, or it woke up with work), and
        # whether it is blocked waiting for requests with nothing to do (no progress expected then)
        self._heartbeat = time.monotonic()
        self._idle = True
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    @classmethod
    def from_kwargs(cls, model: str, stat_loggers: Iterable[StatLogger] = (), **kwargs) -> AsyncLLMEngine:
        return cls(EngineConfig.from_kwargs(model, **kwargs), stat_loggers)

    # ---- public API (event-loop side) -----------------------------------------------------------
    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    async def generate(self, request: GenerateRequest, announce: bool = False) -> AsyncIterator[RequestOutput]:
        self.check_health()
        if request.request_id in self._streams:
            raise ValueError(f"request_id: {request.request_id!r} is already in the engine")
        engine_request = Request.from_processed(self.engine.input_processor.process(request))  # ValueError on bad input
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        self._streams[request.request_id] = stream
        if self._stopped.is_set():  # the loop ended after the check above: it will never see this stream
            self._streams.pop(request.request_id, None)
            self.check_health()
            raise EngineDeadError("engine loop is not running")
        with self._inbox_lock:
            self._inbox_prompt_tokens += engine_request.num_prompt_tokens
        self._inbox.put(("add", request, engine_request))
        finished = False
        try:
            if announce:
                yield RequestOutput.admitted(request.request_id, engine_request.prompt_token_ids, request.arrival_time)
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self._inbox.put(("abort", request.request_id, None))
            self._streams.pop(request.request_id, None)

    async def abort(self, request_id: str) -> None:
        """Abort a request; returns when its KV blocks are free."""
        done = asyncio.get_running_loop().create_future()
        self._inbox.put(("abort", request_id, done))
        if not self._stopped.is_set():
            await done

    def load(self) -> EngineLoad:
        """Thread-safe enough for routing: plain counters read without locking."""
        load = self.engine.load()
        with self._inbox_lock:
            in_inbox = self._inbox_prompt_tokens
        return dataclasses.replace(load, num_pending_prompt_tokens=load.num_pending_prompt_tokens + in_inbox)

    def seconds_without_progress(self) -> float:
        """Seconds the loop has had work without coming round; 0 while it waits idle for requests."""
        if self._idle:
            return 0.0
        return max(0.0, time.monotonic() - self._heartbeat)

    def check_health(self) -> None:
        if self._error is not None:
            raise EngineDeadError(f"engine loop died: {self._error!r}") from self._error
        if self._stopped.is_set() or not self._thread.is_alive():
            raise EngineDeadError("engine loop is not running")

    def shutdown(self) -> None:
        self._stopped.set()
        self._inbox.put(("stop", None, None))
        self._thread.join(timeout=10)

    # ---- engine thread ---------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stopped.is_set():
                idle = not self.engine.has_unfinished_requests()
                self._idle = idle
                self._drain_inbox(block=idle)
                self._heartbeat = time.monotonic()  # before leaving idle: a reader never sees a stale beat
                self._idle = False
                if self._stopped.is_set():
                    break
                if self.engine.has_unfinished_requests():
                    outputs = self.engine.step()
                    self._deliver(outputs)
                    if not outputs and (wait := self.engine.next_wakeup_s()):
                        self._drain_inbox(block=True, timeout=min(wait, 0.01))
        except BaseException as exc:  # noqa: BLE001 - any failure must reach the callers
            logger.exception("engine loop died")
            self._error = exc
        finally:
            # set before the streams are read: `generate` checks it after registering a stream, so a
            # stream registered from now on fails there, and every earlier one is in this snapshot
            self._stopped.set()
            ended = EngineDeadError(f"engine loop died: {self._error!r}" if self._error is not None else "engine shut down")
            for stream in list(self._streams.values()):
                stream.put(ended)
            while True:  # release anyone waiting on an abort
                try:
                    kind, _, arg = self._inbox.get_nowait()
                except queue.Empty:
                    break
                if kind == "abort" and arg is not None:
                    _resolve(arg)

    def _drain_inbox(self, block: bool, timeout: float | None = None) -> None:
        while True:
            try:
                kind, payload, arg = self._inbox.get(block=block, timeout=timeout)
            except queue.Empty:
                return
            block = False
            if kind == "stop":
                return
            if kind == "add":
                self._add(payload, arg)
            elif kind == "abort":
                self._deliver(self.engine.abort([payload]))
                if arg is not None:
                    _resolve(arg)

    def _add(self, request: GenerateRequest, engine_request: Request) -> None:
        with self._inbox_lock:
            self._inbox_prompt_tokens -= engine_request.num_prompt_tokens
        stream = self._streams.get(request.request_id)
        if stream is None:  # the caller left before the request got here
            return
        try:
            self.engine.add_processed(request, engine_request)
        except Exception as exc:  # noqa: BLE001 - this request's own fault: nothing of it stays in the engine
            logger.exception("admitting request %s failed; it is aborted", request.request_id)
            stream.put(RequestFailedError(f"{Stage.PREPARE} failed: {type(exc).__name__}: {exc}", Stage.PREPARE))

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        # one wake-up of each event loop per step, carrying every stream's delta (not one per token:
        # each call_soon_threadsafe writes the loop's self-pipe)
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, RequestOutput | RequestFailedError]]] = {}
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is not None:  # a request aborted because one of its stages failed gets the error
                by_loop.setdefault(stream.loop, []).append((stream.queue, out if out.error is None else out.error))
        for loop, items in by_loop.items():
            loop.call_soon_threadsafe(_put_all, items)


def _put_all(items: list[tuple[asyncio.Queue, RequestOutput | RequestFailedError]]) -> None:
    for q, out in items:
        q.put_nowait(out)


def _resolve(future: asyncio.Future) -> None:
    future.get_loop().call_soon_threadsafe(lambda: future.done() or future.set_result(None))
