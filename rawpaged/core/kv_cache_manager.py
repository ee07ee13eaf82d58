"""The scheduler's only door to KV blocks: prefix-cache lookups, slot allocation, forks, frees.

Each ``Sequence`` holds its ``BlockTable`` in ``seq.block_table`` (None while it holds no blocks); only
this class changes it. Running out of blocks is not an error: ``allocate_slots`` returns False and
changes nothing, so the scheduler can preempt or wait. API after vLLM v1's ``KVCacheManager``, with
vLLM v0's ``fork`` for copy-on-write sharing (parallel sampling, beam search).

With a sliding window W (every layer's, as Mistral's), the blocks a sequence's future tokens can no longer
read are given back as it goes (vLLM v1's ``SlidingWindowManager``): the token at position p reads p - W +
1 .. p, so once ``num_computed_tokens`` is n, a block wholly before n - W + 1 is released and its entry in
the table becomes ``NULL_BLOCK``; a sequence holds at most ``ceil(W / block_size) + 1`` blocks.

A second KV tier (``kv_tier.KVTier``) sits beside it and uses its public methods: blocks found outside the
pool (``external_blocks`` of ``allocate_slots``), tables rebuilt over fresh shared blocks
(``allocate_shared_tables``), slots trimmed to the computed tokens (``trim_to_computed``), and what
``cache_full_blocks`` just cached.
"""

from __future__ import annotations

from itertools import count

from rawpaged.core.block_pool import BlockPool, BlockPoolError
from rawpaged.core.block_table import NULL_BLOCK, BlockTable
from rawpaged.core.kv_events import COPY, FORK, ROLLBACK, KVCacheEventLog
from rawpaged.core.prefix_cache import find_longest_cache_hit, hash_block_tokens, root_hash


