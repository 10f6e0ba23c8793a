"""Stream batching in the LLMServer replica: a stream's deltas merged into fewer items per interval.

Every item a replica yields costs CPU in the replica, the ingress, the HTTP proxy and Ray's core
(reports/README.md, "The serving path"): merging a stream's deltas cuts that cost by the number of deltas
merged. The latency contract: the first delta and the finish are sent at once (TTFT and end-to-end
latency untouched), and any other delta is sent at most `interval_s` after it arrived: a pending
delta is flushed by a timer when the interval since the previous item expires, whether or not
another delta follows (an engine stall does not hold tokens back). So batching adds at most
`interval_s` to any token's latency, and to inter-token latency.

`StreamBatcher` is the policy (pure, clock passed in, unit-tested against that bound);
`batch_stream` drives it: one reader task takes the backend's deltas as they come, the consumer
wakes only to send (first delta, finish, deadline), so a merged delta costs an append, not a
generator round trip.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from serve_app.types import RequestOutput, TokenLogprob


@dataclass(frozen=True)
class GenerationChunk:
    """What crosses the replica → ingress hop for each delta (no prompt ids, no metrics objects)."""

    text: str
    token_ids: tuple[int, ...]
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" on the last chunk
    num_prompt_tokens: int
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache (set on the last chunk)
    logprobs: tuple[TokenLogprob, ...] | None = None  # one per token when the request asked for logprobs

    @classmethod
    def from_output(cls, out: RequestOutput) -> GenerationChunk:
        reason = None if out.finish_reason is None else str(out.finish_reason)
        return cls(out.text, tuple(out.token_ids), out.finished, reason, out.num_prompt_tokens, _cached(out),
                   None if out.logprobs is None else tuple(out.logprobs))

    @classmethod
    def merge(cls, outs: list[RequestOutput]) -> GenerationChunk:
        """Consecutive deltas of one request as a single delta."""
        if len(outs) == 1:
            return cls.from_output(outs[0])
        last = outs[-1]
        reason = None if last.finish_reason is None else str(last.finish_reason)
        logprobs = None if outs[0].logprobs is None else tuple(lp for o in outs for lp in (o.logprobs or ()))
        return cls("".join(o.text for o in outs), tuple(t for o in outs for t in o.token_ids), last.finished,
                   reason, last.num_prompt_tokens, _cached(last), logprobs)


def _cached(out: RequestOutput) -> int:
    return out.metrics.num_cached_tokens if out.finished and out.metrics is not None else 0


class StreamBatcher:
    """When to send a stream's pending deltas (the policy; times from the caller's clock).

    `add(out)` queues a delta; `due(now)` says whether the pending deltas must go now: the
    first delta of the stream, a finished one, or `interval_s` after the previous send;
    `deadline()` is when they will be due at the latest (None: nothing pending); `take(now)` returns
    them as one chunk and restarts the interval.
    """

    def __init__(self, interval_s: float, token_sent_at: float | None = None) -> None:
        """`token_sent_at`: when the stream's first token went out by another way, if it did."""
        self.interval_s = interval_s
        self._pending: list[RequestOutput] = []
        self._last_send = token_sent_at
        self._sent_token = token_sent_at is not None  # until the first token has gone, nothing is held (TTFT untouched)

    def add(self, out: RequestOutput) -> None:
        self._pending.append(out)

    @property
    def pending(self) -> bool:
        return bool(self._pending)

    def deadline(self) -> float | None:
        if not self._pending:
            return None
        if not self._sent_token or self._pending[-1].finished:
            return -float("inf")  # the admission delta, the first token, or the finish: at once
        return self._last_send + self.interval_s

    def due(self, now: float) -> bool:
        deadline = self.deadline()
        return deadline is not None and now >= deadline

    def take(self, now: float) -> GenerationChunk:
        chunk = GenerationChunk.merge(self._pending)
        self._pending = []
        self._last_send = now
        self._sent_token = self._sent_token or bool(chunk.token_ids)
        return chunk


async def batch_stream(outputs: AsyncIterator[RequestOutput], interval_s: float,
                       clock: Callable[[], float] = time.monotonic) -> AsyncIterator[GenerationChunk]:
    """The backend's deltas as chunks; with `interval_s` > 0, merged per `StreamBatcher`.

    Leaving early (or an error) closes `outputs`, which aborts the request and frees its KV blocks.
    """
    if interval_s <= 0:
        async with contextlib.aclosing(outputs):
            async for out in outputs:
                yield GenerationChunk.from_output(out)
        return
    batcher = StreamBatcher(interval_s)
    loop = asyncio.get_running_loop()
    wake: asyncio.Future = loop.create_future()
    ended: list[BaseException | None] = []  # [None] at the end of the stream, [exc] on its error

    def poke() -> None:
        if not wake.done():
            wake.set_result(None)

    async def read() -> None:
        try:
            async for out in outputs:
                was_pending = batcher.pending
                batcher.add(out)
                if not was_pending or out.finished:  # a deadline starts, or the finish: the consumer looks
                    poke()
            ended.append(None)
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer, which raises it
            ended.append(exc)
        finally:
            poke()

    reader = asyncio.ensure_future(read())
    try:
        while True:
            if batcher.due(clock()):
                yield batcher.take(clock())
                continue
            if ended and not batcher.pending:
                if ended[0] is not None:
                    raise ended[0]
                return
            if ended:  # the stream ended: whatever is pending goes now
                yield batcher.take(clock())
                continue
            deadline = batcher.deadline()
            wake = loop.create_future()
            timeout = None if deadline is None else max(0.0, deadline - clock())
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(wake, timeout)
    finally:
        if not reader.done():
            reader.cancel()
            with contextlib.suppress(BaseException):
                await reader
        with contextlib.suppress(BaseException):
            await outputs.aclose()  # type: ignore[attr-defined]
