"""A direct TCP channel from LLMServer replicas to one ingress replica, for multiplexed stream deltas.

The ingress replica listens (`ChannelServer`); each replica that serves its streams opens one
connection to it (`ChannelSender`) and writes length-prefixed frames, in order. Compared with a relay
actor between them, a frame costs one socket write and one read: no extra process, no Ray task per
flush.

Authentication: every ingress replica draws a random secret, which reaches replicas inside the
requests it sends them over Ray (`ChannelAddress`, never printed). It never crosses the connection:
both ends prove they hold it by an HMAC of fresh nonces (`serving.channel_auth`), within
`HANDSHAKE_TIMEOUT_S`; a connection that fails, or a frame over `MAX_FRAME_BYTES`, closes the
connection before any frame is handed on. A `HandshakeGate` bounds the rate and the number of
concurrent handshakes, so a flood of connections costs the ingress a bounded number of sockets and
HMACs. Frames are data (`serving.delta_codec`); one that does not decode closes its connection.

Timeouts: a replica gives up connecting (TCP and handshake) after `CONNECT_TIMEOUT_S`; a connection
whose unsent bytes pass `WRITE_BUFFER_LIMIT_BYTES` and do not drain within `DRAIN_TIMEOUT_S` (an
ingress that stopped reading) is closed, which fails its streams instead of growing the replica's
memory without bound.

Addresses: the server listens on the loopback interface and on the node's IP (the one Ray uses);
a replica on the same node connects through loopback, others through the node's IP.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import secrets
import struct
from collections.abc import Callable
from dataclasses import dataclass, field

from serve_app.serving.channel_auth import (
    NONCE_BYTES,
    PROOF_BYTES,
    HandshakeGate,
    ingress_proof,
    replica_proof,
)
from serve_app.serving.delta_codec import FrameError

logger = logging.getLogger("ray.serve")

HEADER = struct.Struct("!I")  # a frame's length in bytes, then the frame
SECRET_BYTES = 32
HANDSHAKE_TIMEOUT_S = 5.0
CONNECT_TIMEOUT_S = 10.0
DRAIN_TIMEOUT_S = 10.0
MAX_FRAME_BYTES = 64 << 20
WRITE_BUFFER_LIMIT_BYTES = 16 << 20
HANDSHAKES_PER_S = 50.0  # replicas connect once per ingress, so legitimate handshakes are rare
HANDSHAKE_BURST = 100
MAX_PENDING_HANDSHAKES = 32
LOOPBACK = "127.0.0.1"


class ChannelClosed(ConnectionError):
    """The connection to the ingress is gone: the streams that used it cannot continue."""


@dataclass(frozen=True)
class ChannelAddress:
    """How a replica reaches one ingress replica's channel. Travels in that ingress's requests."""

    node_id: str
    node_ip: str
    node_port: int
    loopback_port: int
    secret: bytes = field(repr=False)

    def endpoint(self, node_id: str) -> tuple[str, int]:
        """Where a process on node `node_id` connects."""
        return (LOOPBACK, self.loopback_port) if node_id == self.node_id else (self.node_ip, self.node_port)


class ChannelServer:
    """Ingress side: accepts authenticated connections and hands every frame to `on_frame`, in the
    order each connection sent them (frames of different connections interleave). `on_frame` raises
    `FrameError` (a ValueError) for a frame it cannot decode: that connection is closed."""

    def __init__(self, on_frame: Callable[[bytes], None], gate: HandshakeGate | None = None) -> None:
        self._on_frame = on_frame
        self._secret = secrets.token_bytes(SECRET_BYTES)
        self._servers: list[asyncio.Server] = []
        self.gate = gate or HandshakeGate(HANDSHAKES_PER_S, HANDSHAKE_BURST, MAX_PENDING_HANDSHAKES)

    async def start(self, node_id: str, node_ip: str) -> ChannelAddress:
        loopback = await asyncio.start_server(self._serve, LOOPBACK, 0)
        self._servers.append(loopback)
        node = loopback
        if node_ip != LOOPBACK:
            node = await asyncio.start_server(self._serve, node_ip, 0)
            self._servers.append(node)
        return ChannelAddress(node_id, node_ip, _port(node), _port(loopback), self._secret)

    async def _handshake(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        server_nonce = secrets.token_bytes(NONCE_BYTES)
        writer.write(server_nonce)
        async with asyncio.timeout(HANDSHAKE_TIMEOUT_S):
            reply = await reader.readexactly(NONCE_BYTES + PROOF_BYTES)
        client_nonce, proof = reply[:NONCE_BYTES], reply[NONCE_BYTES:]
        if not hmac.compare_digest(proof, replica_proof(self._secret, server_nonce, client_nonce)):
            return False
        writer.write(ingress_proof(self._secret, server_nonce, client_nonce))
        return True

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = writer.get_extra_info("peername")
        if not self.gate.enter():
            if refused := self.gate.take_refused_for_log():
                logger.warning("stream channel: refused %d connection(s) over the handshake rate or concurrency bound", refused)
            writer.transport.abort()
            return
        try:
            try:
                accepted = await self._handshake(reader, writer)
            finally:
                self.gate.leave()
            if not accepted:
                logger.warning("stream channel: refused a connection from %s (failed the challenge)", peer)
                return
            while True:
                (size,) = HEADER.unpack(await reader.readexactly(HEADER.size))
                if size > MAX_FRAME_BYTES:
                    logger.warning("stream channel: closed the connection from %s (a %d-byte frame)", peer, size)
                    return
                self._on_frame(await reader.readexactly(size))
        except asyncio.IncompleteReadError as exc:
            if exc.partial:  # a clean close ends between frames
                logger.warning("stream channel: the connection from %s ended inside a frame", peer)
        except (TimeoutError, ConnectionError) as exc:
            logger.warning("stream channel: the connection from %s failed: %r", peer, exc)
        except FrameError as exc:
            logger.warning("stream channel: closed the connection from %s (a malformed frame: %s)", peer, exc)
        except Exception:  # a bug in handing on a well-formed frame
            logger.exception("stream channel: closed the connection from %s", peer)
        finally:
            writer.close()

    def close(self) -> None:
        for server in self._servers:
            server.close()


class ChannelSender:
    """Replica side: one connection to one ingress. `send` queues a frame on the socket (never
    blocks); it raises `ChannelClosed` once the connection is gone, or once it was closed because
    the ingress stopped reading (see the module's timeouts)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader = reader  # the ingress never writes after the handshake: kept to notice the close
        self._writer = writer
        self._drain: asyncio.Task | None = None

    @classmethod
    async def connect(cls, address: ChannelAddress, node_id: str) -> ChannelSender:
        """Connect and pass the challenge within `CONNECT_TIMEOUT_S`, else `ChannelClosed`."""
        host, port = address.endpoint(node_id)
        writer = None
        try:
            async with asyncio.timeout(CONNECT_TIMEOUT_S):
                reader, writer = await asyncio.open_connection(host, port)
                server_nonce = await reader.readexactly(NONCE_BYTES)
                client_nonce = secrets.token_bytes(NONCE_BYTES)
                writer.write(client_nonce + replica_proof(address.secret, server_nonce, client_nonce))
                proof = await reader.readexactly(PROOF_BYTES)
        except (OSError, TimeoutError, asyncio.IncompleteReadError) as exc:
            if writer is not None:
                writer.close()
            raise ChannelClosed(f"cannot reach the ingress's stream channel at {host}:{port}: {exc!r}") from exc
        if not hmac.compare_digest(proof, ingress_proof(address.secret, server_nonce, client_nonce)):
            writer.close()
            raise ChannelClosed(f"the listener at {host}:{port} failed the challenge: not the ingress's stream channel")
        return cls(reader, writer)

    @property
    def closed(self) -> bool:
        return self._writer.is_closing()

    def send(self, frame: bytes) -> None:
        if self.closed:
            raise ChannelClosed("the connection to the ingress's stream channel is closed")
        self._writer.write(HEADER.pack(len(frame)) + frame)
        if self._drain is None and self._writer.transport.get_write_buffer_size() > WRITE_BUFFER_LIMIT_BYTES:
            self._drain = asyncio.ensure_future(self._drain_or_close())

    async def _drain_or_close(self) -> None:
        try:
            async with asyncio.timeout(DRAIN_TIMEOUT_S):
                await self._writer.drain()
        except (TimeoutError, ConnectionError) as exc:
            logger.warning("stream channel: closing the connection to the ingress, its %d unsent bytes did not drain "
                           "(%r)", self._writer.transport.get_write_buffer_size(), exc)
            self._writer.transport.abort()
        finally:
            self._drain = None

    def close(self) -> None:
        self._writer.close()


def _port(server: asyncio.Server) -> int:
    return server.sockets[0].getsockname()[1]
