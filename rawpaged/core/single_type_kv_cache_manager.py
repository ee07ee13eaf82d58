"""One KV cache group's blocks: the block table of each sequence in that group, kept by the rules of its
kind of attention (after vLLM v1's ``single_type_kv_cache_manager``).

* ``FullAttentionManager``: a sequence keeps every block; a prefix hit is the longest run of cached blocks
  from the start.
* ``SlidingWindowManager`` (window W): the token at position p reads p - W + 1 .. p, so once
  ``num_computed_tokens`` is n, a block wholly before n - W + 1 is given back and its entry becomes
  ``NULL_BLOCK`` (``remove_skipped_blocks``); a sequence holds at most ``ceil(W / block_size) + 1``
  blocks. A prefix hit of k blocks needs only the blocks covering the last W - 1 tokens before position
  ``k * block_size`` (the first token computed reads them and nothing earlier).

Both draw blocks from the one shared ``BlockPool``; the ``KVCacheManager`` coordinates them. A group's
prefix-cache key of a block is its chained hash mixed with the group index (``group_block_hash``), so
the groups' blocks of one prefix are found apart.
"""

from __future__ import annotations

from rawpaged.core.block_pool import BlockPool
from rawpaged.core.block_table import NULL_BLOCK, BlockTable
from rawpaged.core.kv_cache_groups import KVCacheGroupSpec
from rawpaged.core.prefix_cache import group_block_hash


