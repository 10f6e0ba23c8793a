"""Stream multiplexing: every delta an LLMServer replica owes one ingress replica travels in one Ray
message per flush, instead of one Serve streaming item per stream.

Each Serve streaming item costs CPU in the replica, Ray's core and the ingress (docs/serving-path.md),
so with one item per stream the replica → ingress hop costs per token. Multiplexed
(`ServeConfig.stream_multiplexing`):

- each ingress replica owns a `DeltaInlet`, a small Ray actor on its node (not a Serve deployment,
  so Serve's admission limits never hold it back; it dies with the ingress that owns it), and reads
  it through one Ray streaming call (`MuxReceiver`);
- a request still goes to an LLMServer replica as a Serve call (`generate_muxed`), routed by the
  router as usual: that call returns the admission chunk (invalid input, backpressure and failures
  surface there, before any byte is sent) and then the first token (one hop to the ingress, where
  the inlet would take two: time to first token), stays open while the request runs (cancelling it
  aborts the request in the engine, as before) and ends with it; a replica that dies fails the call;
- the replica hands every later delta to the `MuxSender` of that request's inlet, which merges each
  stream's deltas with the same `StreamBatcher` rules as unmultiplexed streams (first token and
  finish at once; nothing held longer than `stream_batch_interval_s`) and pushes everything due,
  for all of that ingress's streams, as one encoded batch;
- the receiver hands each chunk to its request's queue. One replica pushes to one inlet in order and
  the inlet streams in order, so a request's chunks arrive in order; the ingress reads its queue
  only once the first token has come on the call, so deltas the inlet delivered sooner wait there.
"""

from __future__ import annotations

import asyncio
import logging
import pickle
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from serve_app.serving.stream_batching import GenerationChunk, StreamBatcher
from serve_app.types import RequestOutput

logger = logging.getLogger("ray.serve")

def encode_batch(items: list[tuple[str, GenerationChunk]]) -> bytes:
    """(request id, chunk) pairs as bytes: the inlet passes them on without decoding, and plain tuples
    pickle several times faster than dataclasses."""
    return pickle.dumps([(request_id, (c.text, c.token_ids, c.finished, c.finish_reason, c.num_prompt_tokens,
                                       c.num_cached_tokens, c.logprobs)) for request_id, c in items],
                        protocol=pickle.HIGHEST_PROTOCOL)


def decode_batch(blob: bytes) -> list[tuple[str, GenerationChunk]]:
    return [(request_id, GenerationChunk(*fields)) for request_id, fields in pickle.loads(blob)]


@dataclass(frozen=True)
class InletAddress:
    """Where a replica finds an ingress's inlet (a named Ray actor)."""

    name: str
    namespace: str


# Items per `DeltaInlet.stream` call. Ray keeps some state per item of a streaming call until the call
# ends (measured: ~160 bytes in the reader per item, growing without bound over a never-ending
# call), so the reader ends its call after this many items and opens the next; blobs pushed in
# between wait in the inlet.
STREAM_ITEMS_PER_CALL = 10_000


class DeltaInlet:
    """Ray actor (async methods only, so everything runs on its event loop): replicas `push` encoded
    batches, one reader takes them through `stream` (a Ray streaming generator), oldest first.
    A `stream` call ends after `max_items` items, never holding blobs it has not yielded."""

    def __init__(self) -> None:
        self._blobs: list[bytes] = []
        self._ready = asyncio.Event()

    async def push(self, blob: bytes) -> None:
        self._blobs.append(blob)
        self._ready.set()

    async def stream(self, max_items: int = STREAM_ITEMS_PER_CALL):
        for _ in range(max_items):
            await self._ready.wait()
            self._ready.clear()
            blobs, self._blobs = self._blobs, []
            yield blobs


class MuxSender:
    """Replica side, one per inlet: merges the deltas of that ingress's streams and pushes what is due.

    `add(request_id, out)` takes a backend delta; everything pending goes in one push as soon as any
    stream's `StreamBatcher` says its deltas are due (sending the others early never breaks their
    bound). `forget` drops what a cancelled request still had pending. `push` is the inlet's
    `push.remote` (a fake in tests).
    """

    def __init__(self, push: Callable[[bytes], Any], interval_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self._push = push
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
        if items:
            self._push(encode_batch(items))


class MuxReceiver:
    """Ingress side: owns this ingress replica's inlet and hands each chunk to its request's queue.

    `register(request_id)` returns the queue the request's chunks (or an exception that ends the
    stream) arrive on; `unregister` drops it (chunks that still arrive for it are discarded).
    `keep(task)` holds a background task until it is done (asyncio keeps only weak references).
    """

    def __init__(self) -> None:
        self.address: InletAddress | None = None
        self._inlet: Any = None
        self._queues: dict[str, asyncio.Queue] = {}
        self._task: asyncio.Task | None = None
        self._tasks: set[asyncio.Task] = set()

    def start(self) -> MuxReceiver:
        self._spawn()
        self._task = asyncio.get_running_loop().create_task(self._run())
        return self

    def _spawn(self) -> None:
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        context = ray.get_runtime_context()
        self.address = InletAddress(f"serve_app_inlet_{uuid.uuid4().hex}", context.namespace)
        # on this node, owned by this replica's actor: Ray kills it when the ingress replica dies
        self._inlet = ray.remote(DeltaInlet).options(
            name=self.address.name, namespace=self.address.namespace, num_cpus=0, max_concurrency=1000,
            scheduling_strategy=NodeAffinitySchedulingStrategy(context.get_node_id(), soft=False),
        ).remote()

    def register(self, request_id: str) -> asyncio.Queue:
        queue = self._queues[request_id] = asyncio.Queue()
        return queue

    def unregister(self, request_id: str) -> None:
        self._queues.pop(request_id, None)

    def keep(self, task: asyncio.Task) -> None:
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _run(self) -> None:
        while True:
            try:
                # each call ends after STREAM_ITEMS_PER_CALL items; the loop opens the next
                async for ref in self._inlet.stream.options(num_returns="streaming").remote():
                    for blob in await ref:
                        for request_id, chunk in decode_batch(blob):
                            queue = self._queues.get(request_id)
                            if queue is not None:
                                queue.put_nowait(chunk)
            except Exception as exc:  # noqa: BLE001 - the inlet failed: end its streams, start another
                logger.exception("stream inlet failed; ending %d stream(s)", len(self._queues))
                for queue in self._queues.values():
                    queue.put_nowait(exc)
                await asyncio.sleep(0.5)
                self._spawn()


class InletSenders:
    """Replica side: the `MuxSender` of each ingress inlet this replica has had streams for (one per
    ingress replica it has served: kept, so the inlet is looked up once, not on every burst)."""

    def __init__(self, interval_s: float) -> None:
        self._interval_s = interval_s
        self._senders: dict[InletAddress, MuxSender] = {}

    def get(self, address: InletAddress) -> MuxSender:
        sender = self._senders.get(address)
        if sender is None:
            import ray

            inlet = ray.get_actor(address.name, namespace=address.namespace)
            sender = self._senders[address] = MuxSender(inlet.push.remote, self._interval_s)
        return sender
