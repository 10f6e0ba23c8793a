"""Stream multiplexing (serve_app/serving/stream_mux.py), the parts that need no Ray cluster: the wire
format, the replica-side sender (one push per flush for every stream, the batching bound kept per
stream, cancelled streams dropped) and the inlet's ordering. The whole path through Ray Serve runs in
test_openai_api.py (every test, multiplexed and not) and test_replica_failure.py."""

from __future__ import annotations

import asyncio

from serve_app.serving.stream_batching import GenerationChunk
from serve_app.serving.stream_mux import DeltaInlet, MuxSender, decode_batch, encode_batch
from serve_app.types import FinishReason, RequestMetrics, RequestOutput, TokenLogprob


def out(request_id: str, token: int, finished: bool = False) -> RequestOutput:
    return RequestOutput(request_id, f"<{token}>", (token,), finished, FinishReason.LENGTH if finished else None, 5,
                         RequestMetrics(arrival_time=0.0))


class Pushes:
    """A fake inlet: the decoded batches pushed, with the loop time of each push."""

    def __init__(self) -> None:
        self.batches: list[tuple[float, list[tuple[str, GenerationChunk]]]] = []

    def __call__(self, blob: bytes) -> None:
        self.batches.append((asyncio.get_running_loop().time(), decode_batch(blob)))

    def tokens(self, request_id: str) -> list[int]:
        return [t for _, batch in self.batches for rid, c in batch if rid == request_id for t in c.token_ids]


def test_wire_format_round_trip():
    items = [("a", GenerationChunk("hi", (1, 2), False, None, 7)),
             ("b/1", GenerationChunk("", (), True, "stop", 3, 2, (TokenLogprob(5, "x", -0.5, ((5, "x", -0.5), (6, "y", -1.25))),)))]
    assert decode_batch(encode_batch(items)) == items


def test_one_push_carries_every_stream_of_a_step():
    """Without batching every delta is due at once, and all the deltas a step hands over in one go
    (as the engine does, one loop callback per step) leave in a single push."""

    async def main():
        pushes = Pushes()
        sender = MuxSender(pushes, interval_s=0.0)
        for step in range(3):
            for i in range(50):
                sender.add(f"r{i}", out(f"r{i}", step, finished=step == 2))
            await asyncio.sleep(0)
            await asyncio.sleep(0)
        return pushes, sender

    pushes, sender = asyncio.run(main())
    assert len(pushes.batches) == 3
    assert all(len(batch) == 50 for _, batch in pushes.batches)
    assert all(pushes.tokens(f"r{i}") == [0, 1, 2] for i in range(50))
    assert sender.num_streams == 0  # finished streams leave the sender


def test_batching_bound_holds_per_stream_and_merges_across_streams():
    """Tokens every 10 ms on 20 streams with a 50 ms interval: the first token and the finish go at
    once, no token waits longer than the interval (plus scheduling slack), and far fewer pushes than
    deltas leave."""
    interval, slack = 0.05, 0.03

    async def main():
        loop = asyncio.get_running_loop()
        pushes = Pushes()
        sender = MuxSender(pushes, interval, clock=loop.time)
        added: dict[tuple[str, int], float] = {}
        for token in range(20):
            for i in range(20):
                sender.add(f"r{i}", out(f"r{i}", token, finished=token == 19))
                added[(f"r{i}", token)] = loop.time()
            await asyncio.sleep(0.01)
        await asyncio.sleep(2 * interval)
        return pushes, added

    pushes, added = asyncio.run(main())
    sent = {(rid, t): when for when, batch in pushes.batches for rid, c in batch for t in c.token_ids}
    assert sent.keys() == added.keys()  # every token, once
    for key, when in sent.items():
        assert added[key] <= when <= added[key] + interval + slack, key
    assert len(pushes.batches) < 20 * 20 / 8
    for i in range(20):
        assert pushes.tokens(f"r{i}") == list(range(20))
        assert sent[(f"r{i}", 0)] - added[(f"r{i}", 0)] < slack  # first token at once
        assert sent[(f"r{i}", 19)] - added[(f"r{i}", 19)] < slack  # finish at once


def test_forget_drops_a_cancelled_stream():
    async def main():
        pushes = Pushes()
        sender = MuxSender(pushes, interval_s=10.0)  # nothing but first tokens and finishes is due
        sender.add("gone", out("gone", 0))
        sender.add("kept", out("kept", 0))
        await asyncio.sleep(0)
        sender.add("gone", out("gone", 1))
        sender.add("kept", out("kept", 1))
        sender.forget("gone")
        sender.add("kept", out("kept", 2, finished=True))
        await asyncio.sleep(0)
        return pushes, sender

    pushes, sender = asyncio.run(main())
    assert pushes.tokens("gone") == [0]
    assert pushes.tokens("kept") == [0, 1, 2]
    assert sender.num_streams == 0


