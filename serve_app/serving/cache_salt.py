"""The prefix-cache salt of a request: whose cached prefixes it may reuse (and time).

Requests with equal salts share cached blocks; different salts never match (the salt enters every
block hash in the engine, the router's block keys and vLLM's). The salt combines:
- the server's part (`ServeConfig.prefix_cache_salt`): `tenant` → the request's tenant; `auto` →
  the tenant whenever more than one tenant has a key (else nothing); `api_key` → a digest of the
  bearer token; `none` → nothing;
- the request's own `cache_salt` (as in vLLM's API), which can only narrow sharing further: it is
  appended after the server's part, so no request salt reaches another tenant's blocks.
No part at all: None, the shared cache. Otherwise a fixed-length digest of the labelled parts.
"""

from __future__ import annotations

import hashlib

MAX_REQUEST_SALT_CHARS = 1024


def cache_salt(mode: str, tenant: str | None, num_tenants: int, authorization: str | None,
               request_salt: str | None) -> str | None:
    parts = []
    if (mode == "tenant" or (mode == "auto" and num_tenants > 1)) and tenant:
        parts.append(f"tenant:{tenant}")
    elif mode == "api_key" and authorization:
        parts.append("key:" + hashlib.sha256(authorization.encode()).hexdigest())
    if request_salt is not None:
        parts.append(f"request:{request_salt}")
    if not parts:
        return None
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:32]