class KVCacheManager:
    """Blocks of ``block_size`` tokens out of one ``BlockPool`` of ``num_blocks``.

    ``cache_keys``: what else names the cache's contents, for the prefix-cache hashes' root (the engine
    gives the KV-cache dtype: blocks of another dtype never match). ``sliding_window``: W when every layer
    attends to its last W positions only (blocks before the window are given back), else None.

    Raises:
        ValueError: ``num_blocks < 1``, ``block_size < 1`` or ``sliding_window < 1``.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int = 16,
        enable_prefix_caching: bool = False,
        cache_keys: tuple = (),
        sliding_window: int | None = None,
    ):
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1 or None, got {sliding_window}")
        self.sliding_window = sliding_window
        self.num_window_frees = 0  # blocks given back because the window passed them
        self.block_pool = BlockPool(num_blocks)
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.root_hash = root_hash(block_size, *cache_keys)
        self.num_prefix_queries = 0  # blocks looked up in the prefix cache
        self.num_prefix_hits = 0  # blocks found
        self.events = KVCacheEventLog()  # copies and forks here, preemptions by the scheduler
        self._table_ids = count()

    @property
    def num_blocks(self) -> int:
        return self.block_pool.num_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by some sequence, in [0, 1]."""
        return self.block_pool.usage()

    def reset_stats(self) -> None:
        """Zero the counters (prefix queries and hits, copy-on-write copies); peak usage restarts now."""
        self.num_prefix_queries = self.num_prefix_hits = 0
        self.block_pool.num_cow_copies = 0
        self.block_pool.peak_used_blocks = self.block_pool.num_used_blocks

    # ------------------------------------------------------------------ prefix cache
    def get_computed_blocks(self, seq, count: bool = True) -> list:
        """Block ids of the longest cached prefix of ``seq``'s tokens (full blocks). The last token is
        never taken from the cache, so the step that computes it has a logit to sample from. A sequence
        that asks for ``prompt_logprobs`` takes nothing (the cached tokens' logprobs would be missing; as
        vLLM, it computes its whole prompt and still fills the cache). ``count``: add the lookup to the
        prefix-cache counters now (the scheduler counts it with ``count_prefix_lookup`` once it admits
        ``seq``, so a request waiting for blocks is not counted at every attempt)."""
        if not self.enable_prefix_caching or seq.sampling_params.prompt_logprobs is not None:
            return []
        token_ids = seq.token_ids
        found, _ = find_longest_cache_hit(
            self.block_pool, token_ids, self.block_size, self._max_cached_blocks(seq), self.root_hash
        )
        if count:
            self.count_prefix_lookup(seq, len(found))
        return found

    def count_prefix_lookup(self, seq, num_hits: int) -> None:
        """Count one prefix-cache lookup of ``seq`` that found ``num_hits`` blocks: the blocks looked up
        (hits, plus the miss that ended them) and the hits. Nothing where ``get_computed_blocks`` looks
        nothing up."""
        if not self.enable_prefix_caching or seq.sampling_params.prompt_logprobs is not None:
            return
        max_blocks = min(self._max_cached_blocks(seq), len(seq.token_ids) // self.block_size)
        self.num_prefix_queries += min(num_hits + 1, max_blocks)
        self.num_prefix_hits += num_hits

    def _max_cached_blocks(self, seq) -> int:
        return (len(seq.token_ids) - 1) // self.block_size

    def cache_full_blocks(self, seq) -> list:
        """Hash the blocks of ``seq`` that ``seq.num_computed_tokens`` has filled since the last call and
        make them findable (each block is hashed once per sequence). Returns the blocks just cached, as
        ``(block_id, block_hash, token_ids)`` in table order (a write-through tier stores them)."""
        table = seq.block_table
        bs = self.block_size
        if not self.enable_prefix_caching or seq.num_computed_tokens // bs <= len(table.block_hashes):
            return []
        token_ids = seq.token_ids
        hashes = table.block_hashes
        cached = []
        while len(hashes) < min(seq.num_computed_tokens, len(token_ids)) // bs:
            i = len(hashes)
            tokens = tuple(token_ids[i * bs : (i + 1) * bs])
            h = hash_block_tokens(hashes[-1] if hashes else self.root_hash, tokens)
            hashes.append(h)
            if table.block_ids[i] != NULL_BLOCK:
                self.block_pool.cache_block(table.block_ids[i], h, tokens)
                cached.append((table.block_ids[i], h, tokens))
        return cached

    def allocate_shared_tables(self, seqs, layouts) -> dict:
        """Give each of ``seqs`` (holding no blocks) a fresh table after its ``layouts`` entry ``(keys,
        num_tokens, block_hashes)``: a key per logical block (``NULL_BLOCK`` for an entry a sliding window
        had released), entries of equal keys sharing one fresh block across ``seqs``; the full blocks are
        cached under ``block_hashes`` again. The caller fills the blocks (a swap-in loads them) and has
        checked that the pool has one free block per distinct key. Returns ``{key: block_id}`` of the
        fresh blocks, in the order taken."""
        pool, bs = self.block_pool, self.block_size
        block_of: dict = {}
        for seq, (keys, num_tokens, block_hashes) in zip(seqs, layouts):
            table = seq.block_table = self._new_table([], num_tokens, list(block_hashes))
            for i, key in enumerate(keys):
                if key == NULL_BLOCK:
                    table.block_ids.append(NULL_BLOCK)
                    continue
                if key in block_of:
                    pool.share(block_of[key], table.table_id)
                else:
                    block_of[key] = pool.take(table.table_id).block_id
                    if i < len(block_hashes):  # a full block: findable in the prefix cache again
                        tokens = tuple(seq.token_ids[i * bs : (i + 1) * bs])
                        pool.cache_block(block_of[key], block_hashes[i], tokens)
                table.block_ids.append(block_of[key])
        return block_of

    # ------------------------------------------------------------------ allocation
    def num_blocks_to_allocate(self, seq, num_new_tokens: int, computed_blocks=(), external_blocks=()) -> int:
        """Free blocks ``allocate_slots(seq, num_new_tokens, computed_blocks, external_blocks)`` would take: new
        blocks (those for external blocks included), a copy of a shared, partly filled last block, and
        computed (cached) blocks that are free now."""
        bs = self.block_size
        table = seq.block_table
        if table is None:
            num_hits = len(computed_blocks) + len(external_blocks)
            num_tokens = num_hits * bs + num_new_tokens
            pool = self.block_pool.blocks
            skip = self._num_skipped_blocks(num_hits * bs)
            kept = computed_blocks[skip:]
            skipped_loads = max(0, skip - len(computed_blocks))
            new = -(-num_tokens // bs) - len(computed_blocks) - skipped_loads
            return new + sum(1 for b in kept if pool[b].ref_count == 0)
        need = -(-(table.num_tokens + num_new_tokens) // bs) - len(table.block_ids)
        if num_new_tokens > 0 and table.num_tokens % bs and self.block_pool.blocks[table.block_ids[-1]].ref_count > 1:
            need += 1
        return need

    def allocate_slots(self, seq, num_new_tokens: int, computed_blocks=(), external_blocks=()) -> bool:
        """Reserve KV slots for ``num_new_tokens`` more tokens of ``seq``.

        A sequence without blocks first gets a new table starting with ``computed_blocks`` (from
        ``get_computed_blocks``; ``ref_count`` + 1 each, but with a sliding window those wholly before the
        first new token's window are not taken: ``NULL_BLOCK`` entries), then ``external_blocks``
        (``(block_hash, token_ids)`` of the next full blocks, found outside the pool: fresh blocks, cached under
        their hashes, which the finder fills before the step's kernels; ``kv_tier.KVTier.allocate_slots``).
        New blocks are taken as the table crosses block
        boundaries; a shared, partly filled last block is copied first (copy-on-write, see
        ``take_block_copies``). Returns False, changing nothing, when the pool has too few free blocks
        (blocks a sliding window has passed are given back first, in any case: ``remove_skipped_blocks``).

        Raises:
            ValueError: ``num_new_tokens < 0``, or ``computed_blocks`` for a sequence that has blocks.
            BlockPoolError: the sequence's table was freed.
        """
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        if seq.block_table is not None:
            if computed_blocks or external_blocks:
                raise ValueError("computed_blocks apply only to a sequence without blocks")
            _check_live(seq.block_table)
            self.remove_skipped_blocks(seq)
        if (
            self.num_blocks_to_allocate(seq, num_new_tokens, computed_blocks, external_blocks)
            > self.block_pool.num_free_blocks
        ):
            return False
        pool, bs = self.block_pool, self.block_size
        table = seq.block_table
        if table is None:
            num_hits = len(computed_blocks) + len(external_blocks)
            table = seq.block_table = self._new_table([], num_hits * bs, [])
            skip = self._num_skipped_blocks(num_hits * bs)  # hits before the window: not taken
            for i, bid in enumerate(computed_blocks):
                table.block_hashes.append(pool.blocks[bid].block_hash)
                if i < skip:
                    table.block_ids.append(NULL_BLOCK)
                    continue
                pool.share(bid, table.table_id)
                table.block_ids.append(bid)
            for block_hash, tokens in external_blocks:
                table.block_hashes.append(block_hash)
                if len(table.block_ids) < skip:
                    table.block_ids.append(NULL_BLOCK)
                    continue
                bid = pool.take(table.table_id).block_id
                pool.cache_block(bid, block_hash, tokens)
                table.block_ids.append(bid)
        if num_new_tokens == 0:
            return True
        if table.num_tokens % bs and pool.blocks[table.block_ids[-1]].ref_count > 1:
            src = table.block_ids[-1]
            table.block_ids[-1] = pool.copy_on_write(src, table.table_id)
            self.events.record(COPY, seq, src=src, dst=table.block_ids[-1])
        table.num_tokens += num_new_tokens
        while len(table.block_ids) * bs < table.num_tokens:
            table.block_ids.append(pool.take(table.table_id).block_id)
        return True

    def remove_skipped_blocks(self, seq) -> int:
        """With a sliding window W: release the blocks of ``seq`` wholly before position
        ``seq.num_computed_tokens - W + 1`` (no future token of the sequence reads them); their table
        entries become ``NULL_BLOCK``. A block still cached stays findable by a prefix lookup until the pool
        reuses it, as any freed block. Returns the number of blocks released (0 without a window)."""
        table = seq.block_table
        if self.sliding_window is None or table is None:
            return 0
        released = 0
        for i in range(min(self._num_skipped_blocks(seq.num_computed_tokens), len(table.block_ids))):
            bid = table.block_ids[i]
            if bid != NULL_BLOCK:
                self.block_pool.release(bid, table.table_id)
                table.block_ids[i] = NULL_BLOCK
                released += 1
        self.num_window_frees += released
        return released

    def _num_skipped_blocks(self, num_computed_tokens: int) -> int:
        """Leading blocks no token from position ``num_computed_tokens`` on reads (0 without a window)."""
        if self.sliding_window is None:
            return 0
        return max(0, num_computed_tokens - self.sliding_window + 1) // self.block_size

    def free_rejected_slots(self, seq) -> int:
        """Speculative decoding: shrink ``seq``'s slots to its ``num_computed_tokens`` (the KV of its
        verified tokens) after a step that also wrote slots for drafts the target rejected. Blocks that
        held only rejected drafts are released at once, to the head of the free queue (they hold nothing
        worth caching); the rejected slots of a kept block are overwritten by the next tokens. Nothing of
        a rejected draft is hashed: ``cache_full_blocks`` reads only computed tokens. Returns the number
        of blocks released.

        Raises:
            BlockPoolError: the table was freed.
        """
        released = self.trim_to_computed(seq)
        if released:
            self.events.record(ROLLBACK, seq, block_ids=released)
        return len(released)

    def trim_to_computed(self, seq) -> list:
        """Give back ``seq``'s slots past ``num_computed_tokens`` (and the blocks only they used, to the head of
        the free queue); the ids released. Raises BlockPoolError for a freed table."""
        table = seq.block_table
        if table is None or table.num_tokens <= seq.num_computed_tokens:
            return []
        _check_live(table)
        table.num_tokens = seq.num_computed_tokens
        keep = -(-table.num_tokens // self.block_size)
        released = table.block_ids[keep:]
        del table.block_ids[keep:]
        for bid in reversed(released):
            if bid != NULL_BLOCK:
                self.block_pool.release(bid, table.table_id, reuse_first=True)
        return released

    def fork(self, parent, child) -> None:
        """``child`` gets a table with the same contents as ``parent``'s, sharing every block
        (``ref_count`` + 1, no copy; the first write into a shared partly filled block copies it)."""
        src = parent.block_table
        if src is None:
            raise BlockPoolError(f"sequence {parent.seq_id} holds no blocks to fork")
        _check_live(src)
        table = child.block_table = self._new_table(list(src.block_ids), src.num_tokens, list(src.block_hashes))
        held = [bid for bid in table.block_ids if bid != NULL_BLOCK]
        for bid in held:
            self.block_pool.share(bid, table.table_id)
        self.events.record(FORK, child, parent_index=parent.index, num_blocks=len(held))

    def free(self, seq) -> None:
        """Return ``seq``'s blocks (each ``ref_count`` - 1; blocks at 0 become free, tail blocks first so
        a prefix outlives its suffix in the cache). ``seq.block_table`` becomes None; a sequence without
        blocks is left alone.

        Raises:
            BlockPoolError: the table was already freed, or holds a block it does not own.
        """
        table = seq.block_table
        if table is None:
            return
        _check_live(table)
        held = [bid for bid in table.block_ids if bid != NULL_BLOCK]
        for bid in held:
            if table.table_id not in self.block_pool.blocks[bid].owners:
                raise BlockPoolError(f"table {table.table_id} does not own block {bid}")
        for bid in reversed(held):
            self.block_pool.release(bid, table.table_id)
        table.block_ids = []
        table.block_hashes = []
        table.num_tokens = 0
        table.freed = True
        seq.block_table = None

    def _new_table(self, block_ids: list, num_tokens: int, block_hashes: list) -> BlockTable:
        return BlockTable(next(self._table_ids), self.block_size, block_ids, num_tokens, block_hashes)

    def take_block_copies(self) -> list:
        """The copy-on-write ``(src, dst)`` block copies recorded since the last call."""
        return self.block_pool.take_copies()

    # ------------------------------------------------------------------ checks
    def check_invariants(self, seqs=()) -> None:
        """The pool's invariants; with ``seqs`` (every sequence holding blocks) also that each table
        has ``ceil(num_tokens / block_size)`` entries, distinct blocks apart from leading ``NULL_BLOCK``s
        (those a sliding window released, never more than it allows), and each block's ``ref_count``
        equals the number of tables holding it."""
        pool = self.block_pool
        pool.check_invariants()
        tables = [s.block_table for s in seqs if s.block_table is not None]
        if not tables:
            return
        counts: dict[int, int] = {}
        for t in tables:
            assert not t.freed, f"table {t.table_id} was freed"
            assert len(t.block_ids) == -(-t.num_tokens // self.block_size), "table length"
            held = [bid for bid in t.block_ids if bid != NULL_BLOCK]
            assert t.block_ids[: len(t.block_ids) - len(held)] == [NULL_BLOCK] * (len(t.block_ids) - len(held)), (
                "a released block after a held one"
            )
            if held != t.block_ids:
                assert self.sliding_window is not None, "NULL_BLOCK entries without a sliding window"
            assert len(set(held)) == len(held), "a table holds a block twice"
            for bid in held:
                assert t.table_id in pool.blocks[bid].owners, f"table {t.table_id} does not own block {bid}"
                counts[bid] = counts.get(bid, 0) + 1
        for b in pool.blocks:
            assert counts.get(b.block_id, 0) == b.ref_count, f"block {b.block_id} ref_count mismatch"


def _check_live(table: BlockTable) -> None:
    if table.freed:
        raise BlockPoolError(f"block table {table.table_id} was already freed")
