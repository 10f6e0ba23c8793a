"""The engine in a process of its own: the child's side (`ProcessLLMEngine` is the parent's).

Why: an engine thread shares its process's interpreter lock with the server's event loop, and its
OpenMP threads share the cores with it; every step waits for the loop to let go and every token the
loop sends waits for the step. In a process of its own the engine steps on its own lock, and a
server's CPU time no longer stretches its steps (reports/engine-process.md measures both).

Started as `python -m serve_app.engine.core_process FD`, where FD is this end of an anonymous socket
pair the parent made: no listening socket, only the parent and this child hold it. Messages are
length-prefixed pickles (`multiprocessing.connection.Connection`); both ends are this program,
started by the same user from the same installation, so nothing untrusted is ever unpickled.

parent → child: `Start` first; then ("add", GenerateRequest, engine Request), ("abort", request id,
  ticket or None), ("stop",).
child → parent: `Ready` (or `StartFailed`) once; then a `Frame` after each step, after the messages
  read between steps, when the loop goes idle, and at least every `HEARTBEAT_S` while it works.

The child dies with its parent (PR_SET_PDEATHSIG on Linux; elsewhere it exits when the socket closes),
so a replica that is killed never leaves an engine holding memory or a GPU.
"""

from __future__ import annotations

import logging
import os
import pickle
import signal
import sys
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from serve_app.engine.kv_events import KVEventCursor
from serve_app.faults import Stage
from serve_app.metrics.stats import EngineLoad
from serve_app.types import GenerateRequest, RequestFailedError, RequestOutput

logger = logging.getLogger(__name__)

HEARTBEAT_S = 0.5  # a working engine whose steps make no output still sends a frame this often


@dataclass(frozen=True)
class Start:
    config: Any  # EngineConfig
    fault_hook: Any = None  # tests only (serve_app/faults.py)


@dataclass(frozen=True)
class Ready:
    max_model_len: int
    vocab_size: int
    load: EngineLoad


@dataclass(frozen=True)
class StartFailed:
    message: str


@dataclass(frozen=True)
class KVDelta:
    """Prefix-cache changes since the previous frame (`KVEventLog.replay` applies them): the events in
    order, or every cached key when some events were dropped before they could be sent."""

    events: tuple[tuple[int, int], ...] = ()  # (stored 1 / removed 0, block key)
    snapshot: tuple[int, ...] | None = None
    finished: tuple[tuple[str, int, int], ...] = ()  # (request id, cached prompt tokens, prompt tokens)


@dataclass(frozen=True)
class Frame:
    """What happened in the engine since the previous frame."""

    outputs: tuple[RequestOutput, ...]
    stat_calls: tuple[tuple[str, tuple], ...]  # (StatLogger method, its arguments), in call order
    load: EngineLoad
    kv: KVDelta
    messages_read: int  # messages taken in since start
    prompt_tokens_read: int  # prompt tokens of the requests taken in since start
    aborted: tuple[int, ...] = ()  # tickets of the aborts done (the requests' blocks are free)
    idle: bool = False  # no request left: the loop waits for messages
    error: str | None = None  # the loop died (the last frame)


