"""Fail closed: an API reachable beyond this machine never starts without authentication.

The address the API answers on is Serve's `http_options.host` (its proxies bind it, and so do
ingress replicas under direct ingress). `check_exposure` refuses a non-loopback host when no API key
is configured, unless the config says `allow_unauthenticated: true` (an operator who put an
authenticating gateway in front: docs/security.md). The ingress replica asks Serve's controller for
the host at start-up (`serve_http_host`); if it cannot tell, it treats the API as exposed.
"""

from __future__ import annotations

import ipaddress
import logging

logger = logging.getLogger("ray.serve")

LOOPBACK_NAMES = frozenset({"localhost", "ip6-localhost", "ip6-loopback"})


class UnauthenticatedExposure(RuntimeError):
    """A start-up refused: the API would be reachable from the network without a key."""


def is_loopback(host: str | None) -> bool:
    """True only for addresses (and names) that never leave the machine."""
    if not host:
        return False
    if host.lower() in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # another host name: it may resolve to anything


def check_exposure(host: str | None, authenticated: bool, allow_unauthenticated: bool) -> None:
    """Raise `UnauthenticatedExposure` for a non-loopback `host` without authentication, unless allowed."""
    if authenticated or is_loopback(host):
        return
    if allow_unauthenticated:
        logger.warning("the API answers on %s without an API key (allow_unauthenticated: true): anyone who reaches "
                       "that address can use it; only do this behind a gateway that authenticates", host)
        return
    raise UnauthenticatedExposure(
        f"refusing to start: the API would answer on {host or 'an unknown address'} (not loopback) without an API "
        "key. Set the key variable named by api_key_env or api_keys_file, bind http_options.host to 127.0.0.1, "
        "or set allow_unauthenticated: true if a gateway in front authenticates (docs/security.md)")


async def serve_http_host() -> str | None:
    """The HTTP host Serve's proxies (and direct-ingress replicas) bind, from Serve's controller; None
    when it cannot be asked (the caller then treats the API as exposed)."""
    try:
        from ray.serve.context import _get_global_client

        controller = _get_global_client()._controller
        return (await controller.get_http_config.remote()).host
    except Exception as exc:  # noqa: BLE001 - unknown means exposed: fail closed
        logger.warning("could not read Serve's HTTP host (%r): treating the API as reachable from the network", exc)
        return None
