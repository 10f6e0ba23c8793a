"""Ingress-side request streams: one `ChoiceStream` per choice, merged by a `ChoicePump`.

- `ChoiceStream.start()` sends one `GenerateRequest` to an LLMServer replica and waits for its first
  chunk (the replica's admission chunk, before any token), so that invalid input (raised by the
  engine on the first item), backpressure and an unavailable replica surface *before* the HTTP status
  is sent, and a stream's headers need not wait for the first token. A replica (or its engine) that dies
  before the first chunk is retried on another replica (`retries` times): nothing reached the client.
- `MuxedChoiceStream` is the same stream with `stream_multiplexing`: the chunks up to the first
  token come on the replica call, the rest over the ingress's channel (`serving.stream_mux`).
- `ChoicePump` drains the remaining chunks of every choice in one background task into a queue, so
  the HTTP handler can wait on it with a deadline (cancelling a queue read is always safe) and a
  client disconnect or a timeout cancels the pump, which cancels the replica calls, which aborts the
  requests in the engine and frees their KV blocks.
- A slow reader cannot make the ingress hold an unbounded backlog: the pump counts what it holds
  (tokens plus their logprob alternatives) and past `max_buffered` it drops the backlog, cancels the
  replica calls (KV freed) and ends the response with a `stream_buffer_overflow` error.
- Fan-out (`n` > 1, a batch of prompts): Serve gives every handle call made while serving one HTTP
  request that request's internal id, but routers and replicas track calls by that id (a custom
  `RequestRouter` without `FIFOMixin` matches routing results to calls by it: two calls with one id
  and one of them is never routed). Each choice of a fan-out is therefore sent under its own id
  (`parent-id/index`), which keeps the parent visible in logs.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator, Iterator
from typing import Any

from serve_app.serving.errors import APIError, is_retriable
from serve_app.serving.llm_server import GenerationChunk
from serve_app.serving.stream_mux import MuxReceiver
from serve_app.types import GenerateRequest

_DONE = object()
_CALL_ENDED = object()  # a multiplexed stream's replica call ended without an error

# How long a multiplexed stream waits for its last chunks once its replica call has ended: the
# replica ends the call right after writing them, so they are normally there within milliseconds.
LAST_CHUNKS_TIMEOUT_S = 10.0


@contextlib.contextmanager
def own_serve_request_id(suffix: str) -> Iterator[None]:
    """Handle calls made inside get the current Serve request's internal id + `suffix` as their own.

    Uses Serve's request-context variable (`ray.serve.context`, not a public API); if that changes,
    calls keep the parent's id (correct for routers with FIFO matching, e.g. Serve's default)."""
    try:
        from ray.serve import context as serve_context

        current = serve_context._get_serve_request_context()
        own = dataclasses.replace(current, _internal_request_id=f"{current._internal_request_id or 'req'}/{suffix}")
        token = serve_context._serve_request_context.set(own)
    except (ImportError, AttributeError, TypeError):  # pragma: no cover - a future Serve without it
        yield
        return
    try:
        yield
    finally:
        serve_context._serve_request_context.reset(token)


class ChoiceStream:
    """One generation request (one choice of one prompt) on an LLMServer replica.

    `call_suffix` (fan-out only): the replica call runs under its own Serve request id (see above)."""

    def __init__(self, handle: Any, request: GenerateRequest, retries: int = 1, call_suffix: str = "") -> None:
        self._handle = handle
        self.request = request
        self._retries = retries
        self._call_suffix = call_suffix
        self._response: Any = None
        self.finished = False

    def _remote(self) -> Any:
        return self._handle.options(stream=True).generate.remote(self.request)

    def _call(self) -> Any:
        if not self._call_suffix:
            return self._remote()
        with own_serve_request_id(self._call_suffix):
            return self._remote()

    async def start(self) -> GenerationChunk:
        """Send the request; return its first chunk (raises what the replica raised)."""
        attempt = 0
        while True:
            self._response = self._call()
            try:
                chunk = await self._response.__anext__()
            except StopAsyncIteration:
                raise APIError(500, "the model replica ended the stream without output", code="engine_error") from None
            except Exception as exc:
                self._cancel()
                if attempt < self._retries and is_retriable(exc):
                    attempt += 1
                    continue
                raise
            return self._check(chunk)

    def _check(self, chunk: GenerationChunk) -> GenerationChunk:
        if chunk.finished:
            self.finished = True
            if chunk.finish_reason == "abort":
                raise APIError(503, "the request was aborted by the server; retry", code="aborted", headers={"Retry-After": "1"})
        return chunk

    def rest(self) -> AsyncIterator[GenerationChunk]:
        """The chunks after the first one."""
        return self._from_call()

    async def _from_call(self, until_token: bool = False) -> AsyncIterator[GenerationChunk]:
        """The replica call's next chunks until the request finishes (`until_token`: or until one
        carries a token)."""
        while not self.finished:
            try:
                chunk = await self._response.__anext__()
            except StopAsyncIteration:
                raise APIError(500, "the model replica ended the stream before finishing", code="engine_error") from None
            yield self._check(chunk)
            if until_token and chunk.token_ids:
                return

    def _cancel(self) -> None:
        if self._response is not None:
            with contextlib.suppress(Exception):
                self._response.cancel()

    def close(self) -> None:
        """Cancel the replica call unless the request finished (aborts it in the engine)."""
        if not self.finished:
            self._cancel()


class MuxedChoiceStream(ChoiceStream):
    """A `ChoiceStream` whose chunks after the first token come over this ingress's channel
    (`serving.stream_mux`). The replica call stays open until the request ends: it fails if the
    replica or its channel does (that error ends the stream), and a stream the replica's drain cut
    gets its abort chunk on it; cancelling it (`close`) aborts the request, as without multiplexing.
    A call that ended while the stream still misses its last chunks ends the stream with an error
    after `LAST_CHUNKS_TIMEOUT_S`, never a hang."""

    def __init__(self, handle: Any, request: GenerateRequest, receiver: MuxReceiver, retries: int = 1,
                 call_suffix: str = "") -> None:
        super().__init__(handle, request, retries, call_suffix)
        self._receiver = receiver
        self._queue = receiver.register(request.request_id)

    def _remote(self) -> Any:
        return self._handle.options(stream=True).generate_muxed.remote(self.request, self._receiver.address)

    async def _watch_call(self) -> None:
        try:
            async for chunk in self._response:  # normally none: the call just ends with the request
                self._queue.put_nowait(chunk)
        except Exception as exc:  # noqa: BLE001 - handed to the reader, which raises it
            self._queue.put_nowait(exc)
        else:
            self._queue.put_nowait(_CALL_ENDED)

    async def rest(self) -> AsyncIterator[GenerationChunk]:
        # up to the first token on the call; whatever the channel delivers meanwhile waits in the queue
        async for chunk in self._from_call(until_token=True):
            yield chunk
        if not self.finished:
            self._receiver.keep(asyncio.ensure_future(self._watch_call()))
        call_ended = False
        while not self.finished:
            try:
                item = await (asyncio.wait_for(self._queue.get(), LAST_CHUNKS_TIMEOUT_S) if call_ended else self._queue.get())
            except TimeoutError:
                raise APIError(500, "the model replica finished the request but its last chunks never arrived",
                               code="engine_error") from None
            if item is _CALL_ENDED:
                call_ended = True
                continue
            if isinstance(item, BaseException):
                raise item
            yield self._check(item)

    def close(self) -> None:
        super().close()
        self._receiver.unregister(self.request.request_id)


async def start_all(streams: list[ChoiceStream]) -> list[GenerationChunk]:
    """Start every stream concurrently; on the first failure cancel the others and raise it."""
    tasks = [asyncio.ensure_future(s.start()) for s in streams]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for s in streams:
            s.close()
        raise


def buffer_weight(chunk: GenerationChunk) -> int:
    """What a queued chunk costs the ingress, in tokens: each token, and each logprob alternative."""
    return max(1, len(chunk.token_ids) + sum(len(lp.top) for lp in chunk.logprobs or ()))


class StreamBufferOverflow(APIError):
    def __init__(self, limit: int) -> None:
        super().__init__(503, f"the client read this stream too slowly: more than {limit} tokens were waiting to be sent; "
                         "the request was stopped", code="stream_buffer_overflow", headers={"Retry-After": "1"})


class ChoicePump:
    """Merges the remaining chunks of several started streams into one queue of (index, chunk), holding
    at most `max_buffered` tokens' worth (`buffer_weight`) that the reader has not taken yet."""

    def __init__(self, streams: list[ChoiceStream], max_buffered: int | None = None) -> None:
        self.streams = streams
        self._queue: asyncio.Queue = asyncio.Queue()
        self._task: asyncio.Task | None = None
        self._num_done = 0
        self.max_buffered = max_buffered
        self.buffered = 0

    def start(self) -> ChoicePump:
        self._task = asyncio.create_task(self._run())
        return self

    async def _drain(self, index: int, stream: ChoiceStream) -> None:
        async for chunk in stream.rest():
            self.buffered += buffer_weight(chunk)
            if self.max_buffered is not None and self.buffered > self.max_buffered:
                raise StreamBufferOverflow(self.max_buffered)
            self._queue.put_nowait((index, chunk))

    async def _run(self) -> None:
        try:
            async with asyncio.TaskGroup() as group:
                for i, s in enumerate(self.streams):
                    group.create_task(self._drain(i, s))
        except BaseExceptionGroup as eg:
            error = _first_error(eg)
            if isinstance(error, StreamBufferOverflow):  # stop the work now and tell the reader next
                for s in self.streams:
                    s.close()
                while not self._queue.empty():
                    self._queue.get_nowait()
                self.buffered = 0
            self._queue.put_nowait((None, error))
            return
        self._queue.put_nowait((None, _DONE))

    async def next_batch(self, timeout_s: float) -> list[tuple[int, GenerationChunk]] | None:
        """Wait up to `timeout_s` for chunks; return every chunk available now (None: all finished).

        Raises the first error of any stream, or TimeoutError.
        """
        async with asyncio.timeout(max(timeout_s, 0.0)):
            item = await self._queue.get()
        batch: list[tuple[int, GenerationChunk]] = []
        while True:
            index, payload = item
            if index is None:  # end marker: keep it queued so that later calls see it too
                self._queue.put_nowait(item)
                if batch or payload is _DONE:
                    return batch or None
                raise payload
            batch.append((index, payload))
            self.buffered -= buffer_weight(payload)
            try:
                item = self._queue.get_nowait()
            except asyncio.QueueEmpty:
                return batch

    async def close(self) -> None:
        """Stop draining and cancel every unfinished replica call."""
        if self._task is not None and not self._task.done():
            self._task.cancel()
            with contextlib.suppress(BaseException):
                await self._task
        for s in self.streams:
            s.close()


def _first_error(eg: BaseExceptionGroup) -> BaseException:
    exc: BaseException = eg
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    return exc
