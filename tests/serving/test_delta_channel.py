"""The direct channel multiplexed deltas take from LLMServer replicas to an ingress replica
(serve_app/serving/delta_channel.py, and the two ends in stream_mux.py), over real sockets on
127.0.0.1: frames in order, the challenge required before anything is decoded, a silent or oversized
peer dropped, a lost connection noticed by the sender, one connection per ingress and a new one
after a failure. Hostile peers (wrong, garbled, pickled and oversized frames, replayed handshakes,
floods, an impostor listener, an ingress that stops reading) are in test_channel_attacks.py. The
path through Ray Serve is in test_openai_api.py and test_replica_failure.py."""

from __future__ import annotations

import asyncio

import pytest

from serve_app.serving import delta_channel
from serve_app.serving.channel_auth import NONCE_BYTES, PROOF_BYTES, ingress_proof, replica_proof
from serve_app.serving.delta_channel import (
    HEADER,
    MAX_FRAME_BYTES,
    ChannelAddress,
    ChannelClosed,
    ChannelSender,
    ChannelServer,
)
from serve_app.serving.stream_mux import ChannelSenders, MuxReceiver
from serve_app.types import FinishReason, RequestMetrics, RequestOutput

NODE = "node-a"


async def started(frames: list[bytes]) -> tuple[ChannelServer, ChannelAddress]:
    server = ChannelServer(frames.append)
    return server, await server.start(NODE, "127.0.0.1")


async def until(condition, timeout_s: float = 2.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.01)


def test_frames_arrive_in_order_from_each_connection():
    async def main():
        frames: list[bytes] = []
        server, address = await started(frames)
        one, two = await ChannelSender.connect(address, NODE), await ChannelSender.connect(address, "another-node")
        for i in range(100):
            one.send(b"a%d" % i)
            two.send(b"b%d" % i)
        await until(lambda: len(frames) == 200)
        one.close(), two.close(), server.close()
        return frames

    frames = asyncio.run(main())
    assert [f for f in frames if f.startswith(b"a")] == [b"a%d" % i for i in range(100)]
    assert [f for f in frames if f.startswith(b"b")] == [b"b%d" % i for i in range(100)]


def test_the_address_picks_loopback_on_the_same_node_and_hides_its_secret():
    address = ChannelAddress(NODE, "10.0.0.7", 4001, 4002, b"s" * 32)
    assert address.endpoint(NODE) == ("127.0.0.1", 4002)
    assert address.endpoint("node-b") == ("10.0.0.7", 4001)
    assert "sss" not in repr(address)


def test_a_wrong_secret_fails_the_challenge_at_connect():
    async def main():
        frames: list[bytes] = []
        server, address = await started(frames)
        wrong = ChannelAddress(address.node_id, address.node_ip, address.node_port, address.loopback_port, b"x" * 32)
        with pytest.raises(ChannelClosed):
            await ChannelSender.connect(wrong, NODE)
        server.close()
        return frames

    assert asyncio.run(main()) == []


async def raw_connection(address: ChannelAddress, payload: bytes, authenticate: bool = False) -> bytes:
    """Connect without the client (passing the challenge first when `authenticate`), send `payload`,
    return what the server sends after that until it closes."""
    reader, writer = await asyncio.open_connection("127.0.0.1", address.loopback_port)
    if authenticate:
        await answer_challenge(reader, writer, address.secret)
    writer.write(payload)
    try:
        data = await asyncio.wait_for(reader.read(), 5)
    except ConnectionResetError:
        data = b""
    writer.close()
    return data


async def answer_challenge(reader, writer, secret: bytes) -> None:
    server_nonce = await reader.readexactly(NONCE_BYTES)
    client_nonce = b"c" * NONCE_BYTES
    writer.write(client_nonce + replica_proof(secret, server_nonce, client_nonce))
    assert await reader.readexactly(PROOF_BYTES) == ingress_proof(secret, server_nonce, client_nonce)


def test_a_peer_that_answers_no_challenge_is_dropped(monkeypatch):
    monkeypatch.setattr(delta_channel, "HANDSHAKE_TIMEOUT_S", 0.1)

    async def main():
        frames: list[bytes] = []
        server, address = await started(frames)
        closed_with = await raw_connection(address, b"")  # returns only once the server closes it
        server.close()
        return frames, closed_with

    frames, closed_with = asyncio.run(main())
    assert frames == [] and len(closed_with) == NONCE_BYTES  # the challenge, then the close


def test_an_oversized_frame_closes_the_connection_unread():
    async def main():
        frames: list[bytes] = []
        server, address = await started(frames)
        closed_with = await raw_connection(address, HEADER.pack(MAX_FRAME_BYTES + 1) + b"x" * 1000, authenticate=True)
        server.close()
        return frames, closed_with

    assert asyncio.run(main()) == ([], b"")


def output(request_id: str, token: int, finished: bool = False) -> RequestOutput:
    return RequestOutput(request_id, f"<{token}>", (token,), finished, FinishReason.LENGTH if finished else None, 5,
                         RequestMetrics(arrival_time=0.0))


def test_replica_to_ingress_one_connection_per_ingress_and_a_new_one_after_a_failure():
    """The two real ends: a replica's senders and an ingress's receiver. Concurrent requests from one
    ingress share one connection; a sender whose channel failed is replaced on the next request; an
    ingress that cannot be reached raises ChannelClosed (the call fails: a 503 to the client), and
    failed connections are not kept."""

    async def main():
        receiver = await MuxReceiver().start(NODE, "127.0.0.1")
        queue = receiver.register("r")
        senders = ChannelSenders(interval_s=0.0, node_id=NODE)
        first, same = await asyncio.gather(senders.get(receiver.address), senders.get(receiver.address))
        assert first is same
        first.token_sent("r")
        first.add("r", output("r", 1))
        got = [await asyncio.wait_for(queue.get(), 2)]
        first.error = ChannelClosed("gone")
        second = await senders.get(receiver.address)
        assert second is not first
        second.add("r", output("r", 2, finished=True))
        got.append(await asyncio.wait_for(queue.get(), 2))
        receiver._server.close()
        unreachable = ChannelAddress("node-z", "127.0.0.1", 1, 1, b"s" * 32)
        with pytest.raises(ChannelClosed):
            await senders.get(unreachable)
        assert len(senders) == 2  # the unreachable one (failed) and the live second connection
        with pytest.raises(ChannelClosed):
            await senders.get(unreachable)  # tried again, not a cached failure
        assert len(senders) == 2
        return got

    got = asyncio.run(main())
    assert [c.token_ids for c in got] == [(1,), (2,)]
    assert got[-1].finished
