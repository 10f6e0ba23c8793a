"""Stream multiplexing: every delta an LLMServer replica owes one ingress replica travels in one
frame per flush over a direct connection, instead of one Serve streaming item per stream.

Each Serve streaming item costs CPU in the replica, Ray's core and the ingress (docs/serving-path.md),
so with one item per stream the replica → ingress hop costs per token. Multiplexed
(`ServeConfig.stream_multiplexing`):

- each ingress replica listens on its own authenticated TCP channel (`serving.delta_channel`,
  `MuxReceiver`); its address and secret travel with every request it sends; frames are msgpack
  data (`serving.delta_codec`), never objects;
- a request still goes to an LLMServer replica as a Serve call (`generate_muxed`), routed by the
  router as usual: that call returns the admission chunk (invalid input, backpressure and failures
  surface there, before any byte is sent) and then the first token (time to first token: no wait
  for a connection or a flush), stays open while the request runs (cancelling it aborts the request
  in the engine, as before) and ends with it; a replica that dies fails the call;
- the replica hands every later delta to the `MuxSender` of that request's ingress, which merges
  each stream's deltas with the same `StreamBatcher` rules as unmultiplexed streams (first token
  and finish at once; nothing held longer than `stream_batch_interval_s`) and writes everything
  due, for all of that ingress's streams, as one frame on its connection; a connection that fails
  fails the calls of every stream on it;
- the receiver hands each chunk to its request's queue. A replica writes to one connection in
  order, so a request's chunks arrive in order; the ingress reads its queue only once the first
  token has come on the call, so deltas that arrived sooner wait there.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from serve_app.serving.delta_channel import ChannelAddress, ChannelSender, ChannelServer
from serve_app.serving.delta_codec import decode_batch, encode_batch
from serve_app.serving.stream_batching import StreamBatcher
from serve_app.types import RequestOutput

logger = logging.getLogger("ray.serve")

__all__ = ["ChannelSenders", "MuxReceiver", "MuxSender", "decode_batch", "encode_batch"]

class MuxSender:
    """Replica side, one per ingress: merges the deltas of that ingress's streams and pushes what is due.

    `add(request_id, out)` takes a backend delta; everything pending goes in one push as soon as any
    stream's `StreamBatcher` says its deltas are due (sending the others early never breaks their
    bound). `forget` drops what a cancelled request still had pending. `push` is the channel's
    `send` (a fake in tests); once it raises, `error` holds the exception and `check` raises it, for
    every stream of this sender: their deltas can no longer reach the ingress.
    """

    def __init__(self, push: Callable[[bytes], Any], interval_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self._push = push
        self.error: Exception | None = None
        self._interval_s = interval_s
        self._clock = clock
        self._batchers: dict[str, StreamBatcher] = {}
        self._dirty: dict[str, None] = {}  # requests with pending deltas, in arrival order
        self._flush_at: float | None = None  # when the scheduled flush runs (None: none scheduled)
        self._handle: asyncio.Handle | None = None

    @property
    def num_streams(self) -> int:
        return len(self._batchers)

    def token_sent(self, request_id: str) -> None:
        """The request's first token went on its own call just now: its later deltas are batched
        from here on (the interval counts from now)."""
        self._batchers[request_id] = StreamBatcher(self._interval_s, token_sent_at=self._clock())

    def add(self, request_id: str, out: RequestOutput) -> None:
        batcher = self._batchers.get(request_id)
        if batcher is None:  # the first token still goes at once
            batcher = self._batchers[request_id] = StreamBatcher(self._interval_s)
        batcher.add(out)
        self._dirty[request_id] = None
        self._schedule(batcher.deadline())

    def check(self) -> None:
        if self.error is not None:
            raise self.error

    def forget(self, request_id: str) -> None:
        self._batchers.pop(request_id, None)
        self._dirty.pop(request_id, None)

    def _schedule(self, deadline: float | None) -> None:
        if deadline is None:
            return
        now = self._clock()
        at = max(deadline, now)
        if self._flush_at is not None and self._flush_at <= at:
            return  # an earlier flush takes this delta too
        if self._handle is not None:
            self._handle.cancel()
        self._flush_at = at
        loop = asyncio.get_running_loop()
        # due now: after the deltas already queued on the loop (the rest of the engine step) are added
        self._handle = loop.call_soon(self.flush) if at <= now else loop.call_later(at - now, self.flush)

    def flush(self) -> None:
        """Push every pending delta now."""
        self._handle = self._flush_at = None
        now = self._clock()
        items = []
        for request_id in self._dirty:
            batcher = self._batchers[request_id]
            chunk = batcher.take(now)
            items.append((request_id, chunk))
            if chunk.finished:
                del self._batchers[request_id]
        self._dirty.clear()
        if items and self.error is None:
            try:
                self._push(encode_batch(items))
            except Exception as exc:  # noqa: BLE001 - raised to each stream by `check`
                logger.warning("stream channel to the ingress failed (%r); ending its %d stream(s)", exc, len(self._batchers))
                self.error = exc


class MuxReceiver:
    """Ingress side: listens on this ingress replica's channel and hands each chunk to its
    request's queue.

    `register(request_id)` returns the queue the request's chunks arrive on; `unregister` drops it
    (chunks that still arrive for it are discarded). `keep(task)` holds a background task until it
    is done (asyncio keeps only weak references).
    """

    def __init__(self) -> None:
        self.address: ChannelAddress | None = None
        self._server = ChannelServer(self._on_frame)
        self._queues: dict[str, asyncio.Queue] = {}
        self._tasks: set[asyncio.Task] = set()

    async def start(self, node_id: str, node_ip: str) -> MuxReceiver:
        """Listen on loopback and on `node_ip`, the address of node `node_id` (Ray's)."""
        self.address = await self._server.start(node_id, node_ip)
        return self

    def _on_frame(self, frame: bytes) -> None:
        for request_id, chunk in decode_batch(frame):
            queue = self._queues.get(request_id)
            if queue is not None:
                queue.put_nowait(chunk)

    def register(self, request_id: str) -> asyncio.Queue:
        queue = self._queues[request_id] = asyncio.Queue()
        return queue

    def unregister(self, request_id: str) -> None:
        self._queues.pop(request_id, None)

    def keep(self, task: asyncio.Task) -> None:
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)


class ChannelSenders:
    """Replica side: the `MuxSender` of each ingress this replica has had streams for, over one
    connection each (kept: connected once, not per request). A connection that failed or closed
    (its ingress gone) is dropped at the next `get`; a request from that ingress connects again."""

    def __init__(self, interval_s: float, node_id: str) -> None:
        self._interval_s = interval_s
        self._node_id = node_id  # this replica's node (Ray's id): same node, loopback
        self._senders: dict[ChannelAddress, asyncio.Task[tuple[ChannelSender, MuxSender]]] = {}

    async def get(self, address: ChannelAddress) -> MuxSender:
        """The sender for `address`; raises `ChannelClosed` when the ingress cannot be reached."""
        for known, task in list(self._senders.items()):
            if task.done() and (task.exception() is not None or task.result()[0].closed or task.result()[1].error is not None):
                del self._senders[known]
        task = self._senders.get(address)
        if task is None:
            # concurrent requests from one ingress share one connection attempt
            task = self._senders[address] = asyncio.ensure_future(self._connect(address))
        return (await asyncio.shield(task))[1]

    async def _connect(self, address: ChannelAddress) -> tuple[ChannelSender, MuxSender]:
        channel = await ChannelSender.connect(address, self._node_id)
        return channel, MuxSender(channel.send, self._interval_s)

    def __len__(self) -> int:
        return len(self._senders)
