"""The second KV tier beside the device pool: what moves between a ``KVCacheManager``'s blocks and the tier's
host slots (``kv_offload.OffloadingManager``), as vLLM v1 keeps its offloading connector beside its
``KVCacheManager``. The scheduler, which owns preemption, calls it.

A step's moves are ``(block, slot)`` stores and ``(slot, block)`` loads that the model runner copies before the
step's kernels (``take_transfers``; ``end_transfers`` once it has): a cached block evicted from the pool is
stored under its hash (the tier's own ``BlockPool.on_evict`` hook); a prefix that misses in the pool but hits
in the tier is loaded into fresh blocks (``get_offloaded_blocks``, ``allocate_slots``); a preempted request's
blocks are swapped out and back in (``swap_out``, ``swap_in``); with ``write_through`` (a persistent tier)
every block the pool newly caches is stored as well (``blocks_cached``).
"""

from __future__ import annotations

from rawpaged.core.block_table import NULL_BLOCK
from rawpaged.core.kv_cache_manager import KVCacheManager
from rawpaged.core.kv_offload import KVTransfers, OffloadingManager, SwappedTable
from rawpaged.core.prefix_cache import hash_block_tokens


class KVTier:
    """The tier of ``kv_cache_manager``'s pool, over the slots of ``manager``; installs the pool's eviction hook.

    Args:
        kv_cache_manager: the device pool's manager.
        manager: the tier's slot bookkeeping.
        write_through: store every newly cached full block too (a persistent tier).
    """

    def __init__(self, kv_cache_manager: KVCacheManager, manager: OffloadingManager, write_through: bool = False):
        self.kv_cache_manager = kv_cache_manager
        self.manager = manager
        self.write_through = write_through
        self._transfers = KVTransfers([], [])
        kv_cache_manager.block_pool.on_evict = self._store

    # ------------------------------------------------------------------ the step's transfers
    def take_transfers(self) -> KVTransfers:
        """The stores and loads recorded since the last call, for the runner to copy before the kernels."""
        transfers, self._transfers = self._transfers, KVTransfers([], [])
        return transfers

    def end_transfers(self) -> None:
        """The runner copied the step's transfers: their tier slots may be reused."""
        self.manager.end_step()

    def _store(self, block_id: int, block_hash: int, token_ids: tuple) -> None:
        """Store a cached pool block under its hash (also ``BlockPool.on_evict``: before the pool reuses it)."""
        slot = self.manager.store_prefix(block_hash, token_ids)
        if slot is not None:
            self._transfers.stores.append((block_id, slot))

    def blocks_cached(self, blocks) -> None:
        """The pool just cached ``blocks`` (``(block_id, block_hash, token_ids)``, from
        ``KVCacheManager.cache_full_blocks``): a write-through tier stores each."""
        if self.write_through:
            for block in blocks:
                self._store(*block)

    # ------------------------------------------------------------------ prefix hits
    def get_offloaded_blocks(self, seq, num_computed_blocks: int) -> list:
        """After ``num_computed_blocks`` pool hits: the next full blocks of ``seq``'s prefix found in the tier,
        every KV cache group's block of each, as ``(block_hash, token_ids, slots)`` (a slot per group),
        stopping at the first block some group misses (the last token is never taken, as in
        ``KVCacheManager.get_computed_blocks``). Empty where ``seq`` takes no cached blocks
        (``KVCacheManager.takes_cached_blocks``)."""
        kv = self.kv_cache_manager
        if not kv.takes_cached_blocks(seq):
            return []
        token_ids, bs = seq.token_ids, kv.block_size
        parent = kv.seq_root_hash(seq)
        for i in range(num_computed_blocks):  # the chain up to the pool hits (hashed again: cheap)
            parent = hash_block_tokens(parent, tuple(token_ids[i * bs : (i + 1) * bs]))
        found = []
        for i in range(num_computed_blocks, (len(token_ids) - 1) // bs):
            tokens = tuple(token_ids[i * bs : (i + 1) * bs])
            parent = hash_block_tokens(parent, tokens)
            slots = tuple(self.manager.lookup(m.key(parent), tokens) for m in kv.managers)
            if None in slots:
                break
            found.append((parent, tokens, slots))
        return found

    def allocate_slots(self, seq, num_new_tokens: int, computed_blocks=(), offloaded=()) -> bool:
        """``KVCacheManager.allocate_slots`` for ``seq`` with the tier's hits ``offloaded`` (from
        ``get_offloaded_blocks``) after its pool hits: each gets a fresh block in each group, loaded from its
        slot before the step's kernels (a hit a sliding window has passed is not taken). Returns False,
        changing nothing, when the pool has too few free blocks."""
        external = [(block_hash, tokens) for block_hash, tokens, _ in offloaded]
        if not self.kv_cache_manager.allocate_slots(seq, num_new_tokens, computed_blocks, external):
            return False
        first = len(computed_blocks)
        for g, table in enumerate(seq.block_tables):
            for (_, _, slots), bid in zip(offloaded, table.block_ids[first : first + len(offloaded)]):
                if bid != NULL_BLOCK:
                    self._transfers.loads.append((slots[g], bid))
                    self.manager.stats.prefix_hits += 1
        return True

    # ------------------------------------------------------------------ swapping
    def swap_out(self, seqs) -> bool:
        """Preemption by swapping: copy the blocks of ``seqs`` (one request's running sequences) to swap
        slots, each distinct block once, and free them in the pool; each sequence keeps a ``SwappedTable``
        and its ``num_computed_tokens`` (slots already taken for tokens it has not computed, in the step that
        preempts it, are given back, not swapped). Returns False, changing nothing, without room."""
        kv, bs = self.kv_cache_manager, self.kv_cache_manager.block_size
        kept = [
            b
            for s in seqs
            if s.block_tables is not None
            for t in s.block_tables
            for b in t.block_ids[: -(-s.num_computed_tokens // bs)]
        ]
        distinct = list(dict.fromkeys(b for b in kept if b != NULL_BLOCK))
        slots = self.manager.allocate_swap(len(distinct))
        if slots is None:
            return False
        for seq in seqs:  # slots taken in this step for tokens not computed yet are not swapped
            kv.trim_to_computed(seq)
        slot_of = dict(zip(distinct, slots))
        self._transfers.stores.extend(zip(distinct, slots))
        held = set()
        for seq in seqs:
            if seq.block_tables is None:
                continue
            group_slots = [[slot_of.get(b, NULL_BLOCK) for b in t.block_ids] for t in seq.block_tables]
            for slot in (s for entries in group_slots for s in entries):
                if slot != NULL_BLOCK and slot in held:
                    self.manager.share_swap(slot)
                held.add(slot)
            table = seq.block_table
            seq.swapped_table = SwappedTable(group_slots, table.num_tokens, list(table.block_hashes))
            kv.free(seq)
        return True

    @staticmethod
    def num_blocks_to_swap_in(seqs) -> int:
        """Pool blocks ``swap_in(seqs)`` takes: one per distinct swap slot."""
        return len({s for seq in seqs for s in seq.swapped_table.slots if s != NULL_BLOCK})

    def swap_in(self, seqs) -> bool:
        """Bring swapped-out ``seqs`` back: a fresh block per distinct slot, shared again by the sequences
        that shared it, loaded before the step's kernels. Returns False, changing nothing, when the pool has
        too few free blocks."""
        kv = self.kv_cache_manager
        if not kv.make_room(self.num_blocks_to_swap_in(seqs)):
            return False
        layouts = [
            (s.swapped_table.group_slots, s.swapped_table.num_tokens, s.swapped_table.block_hashes) for s in seqs
        ]
        block_of = kv.allocate_shared_tables(seqs, layouts)
        for slot, bid in block_of.items():
            self.manager.load_swap(slot)
            self._transfers.loads.append((slot, bid))
        for seq in seqs:
            for slot in seq.swapped_table.slots:
                if slot != NULL_BLOCK:
                    self.manager.release_swap(slot)
            seq.swapped_table = None
        return True
