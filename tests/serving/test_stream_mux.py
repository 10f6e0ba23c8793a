"""Stream multiplexing (serve_app/serving/stream_mux.py), the parts that need no Ray cluster: the wire
format, the replica-side sender (one push per flush for every stream, the batching bound kept per
stream, cancelled streams dropped, a failed channel failing its streams) and the ingress stream's
ordering and its bound on missing last chunks. The channel itself (real sockets on 127.0.0.1) is in
test_delta_channel.py; the whole path through Ray Serve runs in test_openai_api.py (every test,
multiplexed and not), test_auth_prefix.py and test_replica_failure.py."""

from __future__ import annotations

import asyncio

from serve_app.serving.stream_batching import GenerationChunk
from serve_app.serving.stream_mux import MuxSender, decode_batch, encode_batch
from serve_app.types import FinishReason, RequestMetrics, RequestOutput, TokenLogprob


def out(request_id: str, token: int, finished: bool = False) -> RequestOutput:
    return RequestOutput(request_id, f"<{token}>", (token,), finished, FinishReason.LENGTH if finished else None, 5,
                         RequestMetrics(arrival_time=0.0))


class Pushes:
    """A fake channel: the decoded batches pushed, with the loop time of each push."""

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


class _Call:
    """A fake replica call (Serve's streaming response): yields `chunks`, each once `release` is set."""

    def __init__(self, chunks: list[GenerationChunk], release: asyncio.Event, ended: asyncio.Event | None = None) -> None:
        self._chunks, self._release = list(chunks), release
        self._ended = ended or asyncio.Event()

    def __aiter__(self):
        return self

    async def __anext__(self) -> GenerationChunk:
        if not self._chunks:
            await self._ended.wait()  # the call stays open until the request ends
            raise StopAsyncIteration
        if len(self._chunks) == 1:  # the first token waits: the channel's deltas get ahead of it
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
    address = "channel"

    def __init__(self) -> None:
        self.queue: asyncio.Queue = asyncio.Queue()
        self.tasks: list[asyncio.Task] = []

    def register(self, _request_id):
        return self.queue

    def unregister(self, _request_id):
        pass

    def keep(self, task):
        self.tasks.append(task)


def test_the_first_token_comes_on_the_call_and_keeps_its_place_ahead_of_the_channel():
    """The replica sends the admission chunk and the first token on the request's call, later
    deltas over the channel: deltas the channel delivers before the first token arrives wait, and
    the stream reads in the engine's order."""
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
        receiver.queue.put_nowait(chunk(2))  # over the channel, ahead of the first token
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


def chunk(token: int | None, finished: bool = False) -> GenerationChunk:
    tokens = () if token is None else (token,)
    return GenerationChunk("" if token is None else f"<{token}>", tokens, finished, "length" if finished else None, 5)


def test_a_failed_channel_fails_every_stream_of_its_sender():
    """Once a push raises (the connection to the ingress is gone), nothing more is pushed and every
    stream of that sender raises on its next delta, so each replica call fails instead of the
    ingress waiting for deltas that cannot arrive."""
    from serve_app.serving.delta_channel import ChannelClosed

    class Failing:
        def __init__(self) -> None:
            self.calls = 0

        def __call__(self, blob: bytes) -> None:
            self.calls += 1
            if self.calls > 1:
                raise ChannelClosed("gone")

    async def main():
        push = Failing()
        sender = MuxSender(push, interval_s=0.0)
        for step in range(3):
            for rid in ("a", "b"):
                sender.add(rid, out(rid, step))
            await asyncio.sleep(0)
        return push, sender

    push, sender = asyncio.run(main())
    assert push.calls == 2  # the first push went, the second failed, the third was not tried
    assert isinstance(sender.error, ChannelClosed)
    try:
        sender.check()
    except ChannelClosed:
        pass
    else:
        raise AssertionError("check() must raise the channel's error")


def run_stream(last_after_call_s: float | None, timeout_s: float, monkeypatch) -> tuple[list, BaseException | None]:
    """A multiplexed stream whose replica call ends right after its first token; its last chunk comes
    over the channel `last_after_call_s` after that (None: never)."""
    from serve_app.serving import streams
    from serve_app.serving.streams import MuxedChoiceStream
    from serve_app.types import GenerateRequest

    monkeypatch.setattr(streams, "LAST_CHUNKS_TIMEOUT_S", timeout_s)

    async def main():
        release, ended = asyncio.Event(), asyncio.Event()
        release.set()
        receiver = _Receiver()
        stream = MuxedChoiceStream(_Handle(_Call([chunk(None), chunk(1)], release, ended)), GenerateRequest("r", prompt="hi"),
                                   receiver)
        await stream.start()
        ended.set()
        if last_after_call_s is not None:
            asyncio.get_running_loop().call_later(last_after_call_s, receiver.queue.put_nowait, chunk(2, finished=True))
        tokens, error = [], None
        try:
            async for c in stream.rest():
                tokens.append(c.token_ids)
        except Exception as exc:  # noqa: BLE001 - returned for the assertions
            error = exc
        return tokens, error

    return asyncio.run(main())


def test_last_chunks_that_arrive_after_the_call_ended_are_read(monkeypatch):
    tokens, error = run_stream(last_after_call_s=0.05, timeout_s=5.0, monkeypatch=monkeypatch)
    assert error is None
    assert tokens == [(1,), (2,)]


def test_a_stream_whose_last_chunks_never_arrive_ends_with_an_error_not_a_hang(monkeypatch):
    from serve_app.serving.errors import APIError

    tokens, error = run_stream(last_after_call_s=None, timeout_s=0.1, monkeypatch=monkeypatch)
    assert tokens == [(1,)]
    assert isinstance(error, APIError) and error.status == 500 and "never arrived" in str(error.message)