class SingleTypeKVCacheManager:
    """The blocks of group ``group_id`` (``spec``) out of ``pool``, ``block_size`` tokens each."""

    def __init__(self, spec: KVCacheGroupSpec, group_id: int, pool: BlockPool, block_size: int):
        self.spec = spec
        self.group_id = group_id
        self.block_pool = pool
        self.block_size = block_size
        self.num_window_frees = 0  # blocks given back because the window passed them

    @property
    def sliding_window(self) -> int | None:
        return self.spec.sliding_window

    def key(self, block_hash: int) -> int:
        """This group's prefix-cache key of the block whose chained hash is ``block_hash``."""
        return group_block_hash(block_hash, self.group_id)

    def num_skipped_blocks(self, num_computed_tokens: int) -> int:
        """Leading blocks no token from position ``num_computed_tokens`` on reads (0 for full attention)."""
        return 0

    # ------------------------------------------------------------------ prefix hits
    def cache_hits(self, blocks: list, max_blocks: int) -> list:
        """Per full block of ``blocks`` = ``[(chained hash, token_ids)]``, up to ``max_blocks``: its cached
        block id in this group, or None; a full-attention group stops at its first miss."""
        hits = []
        for block_hash, tokens in blocks[:max_blocks]:
            hits.append(self.block_pool.get_cached_block(self.key(block_hash), tokens))
            if hits[-1] is None:
                break
        return hits

    def longest_hit(self, hits: list, max_blocks: int) -> list:
        """The longest prefix of at most ``max_blocks`` blocks this group can serve from ``hits``
        (``cache_hits``): its block ids, ``NULL_BLOCK`` where a block is not needed."""
        found = []
        for bid in hits[:max_blocks]:
            if bid is None:
                break
            found.append(bid)
        return found

    # ------------------------------------------------------------------ allocation
    def num_blocks_to_allocate(self, table, num_new_tokens: int, computed=(), num_external: int = 0) -> int:
        """Free blocks ``allocate`` would take (see ``KVCacheManager.num_blocks_to_allocate``)."""
        bs = self.block_size
        if table is None:
            num_hits = len(computed) + num_external
            skip = self.num_skipped_blocks(num_hits * bs)
            free = self.block_pool.blocks
            kept = sum(1 for b in computed[skip:] if b != NULL_BLOCK and free[b].ref_count == 0)
            skipped_loads = max(0, skip - len(computed))
            return -(-(num_hits * bs + num_new_tokens) // bs) - len(computed) - skipped_loads + kept
        need = -(-(table.num_tokens + num_new_tokens) // bs) - len(table.block_ids)
        if num_new_tokens > 0 and table.num_tokens % bs and self.block_pool.blocks[table.block_ids[-1]].ref_count > 1:
            need += 1
        return need

    def start_table(self, table: BlockTable, computed, external) -> None:
        """Fill a new ``table`` (of ``len(computed) + len(external)`` full blocks' tokens) with the hit
        ``computed`` (shared) and a fresh block per ``external`` ``(block_hash, token_ids)``, cached under its
        hash; those wholly before the first new token's window become ``NULL_BLOCK``."""
        pool = self.block_pool
        skip = self.num_skipped_blocks(table.num_tokens)
        for i, bid in enumerate(computed):
            if i < skip or bid == NULL_BLOCK:
                table.block_ids.append(NULL_BLOCK)
                continue
            pool.share(bid, table.table_id)
            table.block_ids.append(bid)
        for block_hash, tokens in external:
            if len(table.block_ids) < skip:
                table.block_ids.append(NULL_BLOCK)
                continue
            bid = pool.take(table.table_id).block_id
            pool.cache_block(bid, self.key(block_hash), tokens)
            table.block_ids.append(bid)

    def grow(self, table: BlockTable, num_new_tokens: int) -> tuple | None:
        """Reserve ``num_new_tokens`` more slots in ``table`` (checked free): a shared partly filled last
        block is copied first. Returns the copy ``(src, dst)``, or None."""
        pool, bs = self.block_pool, self.block_size
        copied = None
        if table.num_tokens % bs and pool.blocks[table.block_ids[-1]].ref_count > 1:
            src = table.block_ids[-1]
            table.block_ids[-1] = pool.copy_on_write(src, table.table_id)
            copied = (src, table.block_ids[-1])
        table.num_tokens += num_new_tokens
        while len(table.block_ids) * bs < table.num_tokens:
            table.block_ids.append(pool.take(table.table_id).block_id)
        return copied

    def remove_skipped_blocks(self, table: BlockTable, num_computed_tokens: int) -> int:
        """Give back the blocks of ``table`` no token from ``num_computed_tokens`` on reads; their entries
        become ``NULL_BLOCK``. A block still cached stays findable until the pool reuses it. Returns the
        number released."""
        released = 0
        for i in range(min(self.num_skipped_blocks(num_computed_tokens), len(table.block_ids))):
            bid = table.block_ids[i]
            if bid != NULL_BLOCK:
                self.block_pool.release(bid, table.table_id)
                table.block_ids[i] = NULL_BLOCK
                released += 1
        self.num_window_frees += released
        return released

    def trim(self, table: BlockTable, num_tokens: int) -> list:
        """Shrink ``table`` to ``num_tokens`` slots; the blocks only the dropped slots used go to the head
        of the free queue. Returns the entries dropped."""
        table.num_tokens = num_tokens
        keep = -(-num_tokens // self.block_size)
        released = table.block_ids[keep:]
        del table.block_ids[keep:]
        for bid in reversed(released):
            if bid != NULL_BLOCK:
                self.block_pool.release(bid, table.table_id, reuse_first=True)
        return released

    def check_table(self, table: BlockTable) -> list:
        """Assert ``table``'s shape (``ceil(num_tokens / block_size)`` entries; ``NULL_BLOCK``s only leading,
        and only in a sliding group, never more than it released; distinct blocks). Returns its held ids."""
        assert not table.freed, f"table {table.table_id} was freed"
        assert len(table.block_ids) == -(-table.num_tokens // self.block_size), "table length"
        held = [bid for bid in table.block_ids if bid != NULL_BLOCK]
        lead = len(table.block_ids) - len(held)
        assert table.block_ids[:lead] == [NULL_BLOCK] * lead, "a released block after a held one"
        if lead:
            assert self.sliding_window is not None, "NULL_BLOCK entries without a sliding window"
        assert len(set(held)) == len(held), "a table holds a block twice"
        return held


class FullAttentionManager(SingleTypeKVCacheManager):
    """A full-attention group: every block kept; hits from the start."""


class SlidingWindowManager(SingleTypeKVCacheManager):
    """A sliding-window group (see the module doc)."""

    def num_skipped_blocks(self, num_computed_tokens: int) -> int:
        return max(0, num_computed_tokens - self.sliding_window + 1) // self.block_size

    def cache_hits(self, blocks: list, max_blocks: int) -> list:
        pool = self.block_pool
        return [pool.get_cached_block(self.key(h), tokens) for h, tokens in blocks[:max_blocks]]

    def longest_hit(self, hits: list, max_blocks: int) -> list:
        run = [0]  # run[k]: cached blocks in a row ending at block k - 1
        for bid in hits[:max_blocks]:
            run.append(run[-1] + 1 if bid is not None else 0)
        for k in range(len(run) - 1, 0, -1):
            skip = self.num_skipped_blocks(k * self.block_size)
            if run[k] >= k - skip:
                return [NULL_BLOCK] * skip + hits[skip:k]
        return []


def single_type_manager(spec: KVCacheGroupSpec, group_id: int, pool: BlockPool, block_size: int):
    """The manager of ``spec``'s kind."""
    cls = FullAttentionManager if spec.sliding_window is None else SlidingWindowManager
    return cls(spec, group_id, pool, block_size)
