"""The scheduler's only door to KV blocks: prefix-cache lookups, slot allocation, forks, frees.

The pool's blocks are paged in KV cache groups (``kv_cache_groups``: layers of one kind of attention, the
same number per group), each kept by a manager of its kind (``single_type_kv_cache_manager``: full
attention, or a sliding window that gives back the blocks it has passed), all drawing from one
``BlockPool``; this class coordinates them (vLLM v1's ``KVCacheCoordinator``; one group is its unitary case).
Each ``Sequence`` holds one ``BlockTable`` per group in ``seq.block_tables`` (None while it holds no
blocks; ``seq.block_table`` is group 0's); only this class changes them. Every operation applies to every
group: a fork shares each group's blocks, a write into a shared partly filled block copies it in its group,
a free returns them all. Running out of blocks is not an error: ``allocate_slots`` returns False and changes
nothing, so the scheduler can preempt or wait. API after vLLM v1's ``KVCacheManager``, with vLLM v0's
``fork`` for copy-on-write sharing (parallel sampling, beam search).

A prefix hit counts only when every group can serve it (``get_computed_blocks``): a full-attention group
needs every block of the prefix, a sliding group (window W) only those covering the last W - 1 tokens
before the hit point.

A second KV tier (``kv_tier.KVTier``) sits beside it and uses its public methods: blocks found outside the
pool (``external_blocks`` of ``allocate_slots``), tables rebuilt over fresh shared blocks
(``allocate_shared_tables``), slots trimmed to the computed tokens (``trim_to_computed``), and what
``cache_full_blocks`` just cached.
"""

from __future__ import annotations

from itertools import count

from rawpaged.core.adapter_pages import AdapterPages
from rawpaged.core.block_pool import BlockPool, BlockPoolError
from rawpaged.core.block_table import NULL_BLOCK, BlockTable
from rawpaged.core.kv_cache_groups import KVCacheGroupSpec
from rawpaged.core.kv_events import COPY, FORK, ROLLBACK, KVCacheEventLog
from rawpaged.core.prefix_cache import extra_keys_root_hash, hash_block_tokens, root_hash
from rawpaged.core.single_type_kv_cache_manager import single_type_manager


class ComputedBlocks(list):
    """A prefix hit (``KVCacheManager.get_computed_blocks``): as a list, group 0's block ids of the hit's
    blocks (its length is the number of blocks hit); ``groups`` holds each group's, ``NULL_BLOCK`` where a
    sliding group needs no block."""

    def __init__(self, groups: list, hashes: list):
        super().__init__(groups[0])
        self.groups = groups
        self.hashes = hashes  # the chained hash of each hit block


