"""Physical KV-cache blocks with explicit ownership, reference counts and copy-on-write.

The allocator knows no arrays: it hands out block ids in ``[0, num_blocks)`` and records which
``BlockTable`` owns which block. Design follows the vLLM paper (Kwon et al., SOSP 2023, §4.2-4.4:
block tables, reference counts, copy-on-write at block granularity) and vLLM v1's block pool
(a free queue whose order is the eviction order; freed blocks keep their prefix hash until they are
taken for new data).

Terms
-----
* ``block_size``: tokens per block.
* ``BlockTable``: one sequence's list of physical block ids (logical block i -> ``block_ids[i]``) and
  ``num_tokens``, the number of KV slots it has reserved (positions ``0 .. num_tokens-1``). Slot of
  position p: ``block_ids[p // block_size] * block_size + p % block_size``.
* ``ref_count``: number of tables holding a block. A block with ``ref_count > 1`` is shared and
  read-only: the first write into it goes to a fresh copy (copy-on-write), recorded as a
  ``(src, dst)`` pair the model runner copies before the step's kernels run (``drain_copies``).
* Prefix caching: a full block may carry ``block_hash``, chained from the previous block's hash
  and the block's token ids. Freed hashed blocks stay findable until they are reused.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from itertools import count


class BlockAllocatorError(RuntimeError):
    """Misuse of the allocator: double free, freeing a block the table does not own, etc."""


@dataclass(slots=True)
class KVCacheBlock:
    block_id: int
    ref_count: int = 0
    owners: set = field(default_factory=set)
    # Prefix-cache identity of a full block: (hash, token ids); None when not cached.
    block_hash: int | None = None
    token_ids: tuple | None = None


@dataclass(slots=True, eq=False)
class BlockTable:
    """A sequence's view of the KV pool. Mutated only through its ``BlockAllocator``."""

    table_id: int
    block_size: int
    block_ids: list = field(default_factory=list)
    num_tokens: int = 0
    freed: bool = False
    block_hashes: list = field(default_factory=list)  # chained hashes of the leading full blocks

    def slot(self, position: int) -> int:
        """Flat slot index of ``position``: ``block_id * block_size + offset``."""
        if not 0 <= position < self.num_tokens:
            raise IndexError(f"position {position} outside reserved slots [0, {self.num_tokens})")
        return self.block_ids[position // self.block_size] * self.block_size + position % self.block_size

    def slots(self, start: int, end: int) -> list:
        """Slots of positions ``start .. end-1`` (the ``slot_mapping`` of those tokens)."""
        if not 0 <= start <= end <= self.num_tokens:
            raise IndexError(f"slot range [{start}, {end}) outside reserved slots [0, {self.num_tokens})")
        bs = self.block_size
        ids = self.block_ids
        return [ids[p // bs] * bs + p % bs for p in range(start, end)]


class BlockAllocator:
    """A fixed pool of ``num_blocks`` KV blocks of ``block_size`` tokens.

    Running out of blocks is not an error: ``allocate_slots`` returns ``False`` and changes nothing,
    so the scheduler can preempt or wait. Misuse (double free, foreign blocks) raises
    ``BlockAllocatorError``.
    """

    def __init__(self, num_blocks: int, block_size: int = 16, enable_prefix_caching: bool = False):
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be > 0, got {num_blocks}")
        if block_size <= 0:
            raise ValueError(f"block_size must be > 0, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        # Free blocks in eviction order (least recently freed first). Values unused.
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._cached: dict[int, int] = {}  # block_hash -> block_id
        self._pending_copies: list[tuple[int, int]] = []
        self._table_ids = count()
        # Counters for stats.
        self.num_cow_copies = 0
        self.num_prefix_queries = 0  # blocks looked up
        self.num_prefix_hits = 0  # blocks found
        self.peak_used_blocks = 0

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

    def blocks_needed(self, table: BlockTable, num_new_tokens: int) -> int:
        """Free blocks ``allocate_slots(table, num_new_tokens)`` would take (including a COW copy)."""
        bs = self.block_size
        have = len(table.block_ids)
        need = -(-(table.num_tokens + num_new_tokens) // bs) - have
        if num_new_tokens > 0 and table.num_tokens % bs and self.blocks[table.block_ids[-1]].ref_count > 1:
            need += 1  # the partly filled last block is shared: it must be copied before writing
        return need

    # ---------------------------------------------------------------- mutation
    def new_table(self) -> BlockTable:
        return BlockTable(next(self._table_ids), self.block_size)

    def allocate_slots(self, table: BlockTable, num_new_tokens: int) -> bool:
        """Reserve KV slots for ``num_new_tokens`` more tokens of ``table``.

        Allocates new blocks as the table crosses block boundaries; if the partly filled last block is
        shared, replaces it by a fresh block and records ``(src, dst)`` for ``drain_copies``.
        Returns False, changing nothing, when the pool has too few free blocks.
        """
        self._check_live(table)
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        if num_new_tokens == 0:
            return True
        if self.blocks_needed(table, num_new_tokens) > len(self._free):
            return False
        bs = self.block_size
        if table.num_tokens % bs:
            last = self.blocks[table.block_ids[-1]]
            if last.ref_count > 1:
                dst = self._take_free_block(table)
                self._drop_ref(last, table)
                table.block_ids[-1] = dst.block_id
                self._pending_copies.append((last.block_id, dst.block_id))
                self.num_cow_copies += 1
        table.num_tokens += num_new_tokens
        while len(table.block_ids) * bs < table.num_tokens:
            table.block_ids.append(self._take_free_block(table).block_id)
        return True

    def fork(self, table: BlockTable, share: bool = True) -> BlockTable | None:
        """A new table with the same contents as ``table``.

        ``share=True`` (the point of paging): every block is shared, ``ref_count`` + 1, no copy.
        ``share=False`` (baseline for measurements): fresh blocks, each recorded as a ``(src, dst)``
        copy; returns None, changing nothing, if the pool lacks the blocks.
        """
        self._check_live(table)
        child = self.new_table()
        child.num_tokens = table.num_tokens
        child.block_hashes = list(table.block_hashes)
        if not share:
            if len(table.block_ids) > len(self._free):
                return None
            for bid in table.block_ids:
                dst = self._take_free_block(child)
                child.block_ids.append(dst.block_id)
                self._pending_copies.append((bid, dst.block_id))
            return child
        child.block_ids = list(table.block_ids)
        for bid in child.block_ids:
            block = self.blocks[bid]
            block.ref_count += 1
            block.owners.add(child.table_id)
        return child

    def free(self, table: BlockTable) -> None:
        """Drop the table's reference to each of its blocks; blocks reaching 0 become free.

        Raises ``BlockAllocatorError`` if the table was already freed or holds a block it does not own.
        """
        self._check_live(table)
        for bid in table.block_ids:
            if table.table_id not in self.blocks[bid].owners:
                raise BlockAllocatorError(f"table {table.table_id} does not own block {bid}")
        # Free in reverse so a sequence's tail blocks are evicted before its prefix (vLLM v1 order).
        for bid in reversed(table.block_ids):
            self._drop_ref(self.blocks[bid], table)
        table.block_ids = []
        table.block_hashes = []
        table.num_tokens = 0
        table.freed = True

    def drain_copies(self) -> list:
        """The ``(src, dst)`` block copies recorded since the last call, to run before the kernels."""
        copies, self._pending_copies = self._pending_copies, []
        return copies

    # ---------------------------------------------------------- prefix caching
    @staticmethod
    def hash_block(parent_hash: int | None, token_ids: tuple, extra_key=None) -> int:
        """Chained hash of a full block: depends on every token before it and ``extra_key``."""
        return hash((parent_hash, token_ids, extra_key))

    def block_hashes(self, token_ids: list, extra_key=None) -> list:
        """Hashes of the full blocks of ``token_ids`` (chained), one per full block."""
        bs = self.block_size
        hashes, parent = [], None
        for i in range(len(token_ids) // bs):
            parent = self.hash_block(parent, tuple(token_ids[i * bs:(i + 1) * bs]), extra_key)
            hashes.append(parent)
        return hashes

    def find_cached_prefix(self, token_ids: list, extra_key=None, max_blocks: int | None = None) -> list:
        """Block ids of the longest cached prefix of ``token_ids`` (full blocks, token ids verified)."""
        if not self.enable_prefix_caching:
            return []
        bs = self.block_size
        found = []
        for i, h in enumerate(self.block_hashes(token_ids, extra_key)):
            if max_blocks is not None and i >= max_blocks:
                break
            self.num_prefix_queries += 1
            bid = self._cached.get(h)
            if bid is None or self.blocks[bid].token_ids != tuple(token_ids[i * bs:(i + 1) * bs]):
                break
            self.num_prefix_hits += 1
            found.append(bid)
        return found

    def attach_cached_prefix(self, table: BlockTable, block_ids: list) -> None:
        """Make an empty ``table`` start with the cached full blocks ``block_ids`` (refs + 1)."""
        self._check_live(table)
        if table.block_ids:
            raise BlockAllocatorError("cached prefix can only be attached to an empty table")
        for bid in block_ids:
            block = self.blocks[bid]
            if block.ref_count == 0:
                del self._free[bid]
            block.ref_count += 1
            block.owners.add(table.table_id)
            table.block_ids.append(bid)
            table.block_hashes.append(block.block_hash)
        table.num_tokens = len(block_ids) * self.block_size

    def needs_caching(self, table: BlockTable, num_computed: int) -> bool:
        """True when ``num_computed`` tokens fill blocks that ``cache_full_blocks`` has not hashed."""
        return self.enable_prefix_caching and num_computed // self.block_size > len(table.block_hashes)

    def cache_full_blocks(self, table: BlockTable, token_ids: list, num_computed: int, extra_key=None) -> None:
        """Hash and register the table's newly completed full blocks (first ``num_computed`` tokens
        are in the cache); incremental: each block is hashed once per table."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        hashes = table.block_hashes
        while len(hashes) < min(num_computed, len(token_ids)) // bs:
            i = len(hashes)
            tokens = tuple(token_ids[i * bs:(i + 1) * bs])
            h = self.hash_block(hashes[-1] if hashes else None, tokens, extra_key)
            hashes.append(h)
            block = self.blocks[table.block_ids[i]]
            if block.block_hash is None and h not in self._cached:
                block.block_hash = h
                block.token_ids = tokens
                self._cached[h] = block.block_id

    # ---------------------------------------------------------------- internals
    def _take_free_block(self, table: BlockTable) -> KVCacheBlock:
        bid, _ = self._free.popitem(last=False)
        block = self.blocks[bid]
        if block.block_hash is not None:  # evict: the old prefix is overwritten
            if self._cached.get(block.block_hash) == bid:
                del self._cached[block.block_hash]
            block.block_hash = None
            block.token_ids = None
        block.ref_count = 1
        block.owners = {table.table_id}
        self.peak_used_blocks = max(self.peak_used_blocks, self.num_blocks - len(self._free))
        return block

    def _drop_ref(self, block: KVCacheBlock, table: BlockTable) -> None:
        block.owners.discard(table.table_id)
        block.ref_count -= 1
        if block.ref_count == 0:
            self._free[block.block_id] = None

    @staticmethod
    def _check_live(table: BlockTable) -> None:
        if table.freed:
            raise BlockAllocatorError(f"block table {table.table_id} was already freed")

    def check_invariants(self, tables=()) -> None:
        """Assert the pool's invariants; with ``tables`` (all live tables) also ownership/lengths.

        free + referenced == total; no block both free and referenced; ref_count >= 0 and equal to
        its number of owners; each table holds ceil(num_tokens / block_size) blocks.
        """
        referenced = [b for b in self.blocks if b.ref_count > 0]
        assert len(self._free) + len(referenced) == self.num_blocks, "free + referenced != total"
        for b in self.blocks:
            assert b.ref_count >= 0, f"block {b.block_id} ref_count {b.ref_count} < 0"
            assert b.ref_count == len(b.owners), f"block {b.block_id} ref_count != owners"
            assert (b.ref_count == 0) == (b.block_id in self._free), f"block {b.block_id} free/referenced"
        for h, bid in self._cached.items():
            assert self.blocks[bid].block_hash == h, f"cache entry {h} -> block {bid} is stale"
        if tables:
            counts: dict[int, int] = {}
            for t in tables:
                assert not t.freed
                assert len(t.block_ids) == -(-t.num_tokens // self.block_size), "table length"
                assert len(set(t.block_ids)) == len(t.block_ids), "a table holds a block twice"
                for bid in t.block_ids:
                    assert t.table_id in self.blocks[bid].owners
                    counts[bid] = counts.get(bid, 0) + 1
            for b in self.blocks:
                assert counts.get(b.block_id, 0) == b.ref_count, f"block {b.block_id} ref_count mismatch"
