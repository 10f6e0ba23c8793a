"""Hostile peers against the replica → ingress stream channel (serve_app/serving/delta_channel.py,
channel_auth.py, delta_codec.py), over real sockets on 127.0.0.1.

Whoever reaches the ingress's port (loopback or the node's address) without the secret gets no frame
decoded; an authenticated peer's frames are data only (a pickle is never unpickled); a recorded
handshake does not open a second connection; a flood of connections is refused beyond the gate's
bounds while the server keeps serving; a replica refuses a listener that cannot prove the secret and
drops an ingress that stops reading instead of buffering without bound."""

from __future__ import annotations

import asyncio
import os
import pickle

import msgpack
import pytest

from serve_app.serving import delta_channel
from serve_app.serving.channel_auth import (
    NONCE_BYTES,
    PROOF_BYTES,
    HandshakeGate,
    ingress_proof,
    replica_proof,
)
from serve_app.serving.delta_channel import (
    HEADER,
    ChannelAddress,
    ChannelClosed,
    ChannelSender,
    ChannelServer,
)
from serve_app.serving.delta_codec import FrameError, decode_batch, encode_batch
from serve_app.serving.stream_batching import GenerationChunk
from serve_app.serving.stream_mux import MuxReceiver

NODE = "node-a"


async def until(condition, timeout_s: float = 3.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.01)


async def authenticated(address: ChannelAddress) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A raw connection that passed the challenge (the test knows the secret)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", address.loopback_port)
    server_nonce = await reader.readexactly(NONCE_BYTES)
    client_nonce = os.urandom(NONCE_BYTES)
    writer.write(client_nonce + replica_proof(address.secret, server_nonce, client_nonce))
    assert await reader.readexactly(PROOF_BYTES) == ingress_proof(address.secret, server_nonce, client_nonce)
    return reader, writer


async def closed_by_server(reader: asyncio.StreamReader, timeout_s: float = 3.0) -> bool:
    try:
        return await asyncio.wait_for(reader.read(), timeout_s) == b""
    except ConnectionResetError:
        return True


