"""ProcessLLMEngine: the engine behind an asyncio server, stepping in a process of its own.

The same front end as `AsyncLLMEngine` (the same streams, contracts and failure rules:
engine/request_streams.py), but the step loop, the model and the detokenizer run in a child process
(engine/core_process.py, which says why and what crosses the socket). This process keeps what a
server reads without waiting for a step:

- the input processor (requests are validated and tokenized here, so bad input fails in the caller);
- the engine's load as of its last frame, plus the prompt tokens sent that it has not taken in yet;
- a mirror of its prefix-cache event log (`kv_events`) and its step-cost fit (`step_cost()`), fed
  from the frames, for the routing stats;
- the stat loggers: every call the engine made is replayed on them here, in order, on the reader
  thread (as `AsyncLLMEngine` calls them on its engine thread). A logger that raises, like a step
  that raises, ends the engine: every open stream fails with `EngineDeadError`.

Health: the child exiting (crash, OOM kill) or reporting a failed loop fails every open stream and
makes `check_health()` raise. Heartbeat: `seconds_without_progress()` is how long the child has had
work (requests, or messages it has not read) without sending a frame; frames come after every step
and at least every `core_process.HEARTBEAT_S` while it works, so a hung step (or a stat logger that
hangs) makes it grow.

Imports no torch: the serving process that holds this front end never loads the engine.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import queue
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterable
from multiprocessing.connection import Connection
from typing import Any

from serve_app.engine import core_process
from serve_app.engine.config import EngineConfig
from serve_app.engine.core_process import Frame, Ready, Start, StartFailed
from serve_app.engine.grammar import check_structured
from serve_app.engine.kv_events import KVEventLog
from serve_app.engine.request import Request
from serve_app.engine.request_streams import EngineDeadError, RequestStreams, resolve
from serve_app.engine.step_cost import StepCost, StepCostFit
from serve_app.faults import Stage
from serve_app.input_processor import InputProcessor
from serve_app.metrics.stats import EngineLoad
from serve_app.types import GenerateRequest, RequestFailedError

__all__ = ["EngineDeadError", "ProcessLLMEngine"]

logger = logging.getLogger(__name__)

SHUTDOWN_TIMEOUT_S = 10.0


class ProcessLLMEngine(RequestStreams):
    def __init__(self, config: EngineConfig, stat_loggers: Iterable[Any] = (), fault_hook: Any = None) -> None:
        super().__init__()
        self._stat_loggers = list(stat_loggers)
        here, there = socket.socketpair()
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}  # the child imports what this process can
        self._child = subprocess.Popen([sys.executable, "-m", core_process.__name__, str(there.fileno())],
                                       pass_fds=(there.fileno(),), env=env)
        there.close()
        self._conn = Connection(here.detach())
        ready = self._start(Start(config, fault_hook))
        self.max_model_len = ready.max_model_len
        self.input_processor = InputProcessor(config.model.model, ready.vocab_size, ready.max_model_len,
                                              check_structured=check_structured)
        self.kv_events = KVEventLog()
        self._cost = StepCostFit()
        self._load = ready.load
        self._child_prompt_tokens = 0
        # heartbeat: when the child last sent a frame (or, while it was idle and had read everything, when
        # a message gave it work), whether it was idle then, and messages sent / read
        self._beat = time.monotonic()
        self._child_idle = True
        self._sent = self._read = 0
        self._tickets = itertools.count()
        self._aborts: dict[int, Any] = {}  # ticket → the `abort()` future waiting for it
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._writer = threading.Thread(target=self._write, name="engine-writer", daemon=True)
        self._reader = threading.Thread(target=self._read_frames, name="engine-reader", daemon=True)
        self._writer.start()
        self._reader.start()

    def _start(self, start: Start) -> Ready:
        """Send the engine's config and wait for it to load (StartFailed: its error; no answer: its exit code)."""
        try:
            core_process.send(self._conn, start)
            while not self._conn.poll(1.0):
                if self._child.poll() is not None:
                    raise EOFError
            answer = core_process.receive(self._conn)
        except (EOFError, OSError) as exc:
            self._kill()
            raise RuntimeError(f"the engine process exited while starting (exit code {self._child.poll()})") from exc
        if isinstance(answer, StartFailed):
            self._kill()
            raise RuntimeError(f"the engine process failed to start: {answer.message}")
        return answer

    # ---- what the serving layer reads ------------------------------------------------------------
    @property
    def pid(self) -> int:
        return self._child.pid

    def step_cost(self) -> StepCost | None:
        return self._cost.cost()

    def load(self) -> EngineLoad:
        load = self._load
        return dataclasses.replace(load, num_pending_prompt_tokens=load.num_pending_prompt_tokens + self._unread)

    def seconds_without_progress(self) -> float:
        with self._lock:
            working = not self._child_idle or self._sent > self._read
            beat = self._beat
        return max(0.0, time.monotonic() - beat) if working else 0.0

    def shutdown(self) -> None:
        """Stop the child (asked first, killed after `SHUTDOWN_TIMEOUT_S`) and both threads; idempotent."""
        self._stopped.set()
        self._outbox.put(core_process.encode(("stop",)))
        self._outbox.put(None)  # the writer's end (also after the child died)
        if self._child.poll() is None:
            try:
                self._child.wait(SHUTDOWN_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                logger.warning("the engine process did not stop within %.0f s; killing it", SHUTDOWN_TIMEOUT_S)
        self._kill()
        self._reader.join(SHUTDOWN_TIMEOUT_S)
        self._conn.close()

    # ---- RequestStreams ----------------------------------------------------------------------------
    def _submit(self, kind: str, payload: Any, arg: Any) -> None:
        if kind == "abort" and arg is not None:
            ticket = next(self._tickets)
            self._aborts[ticket] = arg
            arg = ticket
            if self._stopped.is_set():  # no answer will come: nothing of the request is left to free
                resolve(self._aborts.pop(ticket))
                return
        try:  # here, not in the writer: a request that cannot be encoded fails alone, in its caller
            data = core_process.encode((kind, payload, arg))
        except Exception as exc:  # noqa: BLE001 - this request's own fault
            raise RequestFailedError(f"{Stage.PREPARE} failed: it cannot be sent to the engine process: {exc!r}", Stage.PREPARE) from exc
        with self._lock:
            if self._child_idle and self._sent == self._read:  # the child had nothing to do until now
                self._beat = time.monotonic()
            self._sent += 1
        self._outbox.put(data)

    def _process(self, request: GenerateRequest) -> Request:
        return Request.from_processed(self.input_processor.process(request))

    def _alive(self) -> bool:
        return self._child.poll() is None and self._reader.is_alive()

    # ---- the writer and reader threads ---------------------------------------------------------------
    def _write(self) -> None:
        # its own thread: a long prompt may fill the socket while the child is in a step, and the event
        # loop must never wait for that
        while (data := self._outbox.get()) is not None:
            try:
                self._conn.send_bytes(data)
            except OSError:
                return  # the child is gone: the reader says so

    def _read_frames(self) -> None:
        error: BaseException | None = None
        try:
            while True:
                frame: Frame = core_process.receive(self._conn)
                self._apply(frame)
                if frame.error is not None:
                    error = EngineDeadError(f"the engine process's loop died: {frame.error}")
                    break
        except (EOFError, OSError):
            if not self._stopped.is_set():
                try:
                    code = self._child.wait(SHUTDOWN_TIMEOUT_S)
                except subprocess.TimeoutExpired:
                    code = "none: it closed its socket and did not exit"
                error = EngineDeadError(f"the engine process exited (exit code {code})")
        except BaseException as exc:  # noqa: BLE001 - a stat logger that raises ends the engine, as in a thread
            logger.exception("replaying the engine's stats failed; the engine is stopped")
            error = exc
        finally:
            if error is not None:
                logger.error("engine ended: %r", error)
            self._end(error)
            self._kill()
            for ticket in list(self._aborts):  # release anyone waiting on an abort
                if (future := self._aborts.pop(ticket, None)) is not None:
                    resolve(future)

    def _apply(self, frame: Frame) -> None:
        with self._lock:
            self._beat = time.monotonic()
            self._child_idle = frame.idle
            self._read = frame.messages_read
        self._load = frame.load
        self._prompt_tokens_read(frame.prompt_tokens_read - self._child_prompt_tokens)
        self._child_prompt_tokens = frame.prompt_tokens_read
        self.kv_events.replay(frame.kv.events, frame.kv.snapshot, frame.kv.finished)
        for name, args in frame.stat_calls:
            if name == "record" and (stats := args[0]) is not None:
                self._cost.observe(stats.num_prefill_tokens, stats.num_decode_tokens, stats.step_duration_s)
            for stat_logger in self._stat_loggers:
                if (method := getattr(stat_logger, name, None)) is not None:
                    method(*args)
        self._deliver(list(frame.outputs))
        for ticket in frame.aborted:
            if (future := self._aborts.pop(ticket, None)) is not None:
                resolve(future)

    def _kill(self) -> None:
        if self._child.poll() is None:
            self._child.kill()
            self._child.wait()
