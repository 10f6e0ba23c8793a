"""Paged KV-cache bookkeeping: fixed-size blocks, a free list, ref counts, per-request block tables,
and a prefix cache keyed by the content of full blocks.

This class never touches tensors: block ids index the model runner's cache tensors.

Invariants (asserted by `check_integrity`):
- every block is either free (ref_count 0, in the free queue) or used (ref_count > 0), never both;
- a block's ref_count equals the number of block tables that hold it;
- the prefix-cache map points only at blocks whose `block_hash` is that key.

Prefix caching: when a block is full of computed tokens it gets a hash chained from its parent's
hash and its token ids (SHA-256, serve_app/block_hash.py: collision-resistant, and the same in every
process, so a router can compute the keys this cache holds). A new request whose
prompt starts with the same blocks shares them (ref_count > 1). Freed hashed blocks stay cached in
the free queue, ordered least-recently-used first, and are evicted only when allocation needs them.

With an `events` log, every block entering the prefix cache is reported as stored and every block
leaving it (evicted, reset) as removed, so routers can track what this cache holds.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from serve_app.block_hash import BlockHash, extend_block_hashes, max_cacheable_blocks
from serve_app.engine.kv_events import KVEventLog
from serve_app.engine.request import Request


@dataclass(eq=False)
class KVBlock:
    block_id: int
    ref_count: int = 0
    block_hash: BlockHash | None = None


def cdiv(a: int, b: int) -> int:
    return -(a // -b)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 events: KVEventLog | None = None, cache_generated_blocks: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError("num_blocks: must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        # False: only blocks of prompt tokens enter the prefix cache (the model runner's K/V for generated
        # tokens comes from another kernel than a prompt's: `ModelRunner.shares_output_blocks`)
        self.cache_generated_blocks = cache_generated_blocks
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        # free blocks in eviction order: front = first to be reused
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._cached: dict[BlockHash, int] = {}  # block hash -> block id
        self._tables: dict[str, list[int]] = {}
        self._num_hashed: dict[str, int] = {}  # leading blocks of a table already in the prefix cache
        self.events = events

    # ---- queries -------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    def block_table(self, request_id: str) -> list[int]:
        return self._tables.get(request_id, [])

    # ---- prefix cache --------------------------------------------------------------------------
    def _extend_hashes(self, request: Request, num_full_blocks: int) -> None:
        extend_block_hashes(request.block_hashes, request.all_token_ids, self.block_size, num_full_blocks,
                            request.cache_salt)

    def find_cached_prefix(self, request: Request) -> list[int]:
        """Block ids holding the longest cached prefix of the request's tokens.

        At least one token is always left to compute (its logits are needed to sample), so a block
        that holds the last token is never served from the cache.
        """
        if not self.enable_prefix_caching:
            return []
        max_blocks = max_cacheable_blocks(request.num_tokens, self.block_size)
        self._extend_hashes(request, max_blocks)
        hits: list[int] = []
        for block_hash in request.block_hashes[:max_blocks]:
            block_id = self._cached.get(block_hash)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def uncomputed_prompt_hashes(self, request: Request) -> list[BlockHash]:
        """Hashes of the request's full prompt blocks not yet computed (empty without prefix caching):
        what its prefill will add to the prefix cache."""
        if not self.enable_prefix_caching:
            return []
        num_full = request.num_prompt_tokens // self.block_size
        self._extend_hashes(request, num_full)
        return request.block_hashes[request.num_computed_tokens // self.block_size:num_full]

    def next_uncached_hash(self, request: Request, num_cached_blocks: int) -> BlockHash | None:
        """The hash of the first block `find_cached_prefix` did not find (None: nothing more cacheable)."""
        max_blocks = max_cacheable_blocks(request.num_tokens, self.block_size)
        if not self.enable_prefix_caching or num_cached_blocks >= max_blocks:
            return None
        return request.block_hashes[num_cached_blocks]

    def cache_full_blocks(self, request: Request) -> None:
        """Publish the request's blocks that are now full of computed tokens to the prefix cache."""
        if not self.enable_prefix_caching:
            return
        rid = request.request_id
        table = self._tables.get(rid)
        if table is None:
            return
        computed = request.num_computed_tokens if self.cache_generated_blocks else min(request.num_computed_tokens,
                                                                                        request.num_prompt_tokens)
        num_full = min(computed // self.block_size, len(table))
        start = self._num_hashed.get(rid, 0)
        if num_full <= start:
            return
        self._extend_hashes(request, num_full)
        for i in range(start, num_full):
            block = self.blocks[table[i]]
            block_hash = request.block_hashes[i]
            if block.block_hash is None and block_hash not in self._cached:
                block.block_hash = block_hash
                self._cached[block_hash] = block.block_id
                if self.events is not None:
                    self.events.stored(block_hash)
        self._num_hashed[rid] = num_full

    # ---- allocation ----------------------------------------------------------------------------
    def can_allocate(self, request: Request, num_new_tokens: int, cached_blocks: list[int] = ()) -> bool:
        return self._num_needed(request, num_new_tokens, cached_blocks) <= self.num_free_blocks - sum(
            1 for b in cached_blocks if self.blocks[b].ref_count == 0
        )

    def _num_needed(self, request: Request, num_new_tokens: int, cached_blocks: list[int]) -> int:
        table = self._tables.get(request.request_id, ())
        total = request.num_computed_tokens + len(cached_blocks) * self.block_size + num_new_tokens
        return max(0, cdiv(total, self.block_size) - len(table) - len(cached_blocks))

    def allocate_slots(self, request: Request, num_new_tokens: int, cached_blocks: list[int] = ()) -> bool:
        """Make room for `num_new_tokens` more tokens after the computed ones (and after
        `cached_blocks`, a prefix from `find_cached_prefix`, which the request then shares).

        Returns False, changing nothing, when there are not enough free blocks.
        """
        if not self.can_allocate(request, num_new_tokens, cached_blocks):
            return False
        num_needed = self._num_needed(request, num_new_tokens, cached_blocks)
        table = self._tables.setdefault(request.request_id, [])
        for block_id in cached_blocks:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self._free[block_id]
            block.ref_count += 1
            table.append(block_id)
        if cached_blocks:
            self._num_hashed[request.request_id] = len(table)
        for _ in range(num_needed):
            block_id, _ = self._free.popitem(last=False)
            block = self.blocks[block_id]
            if block.block_hash is not None:  # evict from the prefix cache
                self._uncache(block)
            block.ref_count = 1
            table.append(block_id)
        return True

    def trim(self, request_id: str, num_tokens: int) -> None:
        """Release the blocks past the first `num_tokens` slots (rejected speculative tokens' slots).
        Those blocks never reached the prefix cache: only blocks full of computed tokens do."""
        table = self._tables.get(request_id)
        if not table:
            return
        keep = cdiv(num_tokens, self.block_size)
        while len(table) > keep:
            block = self.blocks[table.pop()]
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[block.block_id] = None
                if block.block_hash is None:
                    self._free.move_to_end(block.block_id, last=False)

    def free(self, request_id: str) -> None:
        """Release a request's blocks. Unhashed blocks are reused first; hashed ones stay cached,
        tail blocks ahead of head blocks (a shared head outlives its tails)."""
        table = self._tables.pop(request_id, None)
        self._num_hashed.pop(request_id, None)
        if not table:
            return
        for block_id in reversed(table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[block_id] = None
                if block.block_hash is None:
                    self._free.move_to_end(block_id, last=False)

    def reset_prefix_cache(self) -> None:
        for block_id in list(self._cached.values()):
            if self.blocks[block_id].ref_count == 0:
                self._uncache(self.blocks[block_id])

    def _uncache(self, block: KVBlock) -> None:
        del self._cached[block.block_hash]
        if self.events is not None:
            self.events.removed(block.block_hash)
        block.block_hash = None

    # ---- invariants ----------------------------------------------------------------------------
    def check_integrity(self) -> None:
        refs = [0] * self.num_blocks
        for table in self._tables.values():
            for block_id in table:
                refs[block_id] += 1
        for block in self.blocks:
            assert block.ref_count == refs[block.block_id], f"block {block.block_id}: ref {block.ref_count} != {refs[block.block_id]}"
            assert (block.ref_count == 0) == (block.block_id in self._free), f"block {block.block_id}: free-list mismatch"
        for block_hash, block_id in self._cached.items():
            assert self.blocks[block_id].block_hash == block_hash, f"block {block_id}: stale cache entry"
        assert self.num_free_blocks + sum(1 for r in refs if r) == self.num_blocks, "free + used != total"
