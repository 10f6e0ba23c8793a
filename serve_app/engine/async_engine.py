"""AsyncLLMEngine: the engine behind an asyncio server, stepping in a thread of this process.

The step loop runs in a background thread (torch releases the GIL in its kernels), so the event
loop is never blocked by a step. Requests and aborts reach the thread through a queue; outputs come
back to each request's asyncio queue with `call_soon_threadsafe`. `ProcessLLMEngine`
(engine/process_engine.py) is the same front end with the loop in a process of its own.

Contracts (the streams' own: engine/request_streams.py):
- `generate(request)` validates at once (ValueError naming the field) and then yields
  `RequestOutput` deltas until one has `finished=True`; leaving early aborts the request, and
  `abort()` returns once the request's KV blocks are free.
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

import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Iterable
from typing import Any

from serve_app.engine.config import EngineConfig
from serve_app.engine.kv_events import KVEventLog
from serve_app.engine.llm_engine import LLMEngine, StatLogger
from serve_app.engine.request import Request
from serve_app.engine.request_streams import EngineDeadError, RequestStreams, resolve
from serve_app.engine.step_cost import StepCost
from serve_app.faults import FaultHook, Stage
from serve_app.input_processor import InputProcessor
from serve_app.metrics.stats import EngineLoad
from serve_app.types import GenerateRequest, RequestFailedError

__all__ = ["AsyncLLMEngine", "EngineDeadError"]

logger = logging.getLogger(__name__)


class AsyncLLMEngine(RequestStreams):
    def __init__(self, config: EngineConfig, stat_loggers: Iterable[StatLogger] = (), fault_hook: FaultHook | None = None) -> None:
        super().__init__()
        self.engine = LLMEngine(config, stat_loggers, fault_hook)
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        # heartbeat: when the loop last came round (a step finished, or it woke up with work), and
        # whether it is blocked waiting for requests with nothing to do (no progress expected then)
        self._heartbeat = time.monotonic()
        self._idle = True
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    # ---- what the serving layer reads ------------------------------------------------------------
    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def input_processor(self) -> InputProcessor:
        return self.engine.input_processor

    @property
    def kv_events(self) -> KVEventLog:
        return self.engine.core.kv_events

    def step_cost(self) -> StepCost | None:
        return self.engine.core.step_cost.cost()

    def load(self) -> EngineLoad:
        """Thread-safe enough for routing: plain counters read without locking."""
        load = self.engine.load()
        return dataclasses.replace(load, num_pending_prompt_tokens=load.num_pending_prompt_tokens + self._unread)

    def seconds_without_progress(self) -> float:
        """Seconds the loop has had work without coming round; 0 while it waits idle for requests."""
        if self._idle:
            return 0.0
        return max(0.0, time.monotonic() - self._heartbeat)

    def shutdown(self) -> None:
        self._stopped.set()
        self._inbox.put(("stop", None, None))
        self._thread.join(timeout=10)

    # ---- RequestStreams ----------------------------------------------------------------------------
    def _submit(self, kind: str, payload: Any, arg: Any) -> None:
        self._inbox.put((kind, payload, arg))

    def _process(self, request: GenerateRequest) -> Request:
        return Request.from_processed(self.engine.input_processor.process(request))

    def _alive(self) -> bool:
        return self._thread.is_alive()

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
            self._end(self._error)
            while True:  # release anyone waiting on an abort
                try:
                    kind, _, arg = self._inbox.get_nowait()
                except queue.Empty:
                    break
                if kind == "abort" and arg is not None:
                    resolve(arg)

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
                    resolve(arg)

    def _add(self, request: GenerateRequest, engine_request: Request) -> None:
        self._prompt_tokens_read(engine_request.num_prompt_tokens)
        if not self._has_stream(request.request_id):  # the caller left before the request got here
            return
        try:
            self.engine.add_processed(request, engine_request)
        except Exception as exc:  # noqa: BLE001 - this request's own fault: nothing of it stays in the engine
            logger.exception("admitting request %s failed; it is aborted", request.request_id)
            self._fail(request.request_id, RequestFailedError(f"{Stage.PREPARE} failed: {type(exc).__name__}: {exc}", Stage.PREPARE))
