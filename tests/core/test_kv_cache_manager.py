"""KV-cache manager: slot mapping, on-demand blocks, copy-on-write forks, frees, prefix-cache lookups
(no model), and a hypothesis state machine that checks every sequence reads back exactly the KV it wrote
through a simulated slot store."""

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from benchmarks.baselines import CopyingForks
from rawpaged.core.block_pool import BlockPoolError
from rawpaged.core.block_table import NULL_BLOCK
from rawpaged.core.kv_cache_manager import KVCacheManager
from rawpaged.core.sequence import Sequence
from rawpaged.sampling_params import SamplingParams

_PARAMS = SamplingParams()


def seq(tokens=(), seq_id=0) -> Sequence:
    return Sequence(seq_id, f"r{seq_id}", 0, list(tokens), _PARAMS, None, 0.0)


@pytest.mark.parametrize("n", [1, 15, 16, 17, 31, 32, 33])
def test_slot_mapping_at_block_boundaries(n):
    kv = KVCacheManager(num_blocks=8, block_size=16)
    # Take blocks in a scrambled order so block ids differ from logical indices.
    decoy = seq()
    kv.allocate_slots(decoy, 16)
    s = seq(seq_id=1)
    assert kv.allocate_slots(s, n)
    t = s.block_table
    assert len(t.block_ids) == -(-n // 16)
    expected = [t.block_ids[p // 16] * 16 + p % 16 for p in range(n)]
    assert t.slots(0, n) == expected
    assert decoy.block_table.block_ids[0] not in t.block_ids
    # One more token: a new block exactly when n is a multiple of 16.
    before = len(t.block_ids)
    assert kv.allocate_slots(s, 1)
    assert len(t.block_ids) == before + (n % 16 == 0)
    assert t.slots(n, n + 1) == [t.block_ids[n // 16] * 16 + n % 16]
    kv.check_invariants([s, decoy])


def test_out_of_blocks_is_a_signal_and_changes_nothing():
    kv = KVCacheManager(num_blocks=2, block_size=4)
    s = seq()
    assert kv.allocate_slots(s, 8)
    assert not kv.allocate_slots(s, 1)
    assert s.block_table.num_tokens == 8 and len(s.block_table.block_ids) == 2
    kv.check_invariants([s])
    kv.free(s)
    assert s.block_table is None and kv.block_pool.num_free_blocks == 2


def test_fork_shares_blocks_and_cow_on_partial_last_block():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    pool = kv.block_pool
    parent, child = seq(), seq(seq_id=1)
    kv.allocate_slots(parent, 6)  # blocks: full, half
    kv.fork(parent, child)
    pt, ct = parent.block_table, child.block_table
    assert ct.block_ids == pt.block_ids and ct is not pt
    assert [pool.blocks[b].ref_count for b in pt.block_ids] == [2, 2]
    shared_last = pt.block_ids[1]
    assert kv.allocate_slots(child, 1)
    assert ct.block_ids[0] == pt.block_ids[0]
    assert ct.block_ids[1] != shared_last
    assert kv.take_block_copies() == [(shared_last, ct.block_ids[1])]
    assert kv.take_block_copies() == []
    assert pool.blocks[shared_last].ref_count == 1 and pool.num_cow_copies == 1
    # The parent now owns its last block alone: no copy on its next write.
    assert kv.allocate_slots(parent, 1)
    assert pt.block_ids[1] == shared_last and kv.take_block_copies() == []
    kv.check_invariants([parent, child])
    kv.free(parent)
    kv.free(child)
    assert pool.num_free_blocks == 8 and all(b.ref_count == 0 for b in pool.blocks)


def test_fork_at_block_boundary_needs_no_copy():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    parent, child = seq(), seq(seq_id=1)
    kv.allocate_slots(parent, 8)
    kv.fork(parent, child)
    assert kv.num_blocks_to_allocate(child, 1) == 1
    kv.allocate_slots(child, 1)
    assert kv.take_block_copies() == []
    assert child.block_table.block_ids[:2] == parent.block_table.block_ids


def test_cow_counts_toward_blocks_needed_and_fails_atomically():
    kv = KVCacheManager(num_blocks=2, block_size=4)
    parent, child = seq(), seq(seq_id=1)
    kv.allocate_slots(parent, 6)
    kv.fork(parent, child)
    assert kv.num_blocks_to_allocate(child, 1) == 1  # the copy
    assert not kv.allocate_slots(child, 1)  # pool empty
    assert kv.take_block_copies() == [] and child.block_table.block_ids == parent.block_table.block_ids
    kv.check_invariants([parent, child])


def test_double_free_and_foreign_block_raise():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    s = seq()
    kv.allocate_slots(s, 5)
    table = s.block_table
    kv.free(s)
    kv.free(s)  # a sequence without blocks: nothing to do
    s.block_table = table
    with pytest.raises(BlockPoolError, match="already freed"):
        kv.free(s)
    with pytest.raises(BlockPoolError, match="already freed"):
        kv.allocate_slots(s, 1)
    a, b = seq(seq_id=1), seq(seq_id=2)
    kv.allocate_slots(a, 4)
    kv.allocate_slots(b, 0)
    b.block_table.block_ids = list(a.block_table.block_ids)  # forged: b never got these from the manager
    b.block_table.num_tokens = 4
    with pytest.raises(BlockPoolError, match="does not own"):
        kv.free(b)
    kv.check_invariants([a])


def test_free_of_a_table_with_a_foreign_block_releases_nothing():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    a, b = seq(seq_id=1), seq(seq_id=2)
    kv.allocate_slots(a, 4)
    kv.allocate_slots(b, 8)
    b.block_table.block_ids[0] = a.block_table.block_ids[0]  # forged first block; b still owns its second
    own = b.block_table.block_ids[1]
    with pytest.raises(BlockPoolError, match="does not own"):
        kv.free(b)
    assert kv.block_pool.blocks[own].ref_count == 1 and kv.block_pool.num_free_blocks == 1


def test_check_invariants_checks_the_pool_with_or_without_tables():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    a = seq()
    kv.allocate_slots(a, 4)
    kv.check_invariants()  # blocks in use, but no tables given: only the pool is checked
    kv.block_pool.blocks[a.block_table.block_ids[0]].ref_count = 0
    with pytest.raises(AssertionError):
        kv.check_invariants()


def test_reset_stats_zeroes_the_copy_on_write_count():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    a, b = seq(), seq(seq_id=1)
    kv.allocate_slots(a, 2)
    kv.fork(a, b)
    kv.allocate_slots(b, 1)  # writes into the shared partial block: one copy
    assert kv.block_pool.num_cow_copies == 1
    kv.reset_stats()
    assert kv.block_pool.num_cow_copies == 0 and kv.num_prefix_queries == kv.num_prefix_hits == 0


def test_bad_arguments():
    with pytest.raises(ValueError, match="num_blocks"):
        KVCacheManager(0, 16)
    with pytest.raises(ValueError, match="block_size"):
        KVCacheManager(4, 0)
    kv = KVCacheManager(4, 4)
    with pytest.raises(ValueError, match="num_new_tokens"):
        kv.allocate_slots(seq(), -1)
    s = seq()
    kv.allocate_slots(s, 4)
    with pytest.raises(ValueError) as e:
        kv.allocate_slots(s, 1, [0])
    assert str(e.value) == "computed_blocks apply only to a sequence without blocks"
    with pytest.raises(BlockPoolError, match="no blocks"):
        kv.fork(seq(seq_id=5), seq(seq_id=6))


def test_prefix_cache_hit_reuses_blocks_and_recomputes_the_last_token():
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    tokens = list(range(100, 112))  # three full blocks
    first = seq(tokens)
    assert kv.get_computed_blocks(first) == []
    kv.allocate_slots(first, 12)
    first.num_computed_tokens = 12
    kv.cache_full_blocks(first)
    assert len(first.block_table.block_hashes) == 3
    second = seq(tokens, seq_id=1)  # the same prompt: the last block is recomputed, so two hits
    computed = kv.get_computed_blocks(second)
    assert computed == first.block_table.block_ids[:2]
    assert (kv.num_prefix_queries, kv.num_prefix_hits) == (3, 2)  # one miss on the empty cache, then 2 hits
    kv.allocate_slots(second, 4, computed)
    assert second.block_table.block_ids[:2] == computed and second.block_table.num_tokens == 12
    assert [kv.block_pool.blocks[b].ref_count for b in computed] == [2, 2]
    kv.check_invariants([first, second])
    # Freed, the blocks stay findable until reused.
    kv.free(first)
    kv.free(second)
    assert kv.block_pool.num_cached_free_blocks == 3
    third = seq(tokens[:8] + [7, 7, 7, 7], seq_id=2)
    assert kv.get_computed_blocks(third) == computed


def test_prefix_cache_hit_that_does_not_fit_changes_nothing():
    kv = KVCacheManager(num_blocks=3, block_size=4, enable_prefix_caching=True)
    a = seq(list(range(8)) + [50])
    kv.allocate_slots(a, 9)
    a.num_computed_tokens = 9
    kv.cache_full_blocks(a)
    kv.free(a)
    pool = kv.block_pool
    free_order = list(pool._free)
    b = seq(list(range(8)) + list(range(60, 68)), seq_id=1)  # 2 cached blocks + 2 new: 4 > 3 blocks
    computed = kv.get_computed_blocks(b)
    assert len(computed) == 2
    assert kv.num_blocks_to_allocate(b, 8, computed) == 4
    assert not kv.allocate_slots(b, 8, computed)
    assert b.block_table is None and list(pool._free) == free_order
    assert all(pool.blocks[i].ref_count == 0 for i in computed)


def test_copying_forks_baseline_copies_every_block():
    kv = CopyingForks(num_blocks=8, block_size=4)
    parent, child = seq(), seq(seq_id=1)
    kv.allocate_slots(parent, 6)
    kv.fork(parent, child)
    assert not set(child.block_table.block_ids) & set(parent.block_table.block_ids)
    assert kv.take_block_copies() == list(zip(parent.block_table.block_ids, child.block_table.block_ids))
    kv.check_invariants([parent, child])
    big = CopyingForks(num_blocks=3, block_size=4)
    parent, child = seq(), seq(seq_id=1)
    big.allocate_slots(parent, 8)
    big.fork(parent, child)  # one free block for a two-block copy: shares after all
    assert child.block_table.block_ids == parent.block_table.block_ids and big.take_block_copies() == []


class PagedKVMachine(RuleBasedStateMachine):
    """Sequences write unique values into their slots; forks must never see each other's later writes."""

    @initialize(num_blocks=st.integers(1, 24), block_size=st.sampled_from([1, 2, 4, 16]))
    def setup(self, num_blocks, block_size):
        self.kv = CopyingForks(num_blocks, block_size)  # its fork_by_copy, and the shared fork via super()
        self.store = np.full(num_blocks * block_size, -1, dtype=np.int64)  # one "KV" value per slot
        self.seqs = {}  # name -> (sequence, list of values it wrote, in position order)
        self.counter = 0
        self.names = 0

    def _run_copies(self):
        """The runner's ``copy_blocks``, run before the step's kernels."""
        bs = self.kv.block_size
        for src, dst in self.kv.take_block_copies():
            self.store[dst * bs : (dst + 1) * bs] = self.store[src * bs : (src + 1) * bs]

    def _write(self, s, values, n):
        if not self.kv.allocate_slots(s, n):
            return False
        self._run_copies()
        new = list(range(self.counter, self.counter + n))
        self.counter += n
        t = s.block_table
        self.store[t.slots(t.num_tokens - n, t.num_tokens)] = new
        values.extend(new)
        return True

    def _new_seq(self):
        self.names += 1
        return seq(seq_id=self.names)

    @rule(n=st.integers(1, 40))
    def new_sequence(self, n):
        s = self._new_seq()
        values = []
        if self._write(s, values, n):
            self.seqs[s.seq_id] = (s, values)
        else:
            assert s.block_table is None
            assert self.kv.num_blocks_to_allocate(s, n) > self.kv.block_pool.num_free_blocks

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def fork(self, data):
        parent, values = self.seqs[data.draw(st.sampled_from(sorted(self.seqs)))]
        child = self._new_seq()
        KVCacheManager.fork(self.kv, parent, child)
        child.num_computed_tokens = parent.num_computed_tokens
        self.seqs[child.seq_id] = (child, list(values))

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def fork_by_copy(self, data):
        parent, values = self.seqs[data.draw(st.sampled_from(sorted(self.seqs)))]
        free_before = self.kv.block_pool.num_free_blocks
        child = self._new_seq()
        self.kv.fork(parent, child)
        child.num_computed_tokens = parent.num_computed_tokens
        self._run_copies()
        held = [b for b in parent.block_table.block_ids if b != NULL_BLOCK]
        shared = set(child.block_table.block_ids) & set(held)
        assert not shared or len(held) > free_before
        self.seqs[child.seq_id] = (child, list(values))

    @precondition(lambda self: self.seqs)
    @rule(data=st.data(), n=st.integers(1, 20))
    def append(self, data, n):
        s, values = self.seqs[data.draw(st.sampled_from(sorted(self.seqs)))]
        self.kv.remove_skipped_blocks(s)  # a window's blocks go back even when the allocation fails
        free_before, blocks_before = self.kv.block_pool.num_free_blocks, list(s.block_table.block_ids)
        if not self._write(s, values, n):
            assert self.kv.block_pool.num_free_blocks == free_before and s.block_table.block_ids == blocks_before

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def free(self, data):
        s, _ = self.seqs.pop(data.draw(st.sampled_from(sorted(self.seqs))))
        table = s.block_table
        self.kv.free(s)
        assert s.block_table is None and table.freed

    @invariant()
    def pool_invariants(self):
        if not hasattr(self, "kv"):
            return
        self.kv.check_invariants([s for s, _ in self.seqs.values()])
        for s, values in self.seqs.values():
            assert list(self.store[s.block_table.slots(0, s.block_table.num_tokens)]) == values
        if not self.seqs:
            assert self.kv.block_pool.num_free_blocks == self.kv.num_blocks


TestPagedKVMachine = PagedKVMachine.TestCase
TestPagedKVMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


class WindowedKVMachine(PagedKVMachine):
    """The same sequences under a sliding window W: blocks wholly before a sequence's window are given back
    as it grows, forks keep the released entries released, and every position the next token can read
    still reads back what was written there."""

    @initialize(num_blocks=st.integers(1, 24), block_size=st.sampled_from([1, 2, 4, 16]), window=st.integers(1, 40))
    def setup(self, num_blocks, block_size, window):
        super().setup(num_blocks, block_size)
        self.kv = CopyingForks(num_blocks, block_size, sliding_window=window)

    def _write(self, s, values, n):
        if not super()._write(s, values, n):
            return False
        s.num_computed_tokens = s.block_table.num_tokens  # what the engine's step records
        return True

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def decode(self, data):
        """One token, as a decode step writes it: the sequence then holds at most ceil(W / bs) + 1 blocks."""
        s, values = self.seqs[data.draw(st.sampled_from(sorted(self.seqs)))]
        if self._write(s, values, 1):
            held = [b for b in s.block_table.block_ids if b != NULL_BLOCK]
            assert len(held) <= -(-self.kv.sliding_window // self.kv.block_size) + 1

    @invariant()
    def pool_invariants(self):
        if not hasattr(self, "kv"):
            return
        self.kv.check_invariants([s for s, _ in self.seqs.values()])
        for s, values in self.seqs.values():
            t = s.block_table
            first = max(0, t.num_tokens - self.kv.sliding_window + 1)  # where the next token's window starts
            assert list(self.store[t.slots(first, t.num_tokens)]) == values[first:]
        if not self.seqs:
            assert self.kv.block_pool.num_free_blocks == self.kv.num_blocks


TestWindowedKVMachine = WindowedKVMachine.TestCase
TestWindowedKVMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


def test_a_windowed_sequence_gives_its_blocks_back_and_prefix_hits_stay_correct():
    """Decoding 8 W tokens holds at most ceil(W / bs) + 1 blocks; released blocks are free (the cached ones
    still findable until reused); a later prefix lookup maps only blocks whose content is intact."""
    bs, W = 4, 10
    kv = KVCacheManager(num_blocks=40, block_size=bs, enable_prefix_caching=True, sliding_window=W)
    s = seq(range(12))
    assert kv.allocate_slots(s, 12)
    s.num_computed_tokens = 12
    kv.cache_full_blocks(s)
    most = 0
    for t in range(8 * W):
        s.output_token_ids.append(100 + t)
        assert kv.allocate_slots(s, 1)
        s.num_computed_tokens += 1
        kv.cache_full_blocks(s)
        held = [b for b in s.block_table.block_ids if b != NULL_BLOCK]
        most = max(most, len(held))
        kv.check_invariants([s])
    assert most <= -(-W // bs) + 1 and kv.num_window_frees > 0
    assert s.block_table.block_ids[0] == NULL_BLOCK
    assert kv.block_pool.num_free_blocks == kv.num_blocks - len(held)
    again = seq([*range(12), 7], seq_id=1)
    hits = kv.get_computed_blocks(again)  # the prompt's blocks were released but are still cached
    assert len(hits) == 3 and all(kv.block_pool.blocks[b].block_hash is not None for b in hits)
    kv.free(s)
    kv.check_invariants([])
    assert kv.block_pool.num_free_blocks == kv.num_blocks


def test_defaults_and_zero_token_allocation():
    kv = KVCacheManager(4)
    assert kv.block_size == 16 and not kv.enable_prefix_caching and kv.num_blocks == 4 and kv.usage == 0.0
    s = seq()
    assert kv.allocate_slots(s, 0) and s.block_table.block_ids == [] and s.block_table.num_tokens == 0
    assert kv.allocate_slots(s, 0)  # again, with a table


def test_zero_tokens_need_no_copy_even_onto_a_shared_partial_block():
    kv = KVCacheManager(num_blocks=2, block_size=4)
    parent, child = seq(), seq(seq_id=1)
    kv.allocate_slots(parent, 6)
    kv.fork(parent, child)
    assert kv.num_blocks_to_allocate(child, 0) == 0 and kv.block_pool.num_free_blocks == 0
    assert kv.allocate_slots(child, 0) and kv.take_block_copies() == []


def test_copy_on_write_only_for_a_shared_partial_block():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    alone = seq()
    kv.allocate_slots(alone, 6)  # partial last block, not shared: no copy counted
    assert kv.num_blocks_to_allocate(alone, 1) == 0
    assert kv.num_blocks_to_allocate(alone, 3) == 1 and kv.num_blocks_to_allocate(alone, 2) == 0


def test_allocation_with_exactly_enough_free_blocks_succeeds():
    kv = KVCacheManager(num_blocks=3, block_size=4)
    s = seq()
    assert kv.num_blocks_to_allocate(s, 12) == 3 and kv.allocate_slots(s, 12)
    assert kv.block_pool.num_free_blocks == 0
    t = seq(seq_id=1)
    assert kv.num_blocks_to_allocate(t, 1) == 1 and not kv.allocate_slots(t, 1)


def test_free_empties_the_table():
    kv = KVCacheManager(num_blocks=4, block_size=4, enable_prefix_caching=True)
    s = seq(list(range(6)))
    kv.allocate_slots(s, 6)
    s.num_computed_tokens = 6
    kv.cache_full_blocks(s)
    table = s.block_table
    assert len(table.block_hashes) == 1
    kv.free(s)
    assert (table.block_ids, table.block_hashes, table.num_tokens, table.freed) == ([], [], 0, True)
    kv.free(s)  # nothing left to free


def test_fork_and_appends_refuse_a_freed_table():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    parent = seq()
    kv.allocate_slots(parent, 5)
    freed = parent.block_table
    kv.free(parent)
    parent.block_table = freed
    with pytest.raises(BlockPoolError, match="already freed"):
        kv.fork(parent, seq(seq_id=1))
    with pytest.raises(BlockPoolError, match="already freed"):
        kv.allocate_slots(parent, 0)


def _computed(kv, s):
    """Run ``s``'s whole prompt as the engine would: hits, slots, computed tokens, cached blocks."""
    hits = kv.get_computed_blocks(s)
    assert kv.allocate_slots(s, s.num_tokens - len(hits) * kv.block_size, hits)
    s.num_computed_tokens = s.num_tokens
    kv.cache_full_blocks(s)
    return hits


def test_prefix_cache_chains_past_the_hit_and_through_forks():
    kv = KVCacheManager(num_blocks=16, block_size=2, enable_prefix_caching=True)
    base = list(range(100, 108))  # four blocks of 2
    a = seq(base[:5])
    _computed(kv, a)  # caches blocks 0 and 1
    b = seq(base[:7], seq_id=1)
    assert len(_computed(kv, b)) == 2  # hits 2, computes and caches block 2 chained after the hits
    c = seq(base + [1], seq_id=2)
    assert len(_computed(kv, c)) == 3  # the third block is found: the chain continued through b's hits
    child = seq(seq_id=3)
    kv.fork(c, child)
    assert child.block_table.block_hashes == c.block_table.block_hashes
    child.prompt_token_ids = list(c.prompt_token_ids)
    child.output_token_ids = [5, 6, 7]
    child.num_computed_tokens = c.num_tokens
    kv.allocate_slots(child, 3)
    child.num_computed_tokens = child.num_tokens
    kv.cache_full_blocks(child)
    d = seq(base + [1, 5, 6, 7, 9], seq_id=4)
    assert len(kv.get_computed_blocks(d)) == 6  # the fork's blocks chain onto the parent's


def test_prefix_cache_counts_every_lookup():
    kv = KVCacheManager(num_blocks=8, block_size=2, enable_prefix_caching=True)
    _computed(kv, seq([1, 2, 3, 4, 5]))
    kv.get_computed_blocks(seq([1, 2, 3, 4, 5], seq_id=1))
    kv.get_computed_blocks(seq([1, 2, 9, 9, 9], seq_id=2))
    assert (kv.num_prefix_queries, kv.num_prefix_hits) == (1 + 2 + 2, 2 + 1)
    kv.reset_stats()
    assert (kv.num_prefix_queries, kv.num_prefix_hits, kv.block_pool.num_cow_copies) == (0, 0, 0)
    assert kv.block_pool.peak_used_blocks == kv.block_pool.num_used_blocks == 3


def test_caching_off_registers_nothing_and_finds_nothing():
    kv = KVCacheManager(num_blocks=8, block_size=2, enable_prefix_caching=False)
    s = seq([1, 2, 3, 4, 5])
    _computed(kv, s)
    assert s.block_table.block_hashes == [] and kv.block_pool.num_cached_free_blocks == 0
    assert kv.get_computed_blocks(seq([1, 2, 3, 4, 5], seq_id=1)) == [] and kv.num_prefix_queries == 0


def test_cache_full_blocks_hashes_only_what_is_computed():
    kv = KVCacheManager(num_blocks=8, block_size=2, enable_prefix_caching=True)
    s = seq([1, 2, 3, 4, 5, 6])
    kv.allocate_slots(s, 6)
    s.num_computed_tokens = 3
    kv.cache_full_blocks(s)
    assert len(s.block_table.block_hashes) == 1
    s.num_computed_tokens = 6
    kv.cache_full_blocks(s)
    assert len(s.block_table.block_hashes) == 3


@pytest.mark.parametrize("corrupt, message", [
    (lambda a, b: setattr(a.block_table, "num_tokens", 9), "table length"),
    (lambda a, b: a.block_table.block_ids.__setitem__(1, a.block_table.block_ids[0]), "a table holds a block twice"),
    (lambda a, b: b.block_table.block_ids.__setitem__(0, a.block_table.block_ids[0]), "does not own block"),
    (lambda a, b: setattr(b.block_table, "freed", True), "was freed"),
])  # fmt: skip
def test_check_invariants_sees_broken_tables(corrupt, message):
    kv = KVCacheManager(num_blocks=8, block_size=4)
    a, b = seq(), seq(seq_id=1)
    kv.allocate_slots(a, 8)
    kv.allocate_slots(b, 4)
    kv.check_invariants([a, b])
    corrupt(a, b)
    with pytest.raises(AssertionError) as e:
        kv.check_invariants([a, b])
    assert message in str(e.value) and not str(e.value).startswith("XX")


def test_check_invariants_counts_references_of_all_given_tables():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    a, b = seq(), seq(seq_id=1)
    kv.allocate_slots(a, 4)
    kv.fork(a, b)
    kv.check_invariants([a, b])
    with pytest.raises(AssertionError, match="ref_count mismatch"):
        kv.check_invariants([a, seq(seq_id=5)])  # b's reference is not accounted for


def test_a_new_table_starts_with_its_hits():
    kv = KVCacheManager(num_blocks=8, block_size=2, enable_prefix_caching=True)
    first = seq([1, 2, 3, 4, 5])
    _computed(kv, first)
    s = seq([1, 2, 3, 4, 9], seq_id=1)
    hits = kv.get_computed_blocks(s)
    assert kv.allocate_slots(s, 0, hits)  # the hits alone
    assert s.block_table.num_tokens == 4 and s.block_table.block_ids == hits and len(s.block_table.block_hashes) == 2
    kv.check_invariants([first, s])


def test_peak_after_reset_is_the_current_use():
    kv = KVCacheManager(num_blocks=8, block_size=2)
    a = seq()
    kv.allocate_slots(a, 6)
    kv.allocate_slots(seq(seq_id=1), 4)
    kv.free(a)
    kv.reset_stats()
    assert kv.block_pool.peak_used_blocks == 2


def test_a_kv_cache_of_another_dtype_never_hits():
    """Blocks cached under one KV-cache dtype are not found under another (the manager's root keys)."""
    a = KVCacheManager(8, 4, enable_prefix_caching=True, cache_keys=("int8",))
    s = seq(range(12))
    assert a.allocate_slots(s, 12)
    s.num_computed_tokens = 12
    a.cache_full_blocks(s)
    again = seq([*range(12), 5], seq_id=1)
    assert len(a.get_computed_blocks(again)) == 3
    b = KVCacheManager(8, 4, enable_prefix_caching=True, cache_keys=("fp8_e4m3",))
    b.block_pool = a.block_pool  # the same cached blocks, looked up with another dtype's hashes
    assert b.get_computed_blocks(again) == []


def test_window_frees_count_each_block_once():
    """A 4-token window over 12 computed tokens passes blocks 0 and 1: 2 frees, however often it is asked."""
    kv = KVCacheManager(8, 4, sliding_window=4)
    s = Sequence(0, "r0", 0, list(range(12)), SamplingParams(), None, 0.0)
    assert kv.allocate_slots(s, 12)
    s.num_computed_tokens = 12
    assert [kv.remove_skipped_blocks(s) for _ in range(3)] == [2, 0, 0]
    assert kv.num_window_frees == 2 and s.block_table.block_ids[:2] == [NULL_BLOCK, NULL_BLOCK]
