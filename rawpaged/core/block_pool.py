"""The pool of physical KV blocks: explicit ownership, reference counts, copy-on-write, and the
prefix cache's hash -> block map. Knows block ids, never arrays.

Design as in the vLLM paper (Kwon et al., SOSP 2023, §4.2-4.4: reference counts, copy-on-write at block
granularity) and vLLM v1's ``BlockPool``:

* the free queue's order is the eviction order: a block whose ``ref_count`` drops to 0 goes to its tail,
  ``take`` pops its head (least recently freed);
* a freed block keeps its prefix-cache hash, so a later request can still hit it, until ``take`` hands it
  out for new data (eviction);
* a block with ``ref_count > 1`` is shared and read-only: the first write goes to a fresh copy
  (``copy_on_write``), recorded as a ``(src, dst)`` pair that the model runner copies, for every layer,
  before the step's kernels run.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field


class BlockPoolError(RuntimeError):
    """Misuse of the pool: a double free, or dropping a block its owner does not hold."""


@dataclass(slots=True)
class KVCacheBlock:
    """Attributes:
    block_id: index in ``[0, num_blocks)``; the block's slots are
        ``block_id * block_size .. block_id * block_size + block_size - 1``.
    ref_count: number of block tables holding the block (0: free).
    owners: the ``table_id`` of each of those tables.
    block_hash, token_ids: the prefix-cache identity of a full block (None when not cached).
    """

    block_id: int
    ref_count: int = 0
    owners: set = field(default_factory=set)
    block_hash: int | None = None
    token_ids: tuple | None = None


class BlockPool:
    """``num_blocks`` blocks. Taking a block from an empty pool is the caller's bug: check
    ``num_free_blocks`` first (``KVCacheManager`` does).

    Raises:
        ValueError: ``num_blocks < 1``.
    """

    def __init__(self, num_blocks: int):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))  # eviction order
        self._cached: dict[int, int] = {}  # block_hash -> block_id
        self._copies: list[tuple[int, int]] = []
        self.num_cow_copies = 0
        self.peak_used_blocks = 0
        #: called as ``on_evict(block_id, block_hash, token_ids)`` when ``take`` evicts a cached block, before
        #: it is handed out (the second KV tier keeps the block's contents)
        self.on_evict = None

    # ------------------------------------------------------------------ queries
    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def num_shared_blocks(self) -> int:
        return sum(1 for b in self.blocks if b.ref_count > 1)

    @property
    def num_cached_free_blocks(self) -> int:
        """Free blocks that still hold a reusable prefix (evictable)."""
        return sum(1 for i in self._free if self.blocks[i].block_hash is not None)

    def usage(self) -> float:
        """Fraction of blocks referenced by some table, in [0, 1]."""
        return self.num_used_blocks / self.num_blocks

    # ------------------------------------------------------------------ references
    def take(self, owner: int) -> KVCacheBlock:
        """The least recently freed block, now held by ``owner`` alone; its cached prefix (if any) is
        evicted, since new data will overwrite it."""
        bid, _ = self._free.popitem(last=False)
        block = self.blocks[bid]
        if block.block_hash is not None:
            if self._cached.get(block.block_hash) == bid:
                del self._cached[block.block_hash]
                if self.on_evict is not None:
                    self.on_evict(bid, block.block_hash, block.token_ids)
            block.block_hash = None
            block.token_ids = None
        block.ref_count = 1
        block.owners = {owner}
        self.peak_used_blocks = max(self.peak_used_blocks, self.num_blocks - len(self._free))
        return block

    def share(self, block_id: int, owner: int) -> None:
        """``owner`` holds ``block_id`` too (a fork, or a prefix-cache hit on a free cached block)."""
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self._free[block_id]
            self.peak_used_blocks = max(self.peak_used_blocks, self.num_blocks - len(self._free))
        block.ref_count += 1
        block.owners.add(owner)

    def release(self, block_id: int, owner: int, reuse_first: bool = False) -> None:
        """``owner`` lets go of ``block_id``; at ``ref_count`` 0 it joins the tail of the free queue with
        its cached prefix kept, or its head with ``reuse_first`` (a block whose contents nobody will
        look up: taken before any cached one). Raises BlockPoolError if ``owner`` does not hold it."""
        block = self.blocks[block_id]
        if owner not in block.owners:
            raise BlockPoolError(f"table {owner} does not own block {block_id}")
        block.owners.discard(owner)
        block.ref_count -= 1
        if block.ref_count == 0:
            self._free[block_id] = None
            if reuse_first:
                self._free.move_to_end(block_id, last=False)

    def copy(self, block_id: int, owner: int) -> int:
        """A fresh block for ``owner`` that will hold a copy of ``block_id``: records
        ``(block_id, new)`` for ``take_copies`` and returns the new block id."""
        dst = self.take(owner)
        self._copies.append((block_id, dst.block_id))
        return dst.block_id

    def copy_on_write(self, block_id: int, owner: int) -> int:
        """Replace ``owner``'s reference to the shared ``block_id`` by a fresh copy (see ``copy``);
        returns the new block id."""
        dst = self.copy(block_id, owner)
        self.release(block_id, owner)
        self.num_cow_copies += 1
        return dst

    def take_copies(self) -> list:
        """The ``(src, dst)`` block copies recorded since the last call, to run before the kernels."""
        copies, self._copies = self._copies, []
        return copies

    # ------------------------------------------------------------------ prefix cache
    def get_cached_block(self, block_hash: int, token_ids: tuple) -> int | None:
        """The block holding the full block ``token_ids`` whose chained hash is ``block_hash``, if cached
        (the token ids are compared too, so a hash collision is never a hit)."""
        bid = self._cached.get(block_hash)
        if bid is None or self.blocks[bid].token_ids != token_ids:
            return None
        return bid

    def cache_block(self, block_id: int, block_hash: int, token_ids: tuple) -> None:
        """Make a full block findable by its hash, unless it or another block already is."""
        block = self.blocks[block_id]
        if block.block_hash is None and block_hash not in self._cached:
            block.block_hash = block_hash
            block.token_ids = token_ids
            self._cached[block_hash] = block_id

    # ------------------------------------------------------------------ checks
    def check_invariants(self) -> None:
        """Assert free + referenced == total; each block free exactly when its ``ref_count`` is 0, which
        equals its number of owners; every hash map entry names a block carrying that hash."""
        referenced = sum(1 for b in self.blocks if b.ref_count > 0)
        assert len(self._free) + referenced == self.num_blocks, "free + referenced != total"
        for b in self.blocks:
            assert b.ref_count >= 0, f"block {b.block_id} ref_count {b.ref_count} < 0"
            assert b.ref_count == len(b.owners), f"block {b.block_id} ref_count != owners"
            assert (b.ref_count == 0) == (b.block_id in self._free), f"block {b.block_id} free/referenced"
        for h, bid in self._cached.items():
            assert self.blocks[bid].block_hash == h, f"cache entry {h} -> block {bid} is stale"
