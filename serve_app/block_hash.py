"""Content hashes of full KV-cache blocks: the prefix cache's keys, shared by the engine and routers.

A block's hash is SHA-256 over its parent block's hash and its own token ids, so two blocks hash
equal only when their whole prefixes are equal (up to a SHA-256 collision, which nobody can
construct). The hash depends on nothing but its inputs: it is the same in every process and on
every machine (unlike Python's `hash()`, which is also easy to collide on purpose), so a router can
compute exactly the keys an engine will look up.

An optional salt changes the root of the chain: prompts hashed with different salts never share a
block, which keeps tenants from reading (or timing) each other's cached prefixes.

This module imports only the standard library: the serving layer uses it without torch.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Container, Sequence

BlockHash = bytes  # 32-byte SHA-256 digest

_DOMAIN = b"serve_app.kv-block.v1"
_UNSALTED_ROOT: BlockHash = hashlib.sha256(_DOMAIN).digest()


def root_hash(salt: bytes | None = None) -> BlockHash:
    """The parent of a sequence's first block (distinct for every salt; `None` = shared)."""
    if not salt:
        return _UNSALTED_ROOT
    return hashlib.sha256(_DOMAIN + b"\x00salt\x00" + salt).digest()


def hash_block(parent: BlockHash, token_ids: Sequence[int]) -> BlockHash:
    """Hash of one block whose prefix hashes to `parent`. Token ids must fit in 32 bits."""
    return hashlib.sha256(parent + struct.pack(f"<{len(token_ids)}I", *token_ids)).digest()


def extend_block_hashes(hashes: list[BlockHash], token_ids: Sequence[int], block_size: int,
                        num_full_blocks: int, salt: bytes | None = None) -> list[BlockHash]:
    """Append to `hashes` (the chain of the first len(hashes) blocks of `token_ids`) until it covers
    `num_full_blocks` blocks; returns `hashes`. The caller guarantees those blocks are full."""
    parent = hashes[-1] if hashes else root_hash(salt)
    for i in range(len(hashes), num_full_blocks):
        parent = hash_block(parent, token_ids[i * block_size : (i + 1) * block_size])
        hashes.append(parent)
    return hashes


def block_key(block_hash: BlockHash) -> int:
    """A 64-bit key for routing (the hash's first 8 bytes): compact to publish, and a collision
    could only mis-route a request, never serve it another prefix's KV."""
    return int.from_bytes(block_hash[:8], "little")


def prefix_block_hashes(token_ids: Sequence[int], block_size: int, salt: bytes | None = None) -> list[BlockHash]:
    """Hashes of every full block of `token_ids`, first block first."""
    return extend_block_hashes([], token_ids, block_size, len(token_ids) // block_size, salt)


def max_cacheable_blocks(num_tokens: int, block_size: int) -> int:
    """Leading blocks an engine may serve from its prefix cache: every full block but one holding the
    last token (its logits are needed to sample, so it is always computed)."""
    return max(num_tokens - 1, 0) // block_size


def prompt_block_keys(token_ids: Sequence[int], block_size: int, salt: str | None = None) -> list[int]:
    """Routing keys of the prompt blocks an engine can serve from its prefix cache
    (`max_cacheable_blocks`), first block first."""
    num_blocks = max_cacheable_blocks(len(token_ids), block_size)
    hashes = prefix_block_hashes(token_ids[: num_blocks * block_size], block_size, salt.encode() if salt else None)
    return [block_key(h) for h in hashes]


def leading_run(keys: Sequence[int], held: Container[int]) -> int:
    """How many of `keys` (chained block keys, first block first) `held` has, from the first on."""
    n = 0
    for key in keys:
        if key not in held:
            break
        n += 1
    return n
