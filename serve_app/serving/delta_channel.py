"""A direct TCP channel from LLMServer replicas to one ingress replica, for multiplexed stream deltas.

The ingress replica listens (`ChannelServer`); each replica that serves its streams opens one
connection to it (`ChannelSender`) and writes length-prefixed frames, in order. Compared with a relay
actor between them, a frame costs one socket write and one read: no extra process, no Ray task per
flush.

Authentication: every ingress replica draws a random secret, which reaches replicas inside the
requests it sends them over Ray (`ChannelAddress`, never printed). A connection must present it as
its first bytes within `HANDSHAKE_TIMEOUT_S`; otherwise, or on a frame over `MAX_FRAME_BYTES`, the
connection is closed before any frame is handed on. Frames are only decoded after that check.

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

logger = logging.getLogger("ray.serve")

HEADER = struct.Struct("!I")  # a frame's length in bytes, then the frame
SECRET_BYTES = 32
HANDSHAKE_TIMEOUT_S = 5.0
MAX_FRAME_BYTES = 64 << 20
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
    order each connection sent them (frames of different connections interleave)."""

    def __init__(self, on_frame: Callable[[bytes], None]) -> None:
        self._on_frame = on_frame
        self._secret = secrets.token_bytes(SECRET_BYTES)
        self._servers: list[asyncio.Server] = []

    async def start(self, node_id: str, node_ip: str) -> ChannelAddress:
        loopback = await asyncio.start_server(self._serve, LOOPBACK, 0)
        self._servers.append(loopback)
        node = loopback
        if node_ip != LOOPBACK:
            node = await asyncio.start_server(self._serve, node_ip, 0)
            self._servers.append(node)
        return ChannelAddress(node_id, node_ip, _port(node), _port(loopback), self._secret)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = writer.get_extra_info("peername")
        try:
            secret = await asyncio.wait_for(reader.readexactly(SECRET_BYTES), HANDSHAKE_TIMEOUT_S)
            if not hmac.compare_digest(secret, self._secret):
                logger.warning("stream channel: refused a connection from %s (wrong secret)", peer)
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
        except Exception:  # an undecodable frame from an authenticated peer: a bug, not an attack
            logger.exception("stream channel: closed the connection from %s", peer)
        finally:
            writer.close()

    def close(self) -> None:
        for server in self._servers:
            server.close()


class ChannelSender:
    """Replica side: one connection to one ingress. `send` queues a frame on the socket (never
    blocks); it raises `ChannelClosed` once the connection is gone."""

    def __init__(self, writer: asyncio.StreamWriter) -> None:
        self._writer = writer

    @classmethod
    async def connect(cls, address: ChannelAddress, node_id: str) -> ChannelSender:
        host, port = address.endpoint(node_id)
        try:
            reader, writer = await asyncio.open_connection(host, port)
        except OSError as exc:
            raise ChannelClosed(f"cannot reach the ingress's stream channel at {host}:{port}: {exc}") from exc
        writer.write(address.secret)
        # the ingress never writes back: the reader only takes note of the connection closing
        del reader
        return cls(writer)

    @property
    def closed(self) -> bool:
        return self._writer.is_closing()

    def send(self, frame: bytes) -> None:
        if self.closed:
            raise ChannelClosed("the connection to the ingress's stream channel is closed")
        self._writer.write(HEADER.pack(len(frame)) + frame)

    def close(self) -> None:
        self._writer.close()


def _port(server: asyncio.Server) -> int:
    return server.sockets[0].getsockname()[1]
