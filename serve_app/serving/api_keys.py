"""API keys, one per tenant, reloadable without a restart.

Sources (either or both):
- an environment variable (`ServeConfig.api_key_env`) holding one key, tenant `default`;
- a keys file or directory (`ServeConfig.api_keys_file`), re-read when it changes:
  - a directory holds one file per tenant, named after the tenant, whose content is the key: what
    a Kubernetes Secret with one entry per tenant looks like when mounted as a volume (entries whose
    names start with "." are the kubelet's own and are skipped);
  - a file holds one `tenant: key` per line (blank lines and `#` comments are skipped).

Tenant names are 1-64 characters of letters, digits, `_`, `.` and `-` (they become metric labels and
log fields); keys are non-empty, without whitespace, and unique. The keyring keeps only SHA-256
digests of the full `Bearer <key>` header, so a lookup compares digests and no key is ever logged or
kept in a form that a metric or a repr could show.

Reload: `tenant_for` looks at the source's modification signature at most once every `reload_s`
and re-reads it when it changed (Kubernetes swaps a mounted Secret's files atomically). A source
that cannot be read or parsed at start-up raises `KeyringError`; a later bad version is refused
with a logged error and the previous keys stay in force.
"""

from __future__ import annotations

import hashlib
import logging
import re
import time
from collections.abc import Callable
from pathlib import Path

logger = logging.getLogger("ray.serve")

DEFAULT_TENANT = "default"
TENANT_PATTERN = re.compile(r"[A-Za-z0-9_.\-]{1,64}")


class KeyringError(ValueError):
    """An API-keys source that cannot be used (missing, unreadable, malformed)."""


def _digest(header: bytes) -> bytes:
    return hashlib.sha256(header).digest()


def parse_keys_file(text: str, origin: str = "keys file") -> dict[str, str]:
    """`tenant: key` lines → {tenant: key}."""
    keys: dict[str, str] = {}
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        tenant, sep, key = line.partition(":")
        if not sep:
            raise KeyringError(f"{origin} line {number}: expected 'tenant: key'")
        _add(keys, tenant.strip(), key.strip(), f"{origin} line {number}")
    return keys


def read_keys_dir(path: Path) -> dict[str, str]:
    """One file per tenant (a mounted Secret) → {tenant: key}."""
    keys: dict[str, str] = {}
    for entry in sorted(path.iterdir()):
        if entry.name.startswith(".") or not entry.is_file():
            continue
        _add(keys, entry.name, entry.read_text().strip(), str(entry))
    return keys


def _add(keys: dict[str, str], tenant: str, key: str, where: str) -> None:
    if not TENANT_PATTERN.fullmatch(tenant):
        raise KeyringError(f"{where}: tenant names are 1-64 letters, digits, '_', '.' or '-'")
    if not key or any(c.isspace() for c in key):
        raise KeyringError(f"{where}: tenant {tenant!r} has an empty key or one with whitespace")
    if tenant in keys:
        raise KeyringError(f"{where}: tenant {tenant!r} appears twice")
    if key in keys.values():
        raise KeyringError(f"{where}: tenant {tenant!r} reuses another tenant's key")
    keys[tenant] = key


def _signature(path: Path) -> tuple:
    """What changes when the source's content may have changed (stat follows symlinks)."""
    if path.is_dir():
        return tuple((e.name, (s := e.stat()).st_mtime_ns, s.st_size, s.st_ino)
                     for e in sorted(path.iterdir()) if not e.name.startswith(".") and e.is_file())
    s = path.stat()
    return (s.st_mtime_ns, s.st_size, s.st_ino)


class Keyring:
    """The API keys of one ingress replica: `tenant_for(authorization header)` → tenant or None.

    `enabled` is False only when no source is configured (the API is then open). With a source
    configured but holding no key, nobody authenticates: a keyring never fails open.
    """

    def __init__(self, env_key: str = "", keys_file: str = "", reload_s: float = 5.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._env_key = env_key
        self._path = Path(keys_file) if keys_file else None
        self._reload_s = reload_s
        self._clock = clock
        self._by_digest: dict[bytes, str] = {}
        self._signature: tuple | None = None
        self._checked_at = float("-inf")
        self.enabled = bool(env_key or keys_file)
        self._load(initial=True)

    @property
    def tenants(self) -> tuple[str, ...]:
        return tuple(sorted(self._by_digest.values()))

    @property
    def num_tenants(self) -> int:
        return len(self._by_digest)

    def tenant_for(self, authorization: bytes) -> str | None:
        """The tenant whose key is in this `Authorization` header value (`Bearer <key>`), else None."""
        self._maybe_reload()
        return self._by_digest.get(_digest(authorization)) if authorization else None

    def _maybe_reload(self) -> None:
        if self._path is None:
            return
        now = self._clock()
        if now - self._checked_at < self._reload_s:
            return
        self._checked_at = now
        self._load(initial=False)

    def _load(self, initial: bool) -> None:
        keys: dict[str, str] = {}
        signature = None
        try:
            if self._path is not None:
                signature = _signature(self._path)
                if not initial and signature == self._signature:
                    return
                keys = read_keys_dir(self._path) if self._path.is_dir() else parse_keys_file(self._path.read_text(), str(self._path))
            if self._env_key:
                _add(keys, DEFAULT_TENANT, self._env_key, "the API-key environment variable")
        except (OSError, KeyringError) as exc:
            if initial:
                raise KeyringError(f"api_keys_file: {exc}") from exc
            logger.error("API keys: kept the previous %d key(s); the new version is unusable: %s", self.num_tenants, exc)
            self._signature = signature  # do not re-read an unchanged bad version on every check
            return
        before = set(self._by_digest.values())
        self._by_digest = {_digest(f"Bearer {key}".encode()): tenant for tenant, key in keys.items()}
        self._signature = signature
        if not initial:
            now = set(self._by_digest.values())
            logger.info("API keys reloaded: %d tenant(s); added %s, removed %s", len(now),
                        sorted(now - before) or "none", sorted(before - now) or "none")
