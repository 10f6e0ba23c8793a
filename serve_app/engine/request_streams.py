"""What both asyncio front ends of the engine share: one stream per request, fed from the engine's side.

`RequestStreams` is the event-loop half of an engine that steps elsewhere: in a thread of this process
(`AsyncLLMEngine`) or in a process of its own (`ProcessLLMEngine`). A subclass says how a message
reaches its engine (`_submit`) and feeds outputs back with `_deliver`; this class owns the streams,
the request protocol and the failure contract:

- `generate(request)` validates at once (ValueError naming the field), then yields `RequestOutput`
  deltas until one has `finished=True`. With `announce=True` the first item is an empty delta (no
  tokens, not finished), yielded as soon as the request is on its way to the engine.
- Leaving the iteration early (client disconnect, cancellation) aborts the request; `abort()` returns
  once the engine has freed the request's KV blocks.
- A failure belongs to its request: an output carrying an error ends that request's stream with its
  `RequestFailedError`, and nothing else.
- `_end(error)` (the engine is gone, or shut down) ends every open stream with `EngineDeadError`;
  from then on `check_health()` raises, and so does `generate` for a request registered later (at
  once, never at its timeout).

Imports no torch: the process front end runs in a server that never loads the engine.
"""

from __future__ import annotations

import asyncio
import threading
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass
from typing import Any, Self

from serve_app.engine.config import EngineConfig
from serve_app.types import GenerateRequest, RequestFailedError, RequestOutput


class EngineDeadError(RuntimeError):
    """The engine loop stopped after an error; the replica must be replaced."""


@dataclass(frozen=True)
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue

    def put(self, item: RequestOutput | BaseException) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


class RequestStreams(ABC):
    """The streams of the requests in one engine (see the module docstring). A front end is built as
    `Engine(config: EngineConfig, stat_loggers=(), fault_hook=None)`."""

    @classmethod
    def from_kwargs(cls, model: str, stat_loggers: Iterable[Any] = (), **kwargs: Any) -> Self:
        """The front end of an engine built from `EngineConfig.from_kwargs(model, **kwargs)`."""
        return cls(EngineConfig.from_kwargs(model, **kwargs), stat_loggers)

    def __init__(self) -> None:
        self._streams: dict[str, _Stream] = {}
        self._error: BaseException | None = None
        self._stopped = threading.Event()
        # prompt tokens sent to the engine that it has not taken in yet: `load()` counts them among the
        # prompt tokens still to be read
        self._lock = threading.Lock()
        self._unread_prompt_tokens = 0

    # ---- what a front end provides --------------------------------------------------------------
    @abstractmethod
    def _submit(self, kind: str, payload: Any, arg: Any) -> None:
        """Pass ("add", GenerateRequest, engine Request) or ("abort", request id, future or None) to the engine."""

    @abstractmethod
    def _process(self, request: GenerateRequest) -> Any:
        """Validate and tokenize `request` into the engine's `Request` (ValueError naming the field)."""

    @abstractmethod
    def _alive(self) -> bool:
        """Whether the engine's loop is still running."""

    # ---- the event-loop side ----------------------------------------------------------------------
    async def generate(self, request: GenerateRequest, announce: bool = False) -> AsyncIterator[RequestOutput]:
        self.check_health()
        if request.request_id in self._streams:
            raise ValueError(f"request_id: {request.request_id!r} is already in the engine")
        engine_request = self._process(request)
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        self._streams[request.request_id] = stream
        if self._stopped.is_set():  # the loop ended after the check above: it will never see this stream
            self._streams.pop(request.request_id, None)
            self.check_health()
            raise EngineDeadError("engine loop is not running")
        self._prompt_tokens_sent(engine_request.num_prompt_tokens)
        try:
            self._submit("add", request, engine_request)
        except BaseException:  # it never reached the engine: nothing of it may stay counted or registered
            self._prompt_tokens_read(engine_request.num_prompt_tokens)
            self._streams.pop(request.request_id, None)
            raise
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
                self._submit("abort", request.request_id, None)
            self._streams.pop(request.request_id, None)

    async def abort(self, request_id: str) -> None:
        """Abort a request; returns when its KV blocks are free."""
        done = asyncio.get_running_loop().create_future()
        self._submit("abort", request_id, done)
        if not self._stopped.is_set():
            await done

    def check_health(self) -> None:
        if self._error is not None:
            raise EngineDeadError(f"engine loop died: {self._error!r}") from self._error
        if self._stopped.is_set() or not self._alive():
            raise EngineDeadError("engine loop is not running")

    # ---- the engine side ----------------------------------------------------------------------------
    def _prompt_tokens_sent(self, n: int) -> None:
        with self._lock:
            self._unread_prompt_tokens += n

    def _prompt_tokens_read(self, n: int) -> None:
        with self._lock:
            self._unread_prompt_tokens -= n

    @property
    def _unread(self) -> int:
        with self._lock:
            return self._unread_prompt_tokens

    def _has_stream(self, request_id: str) -> bool:
        return request_id in self._streams

    def _fail(self, request_id: str, error: RequestFailedError) -> None:
        if (stream := self._streams.get(request_id)) is not None:
            stream.put(error)

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

    def _end(self, error: BaseException | None) -> None:
        """The engine's loop is over (`error`: why; None: shut down): fail every open stream."""
        if error is not None and self._error is None:
            self._error = error
        # set before the streams are read: `generate` checks it after registering a stream, so a
        # stream registered from now on fails there, and every earlier one is in this snapshot
        self._stopped.set()
        ended = EngineDeadError(f"engine loop died: {self._error!r}" if self._error is not None else "engine shut down")
        for stream in list(self._streams.values()):
            stream.put(ended)


def _put_all(items: list[tuple[asyncio.Queue, RequestOutput | RequestFailedError]]) -> None:
    for q, out in items:
        q.put_nowait(out)


def resolve(future: asyncio.Future) -> None:
    """Resolve an `abort()` future from the engine's side (any thread)."""
    future.get_loop().call_soon_threadsafe(lambda: future.done() or future.set_result(None))