def test_inlet_streams_pushes_in_order():
    async def main():
        inlet = DeltaInlet()
        stream = inlet.stream()
        await inlet.push(b"1")
        await inlet.push(b"2")
        first = await anext(stream)
        await inlet.push(b"3")
        second = await anext(stream)
        waiting = asyncio.ensure_future(anext(stream))
        await asyncio.sleep(0.01)
        assert not waiting.done()  # nothing pushed: the reader waits
        await inlet.push(b"4")
        return first, second, await waiting

    assert asyncio.run(main()) == ([b"1", b"2"], [b"3"], [b"4"])


def test_an_inlet_stream_call_ends_after_its_items_and_the_next_gets_the_rest():
    """The reader re-opens its call every so many items (Ray keeps state per item of a call); blobs
    pushed meanwhile wait for the next call, none is lost or repeated."""

    async def main():
        inlet = DeltaInlet()
        for i in range(3):
            await inlet.push(bytes([i]))
        first = [blobs async for blobs in inlet.stream(max_items=1)]
        await inlet.push(b"late")
        second = [blobs async for blobs in inlet.stream(max_items=1)]
        return first, second

    assert asyncio.run(main()) == ([[b"\x00", b"\x01", b"\x02"]], [[b"late"]])


class _Call:
    """A fake replica call (Serve's streaming response): yields `chunks`, each once `release` is set."""

    def __init__(self, chunks: list[GenerationChunk], release: asyncio.Event) -> None:
        self._chunks, self._release = list(chunks), release

    def __aiter__(self):
        return self

    async def __anext__(self) -> GenerationChunk:
        if not self._chunks:
            await asyncio.Event().wait()  # the call stays open until the request ends
        if len(self._chunks) == 1:  # the first token waits: the inlet's deltas get ahead of it
            await self._release.wait()
        return self._chunks.pop(0)

    def cancel(self) -> None:
        pass


class _Handle:
    def __init__(self, call: _Call) -> None:
        self.call = call

    def options(self, **_):
        return self

    @property
    def generate_muxed(self):
        return self

    def remote(self, *_):
        return self.call


class _Receiver:
    address = "inlet"

    def __init__(self) -> None:
        self.queue: asyncio.Queue = asyncio.Queue()

    def register(self, _request_id):
        return self.queue

    def unregister(self, _request_id):
        pass

    def keep(self, _task):
        pass


def test_the_first_token_comes_on_the_call_and_keeps_its_place_ahead_of_the_inlet():
    """The replica sends the admission chunk and the first token on the request's call (one hop),
    later deltas through the inlet (two hops): deltas the inlet delivers before the first token
    arrives wait, and the stream reads in the engine's order."""
    from serve_app.serving.streams import MuxedChoiceStream
    from serve_app.types import GenerateRequest

    def chunk(token: int | None, finished: bool = False) -> GenerationChunk:
        tokens = () if token is None else (token,)
        return GenerationChunk("" if token is None else f"<{token}>", tokens, finished, "length" if finished else None, 5)

    async def main():
        release = asyncio.Event()
        receiver = _Receiver()
        stream = MuxedChoiceStream(_Handle(_Call([chunk(None), chunk(1)], release)), GenerateRequest("r", prompt="hi"),
                                   receiver)
        admission = await stream.start()
        receiver.queue.put_nowait(chunk(2))  # through the inlet, ahead of the first token
        receiver.queue.put_nowait(chunk(3, finished=True))
        asyncio.get_running_loop().call_later(0.01, release.set)
        return admission, [c.token_ids async for c in stream.rest()]

    admission, rest = asyncio.run(main())
    assert admission.token_ids == ()
    assert rest == [(1,), (2,), (3,)]


def test_after_a_token_sent_on_the_call_the_next_delta_waits_for_the_interval():
    """`token_sent`: the stream's first token went on its call, so its next delta is batched (not
    sent at once as a first token would be); the finish still goes at once."""

    async def main():
        pushes = Pushes()
        sender = MuxSender(pushes, interval_s=0.05)
        loop = asyncio.get_running_loop()
        start = loop.time()
        sender.token_sent("r")
        sender.add("r", out("r", 2))
        await asyncio.sleep(0.02)
        early = list(pushes.batches)
        await asyncio.sleep(0.06)
        sender.add("r", out("r", 3, finished=True))
        await asyncio.sleep(0)
        return start, early, pushes

    start, early, pushes = asyncio.run(main())
    assert early == []
    assert len(pushes.batches) == 2 and pushes.batches[0][0] - start >= 0.045
    assert pushes.tokens("r") == [2, 3]