class KVCacheManager:
    """Blocks of ``block_size`` tokens out of one ``BlockPool`` of ``num_blocks``, paged in ``groups``.

    ``cache_keys``: what else names the cache's contents, for the prefix-cache hashes' root (the engine
    gives the KV-cache dtype: blocks of another dtype never match; with several groups their layout joins
    it). ``groups``: the ``KVCacheGroupSpec``s (``kv_cache_groups.group_layers``); None is one group with
    ``sliding_window`` (W when every layer attends to its last W positions only, else None).

    Raises:
        ValueError: ``num_blocks < 1``, ``block_size < 1``, ``sliding_window < 1`` or no groups.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int = 16,
        enable_prefix_caching: bool = False,
        cache_keys: tuple = (),
        sliding_window: int | None = None,
        groups: tuple | None = None,
    ):
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1 or None, got {sliding_window}")
        groups = tuple(groups) if groups is not None else (KVCacheGroupSpec((0,), sliding_window),)
        if not groups:
            raise ValueError("a KV cache needs at least one group")
        self.groups = groups
        self.block_pool = BlockPool(num_blocks)
        #: LoRA adapters' pages in the same pool (``adapter_pages``): idle ones are evicted for KV first
        self.adapter_pages = AdapterPages(self.block_pool)
        self.managers = [single_type_manager(g, i, self.block_pool, block_size) for i, g in enumerate(groups)]
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        layout = () if len(groups) == 1 else (tuple((g.layer_ids, g.sliding_window) for g in groups),)
        self.root_hash = root_hash(block_size, *cache_keys, *layout)
        self.num_prefix_queries = 0  # blocks looked up in the prefix cache
        self.num_prefix_hits = 0  # blocks found
        self.events = KVCacheEventLog()  # copies and forks here, preemptions by the scheduler
        self._table_ids = count()

    @property
    def num_blocks(self) -> int:
        return self.block_pool.num_blocks

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    @property
    def sliding_window(self) -> int | None:
        """The window of the one group when there is one group and it slides, else None."""
        return self.groups[0].sliding_window if len(self.groups) == 1 else None

    @property
    def num_window_frees(self) -> int:
        """Blocks given back, in every group, because a sliding window had passed them."""
        return sum(m.num_window_frees for m in self.managers)

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by some sequence, in [0, 1]."""
        return self.block_pool.usage()

    def reset_stats(self) -> None:
        """Zero the counters (prefix queries and hits, copy-on-write copies); peak usage restarts now."""
        self.num_prefix_queries = self.num_prefix_hits = 0
        self.block_pool.num_cow_copies = 0
        self.block_pool.peak_used_blocks = self.block_pool.num_used_blocks

    def group_blocks(self, seq) -> list:
        """Per group, the blocks ``seq`` holds (``NULL_BLOCK`` entries left out); ``[]`` each without blocks."""
        if seq.block_tables is None:
            return [[] for _ in self.groups]
        return [[b for b in t.block_ids if b != NULL_BLOCK] for t in seq.block_tables]

    # ------------------------------------------------------------------ prefix cache
    def get_computed_blocks(self, seq, count: bool = True) -> ComputedBlocks:
        """The longest cached prefix of ``seq``'s tokens (full blocks) that every group can serve
        (``ComputedBlocks``). The last token is never taken from the cache, so the step that computes it
        has a logit to sample from. A sequence that asks for ``prompt_logprobs`` takes nothing (the cached
        tokens' logprobs would be missing; as vLLM, it computes its whole prompt and still fills the cache),
        nor does a pooling sequence whose vector needs every position (MEAN, CLS:
        ``PoolingParams.requires_all_positions``).
        ``count``: add the lookup to the prefix-cache counters now (the scheduler counts it with
        ``count_prefix_lookup`` once it admits ``seq``, so a request waiting for blocks is not counted at
        every attempt)."""
        if not self.takes_cached_blocks(seq):
            return ComputedBlocks([[] for _ in self.groups], [])
        max_blocks = self._max_cached_blocks(seq)
        blocks = self.hashed_blocks(seq.token_ids, 0, max_blocks, self.seq_root_hash(seq))
        hits = [m.cache_hits(blocks, max_blocks) for m in self.managers]
        length = max_blocks
        while True:  # a sliding group's hit at a shorter length may need other blocks: until all agree
            found = [m.longest_hit(h, length) for m, h in zip(self.managers, hits)]
            shortest = min(map(len, found))
            if all(len(f) == shortest for f in found):
                break
            length = shortest
        if count:
            self.count_prefix_lookup(seq, shortest)
        return ComputedBlocks(found, [h for h, _ in blocks[:shortest]])

    def takes_cached_blocks(self, seq) -> bool:
        """Whether ``seq`` may start from cached blocks: prefix caching is on, it asks for no
        ``prompt_logprobs`` and it does not pool every position (see ``get_computed_blocks``)."""
        pooling = seq.pooling_params
        return (
            self.enable_prefix_caching
            and seq.sampling_params.prompt_logprobs is None
            and not (pooling is not None and pooling.requires_all_positions)
        )

    def seq_root_hash(self, seq) -> int:
        """The root of ``seq``'s hash chain: the cache's ``root_hash``, mixed with its LoRA adapter's
        digest (``seq.lora_key``) when it has one, so that two adapters never share a block."""
        if seq.lora_key is None:
            return self.root_hash
        return extra_keys_root_hash(self.root_hash, "lora", seq.lora_key)

    def hashed_blocks(self, token_ids: list, start: int, stop: int, parent: int | None = None) -> list:
        """``[(chained hash, token_ids)]`` of the full blocks ``start .. stop - 1`` of ``token_ids`` (fewer
        where the tokens end), the chain continuing from ``parent`` (block ``start - 1``'s hash; None: the
        root, with ``start`` 0)."""
        bs, out = self.block_size, []
        parent = self.root_hash if parent is None else parent
        for i in range(start, min(stop, len(token_ids) // bs)):
            tokens = tuple(token_ids[i * bs : (i + 1) * bs])
            parent = hash_block_tokens(parent, tokens)
            out.append((parent, tokens))
        return out

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
        make them findable in each group that still holds them (each block is hashed once per sequence).
        Returns the blocks just cached, as ``(block_id, key, token_ids)`` (``key``: the group's prefix-cache
        key), group by group in table order (a write-through tier stores them)."""
        tables = seq.block_tables
        bs = self.block_size
        if not self.enable_prefix_caching or seq.num_computed_tokens // bs <= len(tables[0].block_hashes):
            return []
        hashes = tables[0].block_hashes
        done = len(hashes)
        stop = min(seq.num_computed_tokens, seq.num_tokens) // bs
        new = self.hashed_blocks(seq.token_ids, done, stop, hashes[-1] if hashes else self.seq_root_hash(seq))
        cached = []
        for m, table in zip(self.managers, tables):
            for i, (h, tokens) in enumerate(new, start=done):
                table.block_hashes.append(h)
                if table.block_ids[i] != NULL_BLOCK:
                    self.block_pool.cache_block(table.block_ids[i], m.key(h), tokens)
                    cached.append((table.block_ids[i], m.key(h), tokens))
        return cached

    def allocate_shared_tables(self, seqs, layouts) -> dict:
        """Give each of ``seqs`` (holding no blocks) fresh tables after its ``layouts`` entry ``(group_keys,
        num_tokens, block_hashes)``: per group, a key per logical block (``NULL_BLOCK`` for an entry a
        sliding window had released), entries of equal keys sharing one fresh block across ``seqs``; the
        full blocks are cached under ``block_hashes`` again. The caller fills the blocks (a swap-in loads
        them) and has checked that the pool has one free block per distinct key. Returns ``{key:
        block_id}`` of the fresh blocks, in the order taken."""
        pool, bs = self.block_pool, self.block_size
        block_of: dict = {}
        for seq, (group_keys, num_tokens, block_hashes) in zip(seqs, layouts):
            seq.block_tables = [self._new_table([], num_tokens, list(block_hashes)) for _ in self.groups]
            for m, table, keys in zip(self.managers, seq.block_tables, group_keys):
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
                            pool.cache_block(block_of[key], m.key(block_hashes[i]), tokens)
                    table.block_ids.append(block_of[key])
        return block_of

    # ------------------------------------------------------------------ allocation
    def _group_hits(self, computed) -> list:
        """Each group's hit blocks of ``computed`` (a ``ComputedBlocks``, or one group's plain list)."""
        if isinstance(computed, ComputedBlocks):
            return computed.groups
        if computed and len(self.groups) > 1:
            raise ValueError("with several KV cache groups, computed_blocks come from get_computed_blocks")
        return [list(computed) for _ in self.groups]

    def num_blocks_to_allocate(self, seq, num_new_tokens: int, computed_blocks=(), external_blocks=()) -> int:
        """Free blocks ``allocate_slots(seq, num_new_tokens, computed_blocks, external_blocks)`` would take, in
        all groups: new blocks (those for external blocks included), a copy of a shared, partly filled last
        block, and computed (cached) blocks that are free now."""
        tables = seq.block_tables or [None] * len(self.groups)
        hits = self._group_hits(computed_blocks)
        return sum(
            m.num_blocks_to_allocate(t, num_new_tokens, h, len(external_blocks))
            for m, t, h in zip(self.managers, tables, hits)
        )

    def allocate_slots(self, seq, num_new_tokens: int, computed_blocks=(), external_blocks=()) -> bool:
        """Reserve KV slots for ``num_new_tokens`` more tokens of ``seq``, in every group.

        A sequence without blocks first gets new tables starting with ``computed_blocks`` (from
        ``get_computed_blocks``; ``ref_count`` + 1 each, but in a sliding group those wholly before the
        first new token's window are not taken: ``NULL_BLOCK`` entries), then ``external_blocks``
        (``(block_hash, token_ids)`` of the next full blocks, found outside the pool: fresh blocks in each
        group, cached under their keys, which the finder fills before the step's kernels;
        ``kv_tier.KVTier.allocate_slots``). New blocks are taken as a table crosses block boundaries; a
        shared, partly filled last block is copied first (copy-on-write, see ``take_block_copies``).
        Where the free blocks are too few, idle LoRA adapters' pages are evicted first (``make_room``).
        Returns False, changing nothing else, when the pool has too few free blocks even so (blocks a
        sliding window has passed are given back first, in any case: ``remove_skipped_blocks``).

        Raises:
            ValueError: ``num_new_tokens < 0``, or ``computed_blocks`` for a sequence that has blocks.
            BlockPoolError: the sequence's tables were freed.
        """
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        if seq.block_tables is not None:
            if computed_blocks or external_blocks:
                raise ValueError("computed_blocks apply only to a sequence without blocks")
            _check_live(seq.block_tables[0])
            self.remove_skipped_blocks(seq)
        if not self.make_room(self.num_blocks_to_allocate(seq, num_new_tokens, computed_blocks, external_blocks)):
            return False
        if seq.block_tables is None:
            num_tokens = (len(computed_blocks) + len(external_blocks)) * self.block_size
            seq.block_tables = [self._new_table([], num_tokens, []) for _ in self.groups]
            hashes = self._hit_hashes(computed_blocks) + [h for h, _ in external_blocks]
            for m, table, h in zip(self.managers, seq.block_tables, self._group_hits(computed_blocks)):
                table.block_hashes = list(hashes)
                m.start_table(table, h, external_blocks)
        if num_new_tokens == 0:
            return True
        for m, table in zip(self.managers, seq.block_tables):
            copied = m.grow(table, num_new_tokens)
            if copied is not None:
                self.events.record(COPY, seq, src=copied[0], dst=copied[1])
        return True

    def make_room(self, num_blocks: int) -> bool:
        """Whether the pool has ``num_blocks`` free blocks, after evicting idle LoRA adapters' pages (least
        recently used first) where it needs them (``AdapterPages.make_room``)."""
        return self.adapter_pages.make_room(num_blocks)

    def _hit_hashes(self, computed) -> list:
        """The chained hashes of the hit blocks ``computed`` (one group's plain list: its blocks')."""
        if isinstance(computed, ComputedBlocks):
            return list(computed.hashes)
        return [self.block_pool.blocks[b].block_hash for b in computed]

    def remove_skipped_blocks(self, seq) -> int:
        """In each sliding group: release the blocks of ``seq`` wholly before position
        ``seq.num_computed_tokens - W + 1`` (no future token of the sequence reads them); their table
        entries become ``NULL_BLOCK``. A block still cached stays findable by a prefix lookup until the pool
        reuses it, as any freed block. Returns the number of blocks released (0 without a window)."""
        if seq.block_tables is None:
            return 0
        return sum(m.remove_skipped_blocks(t, seq.num_computed_tokens) for m, t in zip(self.managers, seq.block_tables))

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
        """Give back ``seq``'s slots past ``num_computed_tokens`` in every group (and the blocks only they
        used, to the head of the free queue); the ids released. Raises BlockPoolError for a freed table."""
        tables = seq.block_tables
        if tables is None or tables[0].num_tokens <= seq.num_computed_tokens:
            return []
        _check_live(tables[0])
        return [b for m, t in zip(self.managers, tables) for b in m.trim(t, seq.num_computed_tokens)]

    def fork(self, parent, child) -> None:
        """``child`` gets tables with the same contents as ``parent``'s, sharing every block
        (``ref_count`` + 1, no copy; the first write into a shared partly filled block copies it)."""
        if parent.block_tables is None:
            raise BlockPoolError(f"sequence {parent.seq_id} holds no blocks to fork")
        _check_live(parent.block_tables[0])
        child.block_tables = []
        held = 0
        for src in parent.block_tables:
            table = self._new_table(list(src.block_ids), src.num_tokens, list(src.block_hashes))
            child.block_tables.append(table)
            for bid in table.block_ids:
                if bid != NULL_BLOCK:
                    self.block_pool.share(bid, table.table_id)
                    held += 1
        self.events.record(FORK, child, parent_index=parent.index, num_blocks=held)

    def free(self, seq) -> None:
        """Return ``seq``'s blocks, every group's (each ``ref_count`` - 1; blocks at 0 become free, tail
        blocks first, each logical block's in every group together, so a prefix outlives its suffix in the
        cache). ``seq.block_tables`` becomes None; a
        sequence without blocks is left alone.

        Raises:
            BlockPoolError: the table was already freed, or holds a block it does not own.
        """
        tables = seq.block_tables
        if tables is None:
            return
        for table in tables:
            _check_live(table)
            for bid in table.block_ids:
                if bid != NULL_BLOCK and table.table_id not in self.block_pool.blocks[bid].owners:
                    raise BlockPoolError(f"table {table.table_id} does not own block {bid}")
        for i in reversed(range(len(tables[0].block_ids))):  # tail first, across the groups
            for table in tables:
                if table.block_ids[i] != NULL_BLOCK:
                    self.block_pool.release(table.block_ids[i], table.table_id)
        for table in tables:
            table.block_ids = []
            table.block_hashes = []
            table.num_tokens = 0
            table.freed = True
        seq.block_tables = None

    def _new_table(self, block_ids: list, num_tokens: int, block_hashes: list) -> BlockTable:
        return BlockTable(next(self._table_ids), self.block_size, block_ids, num_tokens, block_hashes)

    def take_block_copies(self) -> list:
        """The copy-on-write ``(src, dst)`` block copies recorded since the last call (any group's: a pool
        block holds its group's layers at the same places whichever group owns it)."""
        return self.block_pool.take_copies()

    # ------------------------------------------------------------------ checks
    def check_invariants(self, seqs=()) -> None:
        """The pool's invariants; with ``seqs`` (every sequence holding blocks) also that each sequence has
        a table per group, of ``ceil(num_tokens / block_size)`` entries, distinct blocks apart from leading
        ``NULL_BLOCK``s (only in a sliding group: those its window released), and each block's
        ``ref_count`` equals the number of tables holding it (a LoRA adapter's pages count as held by it,
        each by its adapter alone)."""
        pool = self.block_pool
        pool.check_invariants()
        counts: dict[int, int] = {}
        for s in seqs:
            if s.block_tables is None:
                continue
            assert len(s.block_tables) == len(self.groups), "a table per group"
            assert len({t.num_tokens for t in s.block_tables}) == 1, "groups' tables disagree on num_tokens"
            for m, t in zip(self.managers, s.block_tables):
                for bid in m.check_table(t):
                    assert t.table_id in pool.blocks[bid].owners, f"table {t.table_id} does not own block {bid}"
                    counts[bid] = counts.get(bid, 0) + 1
        for owner, block_ids in self.adapter_pages.owner_blocks().items():
            for bid in block_ids:
                assert pool.blocks[bid].owners == {owner}, f"adapter page {bid} is shared"
                counts[bid] = counts.get(bid, 0) + 1
        if any(s.block_tables is not None for s in seqs):
            for b in pool.blocks:
                assert counts.get(b.block_id, 0) == b.ref_count, f"block {b.block_id} ref_count mismatch"


def _check_live(table: BlockTable) -> None:
    if table.freed:
        raise BlockPoolError(f"block table {table.table_id} was already freed")