class Exploit:
    """Unpickling this creates a file: proof that a frame was unpickled."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_codec_refuses_pickles_garbage_ext_types_and_wrong_shapes(tmp_path):
    marker = tmp_path / "pwned"
    hostile = [
        pickle.dumps([("r", Exploit(str(marker)))]),
        os.urandom(256),
        b"",
        msgpack.packb(msgpack.ExtType(1, b"x")),
        msgpack.packb({"r": 1}),
        msgpack.packb([("r", ("text", (1, "two"), False, None, 1, 0, None))]),
        msgpack.packb([("r", ("text", (1,), "yes", None, 1, 0, None))]),
        msgpack.packb([("r", ("text", (1,), False, None, 1, 0))]),
        msgpack.packb([(7, ("text", (1,), False, None, 1, 0, None))]),
        msgpack.packb([("r", ("t", (1,), False, None, 1, 0, [(1, "x", "not a float", ())]))]),
    ]
    for blob in hostile:
        with pytest.raises(FrameError):
            decode_batch(blob)
    assert not marker.exists()
    good = [("r", GenerationChunk("hi", (1, 2), True, "stop", 3, 1))]
    assert decode_batch(encode_batch(good)) == good


def test_pickled_and_garbled_frames_close_the_connection_and_run_nothing(tmp_path):
    """An authenticated peer (or one that stole a connection) sends a pickle and random bytes: no
    chunk reaches a request, nothing is unpickled, the connection is closed, and the receiver keeps
    serving other connections."""
    marker = tmp_path / "pwned"

    async def main():
        receiver = await MuxReceiver().start(NODE, "127.0.0.1")
        queue = receiver.register("r")
        closed = []
        for payload in (pickle.dumps([("r", Exploit(str(marker)))]), os.urandom(4096)):
            reader, writer = await authenticated(receiver.address)
            writer.write(HEADER.pack(len(payload)) + payload)
            closed.append(await closed_by_server(reader))
            writer.close()
        sender = await ChannelSender.connect(receiver.address, NODE)  # a real replica still gets through
        sender.send(encode_batch([("r", GenerationChunk("ok", (5,), True, "stop", 1))]))
        chunk = await asyncio.wait_for(queue.get(), 3)
        sender.close()
        receiver._server.close()
        return closed, chunk

    closed, chunk = asyncio.run(main())
    assert closed == [True, True]
    assert chunk.token_ids == (5,) and chunk.text == "ok"
    assert not marker.exists()


def test_wrong_proofs_and_a_replayed_handshake_are_refused():
    """A proof made with another secret, random bytes, and a byte-exact replay of a handshake that
    succeeded (recorded by an eavesdropper): each connection is closed and no frame is handed on."""

    async def main():
        frames: list[bytes] = []
        server = ChannelServer(frames.append)
        address = await server.start(NODE, "127.0.0.1")
        results = []
        for attempt in ("other secret", "garbage"):
            reader, writer = await asyncio.open_connection("127.0.0.1", address.loopback_port)
            server_nonce = await reader.readexactly(NONCE_BYTES)
            client_nonce = os.urandom(NONCE_BYTES)
            proof = replica_proof(b"y" * 32, server_nonce, client_nonce) if attempt == "other secret" else os.urandom(PROOF_BYTES)
            writer.write(client_nonce + proof + HEADER.pack(3) + b"abc")
            results.append(await closed_by_server(reader))
            writer.close()
        # record a good handshake, then replay the replica's bytes on a new connection
        reader, writer = await asyncio.open_connection("127.0.0.1", address.loopback_port)
        server_nonce = await reader.readexactly(NONCE_BYTES)
        client_nonce = os.urandom(NONCE_BYTES)
        recorded = client_nonce + replica_proof(address.secret, server_nonce, client_nonce)
        writer.write(recorded)
        await reader.readexactly(PROOF_BYTES)
        writer.close()
        reader, writer = await asyncio.open_connection("127.0.0.1", address.loopback_port)
        await reader.readexactly(NONCE_BYTES)  # a fresh nonce: the recording answers another challenge
        writer.write(recorded + HEADER.pack(3) + b"abc")
        results.append(await closed_by_server(reader))
        writer.close()
        server.close()
        return frames, results

    frames, results = asyncio.run(main())
    assert results == [True, True, True]
    assert frames == []


def test_a_connection_flood_is_refused_beyond_the_gate_and_the_channel_keeps_serving(monkeypatch):
    """300 silent connections at once against a gate of 20 handshakes a second (burst 20, at most
    10 pending): at most 10 sockets are held in a handshake at any time, the rest are closed at
    once (no more admitted than the bucket allows over the flood's duration), and a real replica
connects again once the flood stops."""
    monkeypatch.setattr(delta_channel, "HANDSHAKE_TIMEOUT_S", 0.5)

    async def main():
        frames: list[bytes] = []
        gate = HandshakeGate(rate_per_s=20, burst=20, max_pending=10)
        server = ChannelServer(frames.append, gate=gate)
        address = await server.start(NODE, "127.0.0.1")
        started = asyncio.get_running_loop().time()
        conns = await asyncio.gather(*(asyncio.open_connection("127.0.0.1", address.loopback_port) for _ in range(300)),
                                     return_exceptions=True)
        opened = [c for c in conns if not isinstance(c, BaseException)]
        peak_pending = 0
        loop = asyncio.get_running_loop()
        # until the server has taken every connection (a full listen backlog delays some: bounded wait)
        while gate.admitted + gate.refused < len(opened) and loop.time() - started < 5.0:
            peak_pending = max(peak_pending, gate.pending)
            await asyncio.sleep(0.005)
        elapsed_s = asyncio.get_running_loop().time() - started
        admitted, refused = gate.admitted, gate.refused
        for _, writer in opened:
            writer.close()
        await asyncio.sleep(1.0)  # the bucket refills
        sender = await ChannelSender.connect(address, NODE)
        sender.send(b"frame")
        await until(lambda: frames == [b"frame"])
        sender.close()
        server.close()
        return peak_pending, admitted, refused, elapsed_s

    peak_pending, admitted, refused, elapsed_s = asyncio.run(main())
    assert peak_pending <= 10
    # the bucket: its burst plus what it refilled while the flood lasted
    assert admitted <= 20 + 20 * elapsed_s + 1, (admitted, elapsed_s)
    assert refused >= 100, refused


def test_the_replica_refuses_a_listener_without_the_secret():
    """Something else listening on the ingress's port (it died and another process took the port)
    gets no frame: it cannot answer with the ingress's proof."""

    async def impostor(reader, writer):
        writer.write(os.urandom(NONCE_BYTES))
        await reader.readexactly(NONCE_BYTES + PROOF_BYTES)
        writer.write(os.urandom(PROOF_BYTES))
        await reader.read()
        writer.close()

    async def main():
        listener = await asyncio.start_server(impostor, "127.0.0.1", 0)
        port = listener.sockets[0].getsockname()[1]
        with pytest.raises(ChannelClosed, match="challenge"):
            await ChannelSender.connect(ChannelAddress(NODE, "127.0.0.1", port, port, b"s" * 32), NODE)
        listener.close()

    asyncio.run(main())


def test_connect_times_out_on_a_listener_that_never_answers(monkeypatch):
    monkeypatch.setattr(delta_channel, "CONNECT_TIMEOUT_S", 0.3)

    async def silent(reader, writer):
        await reader.read()

    async def main():
        listener = await asyncio.start_server(silent, "127.0.0.1", 0)
        port = listener.sockets[0].getsockname()[1]
        started = asyncio.get_running_loop().time()
        with pytest.raises(ChannelClosed):
            await ChannelSender.connect(ChannelAddress(NODE, "127.0.0.1", port, port, b"s" * 32), NODE)
        listener.close()
        return asyncio.get_running_loop().time() - started

    assert asyncio.run(main()) < 2.0


def test_an_ingress_that_stops_reading_is_dropped_after_the_drain_timeout(monkeypatch):
    """The ingress passes the challenge, then reads nothing: once the replica's unsent bytes pass
    the limit and do not drain within the timeout, the connection is closed and `send` raises."""
    monkeypatch.setattr(delta_channel, "WRITE_BUFFER_LIMIT_BYTES", 1 << 20)
    monkeypatch.setattr(delta_channel, "DRAIN_TIMEOUT_S", 0.3)
    secret = b"k" * 32

    async def stalled(reader, writer):
        server_nonce = os.urandom(NONCE_BYTES)
        writer.write(server_nonce)
        reply = await reader.readexactly(NONCE_BYTES + PROOF_BYTES)
        writer.write(ingress_proof(secret, server_nonce, reply[:NONCE_BYTES]))
        await asyncio.sleep(30)  # never reads again

    async def main():
        listener = await asyncio.start_server(stalled, "127.0.0.1", 0)
        port = listener.sockets[0].getsockname()[1]
        sender = await ChannelSender.connect(ChannelAddress(NODE, "127.0.0.1", port, port, secret), NODE)
        frame = b"x" * (1 << 20)
        with pytest.raises(ChannelClosed):
            for _ in range(200):  # 200 MiB would be buffered without the bound
                sender.send(frame)
                await asyncio.sleep(0.02)
        listener.close()

    asyncio.run(main())
