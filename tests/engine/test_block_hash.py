"""The prefix cache's block hash: collision-resistant, chained, and the same in every process."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys

from serve_app.block_hash import hash_block, prefix_block_hashes, root_hash
from serve_app.engine.block_manager import BlockManager
from serve_app.engine.request import Request
from serve_app.types import SamplingParams

TOKENS = [1, 9, 9, 7, 49151, 0, 2, 3, 5, 8, 13, 21]


def reference_hashes(token_ids: list[int], block_size: int, salt: bytes | None = None) -> list[bytes]:
    """A second, independent implementation of the documented construction."""
    domain = b"serve_app.kv-block.v1"
    parent = hashlib.sha256(domain + (b"\x00salt\x00" + salt if salt else b"")).digest()
    out = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        data = b"".join(t.to_bytes(4, "little") for t in token_ids[start : start + block_size])
        parent = hashlib.sha256(parent + data).digest()
        out.append(parent)
    return out


def test_matches_an_independent_implementation() -> None:
    assert prefix_block_hashes(TOKENS, 4) == reference_hashes(TOKENS, 4)
    assert prefix_block_hashes(TOKENS, 5, salt=b"tenant-a") == reference_hashes(TOKENS, 5, b"tenant-a")
    assert len(prefix_block_hashes(TOKENS, 5)) == 2  # only full blocks


def test_chained_and_salted() -> None:
    a = prefix_block_hashes(TOKENS, 4)
    b = prefix_block_hashes([99] + TOKENS[1:], 4)
    assert all(x != y for x, y in zip(a, b, strict=True))  # a different first block changes every later hash
    assert prefix_block_hashes(TOKENS, 4, salt=b"t1") != a
    assert prefix_block_hashes(TOKENS, 4, salt=b"t1") != prefix_block_hashes(TOKENS, 4, salt=b"t2")
    assert hash_block(root_hash(), TOKENS[:4]) == a[0]


def test_same_in_every_process() -> None:
    code = ("from serve_app.block_hash import prefix_block_hashes; "
            f"print(b''.join(prefix_block_hashes({TOKENS}, 4)).hex())")
    digests = {
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                       env={**os.environ, "PYTHONHASHSEED": seed}).stdout.strip()
        for seed in ("0", "1", "12345")
    }
    assert digests == {b"".join(prefix_block_hashes(TOKENS, 4)).hex()}


def test_block_manager_keys_its_cache_by_these_hashes() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    req = Request("r", list(TOKENS), SamplingParams(max_tokens=1), eos_token_ids=None, arrival_time=0.0)
    assert bm.allocate_slots(req, len(TOKENS))
    req.num_computed_tokens = len(TOKENS)
    bm.cache_full_blocks(req)
    assert set(bm._cached) == set(prefix_block_hashes(TOKENS, 4))
    bm.check_integrity()
