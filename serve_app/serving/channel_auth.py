"""The stream channel's handshake: a challenge both ends answer with an HMAC, and a gate that bounds
how many handshakes an ingress accepts.

Handshake (after TCP connect, before any frame):

    ingress → replica   server nonce (32 random bytes, fresh per connection)
    replica → ingress   client nonce (32 random bytes) + HMAC-SHA256(secret, "replica" | server nonce | client nonce)
    ingress → replica   HMAC-SHA256(secret, "ingress" | server nonce | client nonce)

The secret itself never crosses the connection, so a recorded handshake proves nothing on a later
connection (its server nonce differs), and each side proves it holds the secret: a replica never
sends deltas to a listener that took over the ingress's port.
"""

from __future__ import annotations

import hashlib
import hmac
import time
from collections.abc import Callable

NONCE_BYTES = 32
PROOF_BYTES = hashlib.sha256().digest_size
_REPLICA = b"serve_app stream channel v2: replica"
_INGRESS = b"serve_app stream channel v2: ingress"


def replica_proof(secret: bytes, server_nonce: bytes, client_nonce: bytes) -> bytes:
    return hmac.new(secret, _REPLICA + server_nonce + client_nonce, hashlib.sha256).digest()


def ingress_proof(secret: bytes, server_nonce: bytes, client_nonce: bytes) -> bytes:
    return hmac.new(secret, _INGRESS + server_nonce + client_nonce, hashlib.sha256).digest()


class HandshakeGate:
    """Admits a connection to the handshake only within a rate and a concurrency bound.

    A token bucket refills `rate_per_s` tokens a second up to `burst`; each admitted handshake takes
    one, and at most `max_pending` handshakes run at once (each holds a socket for up to the
    handshake timeout). `enter()` is False when either bound is hit: the caller closes the
    connection at once, before reading a byte. `leave()` ends an admitted handshake. `admitted` and
    `refused` count both outcomes; `take_refused_for_log()` returns the refusals since the last call, at most once
    a second (0 otherwise), so a flood logs one line a second, not one per connection.
    """

    def __init__(self, rate_per_s: float, burst: int, max_pending: int, clock: Callable[[], float] = time.monotonic) -> None:
        if rate_per_s <= 0 or burst < 1 or max_pending < 1:
            raise ValueError("handshake gate: rate_per_s > 0, burst >= 1 and max_pending >= 1")
        self._rate_per_s = rate_per_s
        self._burst = float(burst)
        self._max_pending = max_pending
        self._clock = clock
        self._tokens = float(burst)
        self._last = clock()
        self.pending = 0
        self.admitted = 0
        self.refused = 0
        self._logged_refused = 0
        self._logged_at = float("-inf")

    def enter(self) -> bool:
        now = self._clock()
        self._tokens = min(self._burst, self._tokens + (now - self._last) * self._rate_per_s)
        self._last = now
        if self.pending >= self._max_pending or self._tokens < 1.0:
            self.refused += 1
            return False
        self._tokens -= 1.0
        self.pending += 1
        self.admitted += 1
        return True

    def leave(self) -> None:
        self.pending -= 1

    def take_refused_for_log(self) -> int:
        now = self._clock()
        if now - self._logged_at < 1.0 or self.refused == self._logged_refused:
            return 0
        count, self._logged_refused, self._logged_at = self.refused - self._logged_refused, self.refused, now
        return count