class StatOutbox:
    """The child's stat logger: keeps every call for the parent to replay on the real loggers."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple]] = []

    def record(self, scheduler_stats: Any, finished: Any) -> None:
        self.calls.append(("record", (scheduler_stats, finished)))

    def record_load(self, load: EngineLoad) -> None:
        self.calls.append(("record_load", (load,)))

    def record_paths(self, labels: dict[str, str]) -> None:
        self.calls.append(("record_paths", (labels,)))

    def take(self) -> tuple[tuple[str, tuple], ...]:
        calls, self.calls = tuple(self.calls), []
        return calls


def encode(message: Any) -> bytes:
    return pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)


def send(conn: Connection, message: Any) -> None:
    conn.send_bytes(encode(message))


def receive(conn: Connection) -> Any:
    return pickle.loads(conn.recv_bytes())


class CoreLoop:
    """Steps the engine and trades messages with the parent (see the module docstring)."""

    def __init__(self, conn: Connection, engine: Any, outbox: StatOutbox) -> None:
        self.conn, self.engine, self.outbox = conn, engine, outbox
        self._outputs: list[RequestOutput] = []
        self._aborted: list[int] = []
        self._messages_read = self._prompt_tokens_read = 0
        self._kv = KVEventCursor(engine.core.kv_events)
        self._last_frame = 0.0
        self._reported = (-1, True)  # (messages read, idle) in the last frame

    def run(self) -> None:
        try:
            while True:
                working = self.engine.has_unfinished_requests()
                if not working:
                    self._flush(idle=True)
                if not self._read(None if not working else 0):
                    return
                if self.engine.has_unfinished_requests():
                    outputs = self.engine.step()
                    self._outputs += outputs
                    if not outputs and (wait := self.engine.next_wakeup_s()):  # grouped admission holding prompts back
                        self._flush()
                        if not self._read(min(wait, 0.01)):
                            return
                self._flush()
        except BaseException as exc:  # noqa: BLE001 - the parent must hear of any failure
            logger.exception("engine loop died")
            try:
                self._flush(error=repr(exc))
            except Exception:  # noqa: BLE001 - then the parent learns it from the socket closing
                logger.exception("could not report the failure")

    def _read(self, timeout: float | None) -> bool:
        """Take in the parent's messages (waiting up to `timeout` for the first; None: until one comes).
        False: stop (asked to, or the parent is gone)."""
        try:
            while self.conn.poll(timeout):
                timeout = 0
                message = receive(self.conn)
                self._messages_read += 1
                if message[0] == "stop":
                    return False
                if message[0] == "add":
                    self._add(message[1], message[2])
                elif message[0] == "abort":
                    self._outputs += self.engine.abort([message[1]])
                    if message[2] is not None:
                        self._aborted.append(message[2])
        except EOFError:
            return False
        self._flush()  # an abort's outputs and ticket go at once, not after the next step
        return True

    def _add(self, request: GenerateRequest, engine_request: Any) -> None:
        self._prompt_tokens_read += engine_request.num_prompt_tokens
        try:
            self.engine.add_processed(request, engine_request)
        except Exception as exc:  # noqa: BLE001 - this request's own fault: nothing of it stays in the engine
            logger.exception("admitting request %s failed; it is aborted", request.request_id)
            error = RequestFailedError(f"{Stage.PREPARE} failed: {type(exc).__name__}: {exc}", Stage.PREPARE)
            self._outputs.append(RequestOutput.failed(request.request_id, error))

    def _flush(self, idle: bool = False, error: str | None = None) -> None:
        calls = self.outbox.take()
        kv = self._kv_delta()
        now = time.monotonic()
        news = self._outputs or calls or self._aborted or kv.events or kv.snapshot is not None or kv.finished
        if not (news or error or (self._messages_read, idle) != self._reported or now - self._last_frame >= HEARTBEAT_S):
            return
        frame = Frame(tuple(self._outputs), calls, self.engine.load(), kv, self._messages_read, self._prompt_tokens_read,
                      tuple(self._aborted), idle, error)
        self._outputs, self._aborted = [], []
        self._reported, self._last_frame = (self._messages_read, idle), now
        send(self.conn, frame)

    def _kv_delta(self) -> KVDelta:
        events, snapshot, finished = self._kv.take()
        return KVDelta(tuple(events), None if snapshot is None else tuple(snapshot), tuple(finished))


def _die_with_parent() -> None:
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def main(fd: int) -> None:
    _die_with_parent()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s engine-process %(name)s: %(message)s")
    conn = Connection(fd)
    start: Start = receive(conn)
    try:
        import torch

        from serve_app.engine.llm_engine import LLMEngine

        if threads := os.environ.get("OMP_NUM_THREADS"):  # the parent's thread budget (it set the variable)
            torch.set_num_threads(int(threads))
        outbox = StatOutbox()
        engine = LLMEngine(start.config, [outbox], start.fault_hook)
    except BaseException as exc:
        logger.exception("engine start failed")
        send(conn, StartFailed(f"{type(exc).__name__}: {exc}"))
        raise SystemExit(1) from exc
    send(conn, Ready(engine.max_model_len, engine.input_processor.vocab_size, engine.load()))
    CoreLoop(conn, engine, outbox).run()


if __name__ == "__main__":
    # through the module's own name, so that what it pickles (Ready, Frame) unpickles in the parent
    from serve_app.engine import core_process

    core_process.main(int(sys.argv[1]))
