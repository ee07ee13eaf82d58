"""The second KV tier's bookkeeping: the ``OffloadingManager`` alone, and a hypothesis state machine over a
``KVCacheManager`` with a ``KVTier`` beside it (and sometimes a sliding window) whose every step runs its transfers on
simulated device and host slot stores. Each position's "KV" is a function of the tokens up to it, so any
block served from anywhere (the pool, a prefix hit, the tier, a swap-in) can be checked."""

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from rawpaged.core.block_table import NULL_BLOCK
from rawpaged.core.kv_cache_manager import KVCacheManager
from rawpaged.core.kv_offload import OffloadingManager
from rawpaged.core.kv_tier import KVTier
from rawpaged.core.sequence import Sequence
from rawpaged.sampling_params import SamplingParams

_PARAMS = SamplingParams()


def seq(tokens, seq_id) -> Sequence:
    return Sequence(seq_id, f"r{seq_id}", 0, list(tokens), _PARAMS, None, 0.0)


# ------------------------------------------------------------------------------------------ the manager
def test_prefix_entries_are_lru_and_a_pinned_slot_is_never_evicted_in_its_step():
    m = OffloadingManager(2)
    a = m.store_prefix(1, (1,))
    b = m.store_prefix(2, (2,))
    assert {a, b} == {0, 1} and m.store_prefix(3, (3,)) is None  # both pinned this step: refused
    assert m.stats.refused_stores == 1
    m.end_step()
    assert m.lookup(1, (1,)) == a  # touched: 2 is now the least recently used
    m.end_step()
    c = m.store_prefix(3, (3,))
    assert c == b and not m.contains(2) and m.contains(1) and m.stats.prefix_evictions == 1
    assert m.lookup(1, (9,)) is None  # the token ids are compared, as in the pool
    assert m.store_prefix(1, (1,)) is None  # already there: touched, not stored again
    m.end_step()
    m.check_invariants()


def test_swap_slots_are_all_or_nothing_pinned_and_free_only_after_the_step():
    m = OffloadingManager(3)
    m.store_prefix(7, (7,))
    m.end_step()
    assert m.allocate_swap(4) is None and m.num_prefix_blocks == 1  # nothing taken
    slots = m.allocate_swap(3)  # evicts the prefix entry
    assert sorted(slots) == [0, 1, 2] and m.num_prefix_blocks == 0 and m.num_swap_blocks == 3
    m.share_swap(slots[0])
    m.end_step()
    m.load_swap(slots[0])
    m.release_swap(slots[0])
    m.release_swap(slots[0])  # both holders: free, but not before the step's load ran
    assert m.num_free_slots == 0 and not m.can_allocate(1)
    m.end_step()
    assert m.num_free_slots == 1 and m.num_swap_blocks == 2
    m.check_invariants()


def test_restored_entries_keep_their_lru_order():
    m = OffloadingManager(3)
    m.restore_prefix(2, 20, (2,))
    m.restore_prefix(0, 10, (1,))
    with pytest.raises(ValueError):
        m.restore_prefix(0, 30, (3,))
    assert m.lookup(20, (2,)) == 2 and m.stats.restored == 2
    m.end_step()
    m.store_prefix(40, (4,))  # the free slot
    m.end_step()
    m.store_prefix(50, (5,))  # evicts 10, the least recently used
    assert not m.contains(10) and m.contains(20)


def test_a_sequence_preempted_after_taking_this_steps_slots_swaps_only_its_computed_blocks():
    """A request's sibling (or a sequence with drafts) scheduled before the step ran out of blocks and
    swapped its request out: the slots it took for this step are given back, not swapped."""
    tier = OffloadingManager(8)
    kv = KVCacheManager(8, 4, True)
    kv_tier = KVTier(kv, tier)
    s = seq(range(6), 1)
    assert kv.allocate_slots(s, 6)
    s.num_computed_tokens = 6
    assert kv.allocate_slots(s, 5)  # this step's slots: positions 6..10, a third block
    assert len(s.block_table.block_ids) == 3
    assert kv_tier.swap_out([s])
    assert s.swapped_table.num_tokens == 6 and tier.num_swap_blocks == 2
    assert kv.block_pool.num_free_blocks == 8
    kv_tier.end_transfers()
    assert kv_tier.swap_in([s]) and s.block_table.num_tokens == 6
    assert kv.allocate_slots(s, 1) and s.block_table.num_tokens == 7
    kv.check_invariants([s])
    kv.free(s)
    kv_tier.end_transfers()
    tier.check_invariants()
    assert tier.num_swap_blocks == 0


def test_a_tier_prefix_hit_is_counted_when_loaded_not_at_each_lookup():
    """A request waiting for blocks looks its prefix up at every scheduling attempt: only the load counts."""
    tier = OffloadingManager(8)
    writer = KVCacheManager(8, 4, True)
    writer_tier = KVTier(writer, tier, write_through=True)
    s = seq(range(9), 1)
    assert writer.allocate_slots(s, 9)
    s.num_computed_tokens = 9
    writer_tier.blocks_cached(writer.cache_full_blocks(s))
    writer_tier.end_transfers()
    assert tier.stats.prefix_stores == 2
    kv = KVCacheManager(8, 4, True)  # an empty pool: the prefix is in the tier only
    kv_tier = KVTier(kv, tier)
    again = seq(range(9), 2)
    for _ in range(3):  # attempts that did not admit it
        found = kv_tier.get_offloaded_blocks(again, 0)
        kv_tier.end_transfers()
    assert len(found) == 2 and tier.stats.prefix_hits == 0
    assert kv_tier.allocate_slots(again, 1, (), found)
    assert tier.stats.prefix_hits == 2 and len(kv_tier.take_transfers().loads) == 2


def test_the_tier_beside_the_pool_installs_its_eviction_hook_and_records_the_transfers():
    """The pool's manager knows no tier; the tier hooks the pool's evictions itself, and it is what records a
    step's stores (an evicted cached block; with write-through, each block the manager says it just cached)."""
    kv = KVCacheManager(4, 2, True)
    assert kv.block_pool.on_evict is None
    assert not any(hasattr(kv, name) for name in ("offload", "write_through", "take_transfers", "swap_out"))
    tier = OffloadingManager(4)
    kv_tier = KVTier(kv, tier)
    assert kv.block_pool.on_evict == kv_tier._store
    s = seq(range(5), 1)
    assert kv.allocate_slots(s, 5)
    s.num_computed_tokens = 5
    cached = kv.cache_full_blocks(s)
    assert [(b, tokens) for b, _, tokens in cached] == [(0, (0, 1)), (1, (2, 3))]
    assert cached == [(b, kv.block_pool.blocks[b].block_hash, t) for b, _, t in cached]
    kv_tier.blocks_cached(cached)  # not write-through: nothing stored
    assert not kv_tier.take_transfers()
    kv.free(s)
    t = seq(range(10, 18), 2)
    assert kv.allocate_slots(t, 8)  # the 4 blocks: both cached ones evicted, stored under their hashes
    assert sorted(b for b, _ in kv_tier.take_transfers().stores) == [0, 1]
    assert all(tier.contains(h) for _, h, _ in cached)
    kv_tier.end_transfers()
    writer = KVTier(KVCacheManager(4, 2, True), OffloadingManager(4), write_through=True)
    u = seq(range(20, 25), 3)
    assert writer.kv_cache_manager.allocate_slots(u, 5)
    u.num_computed_tokens = 5
    writer.blocks_cached(writer.kv_cache_manager.cache_full_blocks(u))
    assert writer.take_transfers().stores == [(0, 0), (1, 1)] and writer.manager.stats.prefix_stores == 2
    tier.check_invariants()


# ------------------------------------------------------------------------------------------ the machine
def _value(tokens, p) -> int:
    """The "KV" of position ``p``: a function of the tokens up to and including it."""
    return hash(tuple(tokens[: p + 1])) % (1 << 62)


class TieredKVMachine(RuleBasedStateMachine):
    """Sequences over a small pool with prefix caching and a tier; each rule is one engine step: the
    manager's decisions, its transfers copied (stores, then loads), the new positions written, the
    transfers ended and full blocks cached. Speculative steps take draft slots and give back the
    rejected ones."""

    @initialize(
        num_blocks=st.integers(2, 16),
        num_slots=st.integers(1, 12),
        block_size=st.sampled_from([1, 2, 4]),
        window=st.sampled_from([None, None, 3, 9]),
    )
    def setup(self, num_blocks, num_slots, block_size, window):
        self.tier = OffloadingManager(num_slots)
        self.kv = KVCacheManager(num_blocks, block_size, True, sliding_window=window)
        self.kv_tier = KVTier(self.kv, self.tier)
        self.bs = block_size
        self.device = np.full(num_blocks * block_size, -1, np.int64)
        self.host = np.full(num_slots * block_size, -1, np.int64)
        self.live, self.swapped = {}, {}
        self.names = 0
        self.prefixes = {}  # block hash -> the token ids of its whole prefix (what its values follow from)

    def _step(self, seqs_written, cache=True):
        """Run the transfers and copies, write each ``(seq, first new position)``, end the transfers, cache
        (unless not ``cache``: the caller settles what was computed)."""
        t = self.kv_tier.take_transfers()
        bs = self.bs
        for block, slot in t.stores:
            self.host[slot * bs : (slot + 1) * bs] = self.device[block * bs : (block + 1) * bs]
        for slot, block in t.loads:
            self.device[block * bs : (block + 1) * bs] = self.host[slot * bs : (slot + 1) * bs]
        for src, dst in self.kv.take_block_copies():  # copy-on-write, after the transfers (as the runner)
            self.device[dst * bs : (dst + 1) * bs] = self.device[src * bs : (src + 1) * bs]
        for s, first in seqs_written:
            table = s.block_table
            for p in range(first, table.num_tokens):
                self.device[table.slots(p, p + 1)[0]] = _value(s.token_ids, p)
        self.kv_tier.end_transfers()
        for s, _ in seqs_written if cache else ():
            s.num_computed_tokens = s.block_table.num_tokens
            self.kv.cache_full_blocks(s)
            for i, h in enumerate(s.block_table.block_hashes):
                self.prefixes[h] = tuple(s.token_ids[: (i + 1) * bs])

    def _readable_from(self, s) -> int:
        w = self.kv.sliding_window
        return 0 if w is None else max(0, s.num_computed_tokens - w + 1)

    @rule(data=st.data(), n=st.integers(1, 12))
    def new_sequence(self, data, n):
        """A prompt: sometimes one that shares a prefix with an earlier sequence's tokens (pool or tier
        hits), then new tokens."""
        self.names += 1
        base = []
        if self.live and data.draw(st.booleans()):
            other = self.live[data.draw(st.sampled_from(sorted(self.live)))]
            base = other.token_ids[: data.draw(st.integers(0, other.num_tokens))]
        s = seq(base + [data.draw(st.integers(0, 3)) for _ in range(n)], self.names)
        computed = self.kv.get_computed_blocks(s)
        offloaded = self.kv_tier.get_offloaded_blocks(s, len(computed))
        cached = (len(computed) + len(offloaded)) * self.bs
        if self.kv_tier.allocate_slots(s, s.num_tokens - cached, computed, offloaded):
            s.num_computed_tokens = cached
            self._step([(s, cached)])
            self.live[s.seq_id] = s
        else:
            assert s.block_table is None
            self._step([])

    @precondition(lambda self: self.live)
    @rule(data=st.data(), n=st.integers(1, 6))
    def append(self, data, n):
        s = self.live[data.draw(st.sampled_from(sorted(self.live)))]
        first = s.num_tokens
        s.output_token_ids.extend(data.draw(st.integers(0, 3)) for _ in range(n))
        if self.kv.allocate_slots(s, n):
            self._step([(s, first)])
        else:
            del s.output_token_ids[first - s.num_prompt_tokens :]
            self._step([])

    @precondition(lambda self: self.live)
    @rule(data=st.data(), k=st.integers(1, 6))
    def speculate(self, data, k):
        """A speculative step: slots for k drafts taken and written, a prefix of them accepted, the rest's
        slots given back (blocks holding only rejected drafts released); nothing rejected is cached."""
        s = self.live[data.draw(st.sampled_from(sorted(self.live)))]
        first = s.num_tokens
        s.output_token_ids.extend(data.draw(st.integers(0, 3)) for _ in range(k))
        if not self.kv.allocate_slots(s, k):
            del s.output_token_ids[first - s.num_prompt_tokens :]
            self._step([])
            return
        self._step([(s, first)], cache=False)
        accepted = data.draw(st.integers(0, k))
        del s.output_token_ids[first + accepted - s.num_prompt_tokens :]
        s.num_computed_tokens = first + accepted
        free_before = self.kv.block_pool.num_free_blocks
        released = self.kv.free_rejected_slots(s)
        table = s.block_table
        assert table.num_tokens == first + accepted
        assert len(table.block_ids) == -(-table.num_tokens // self.bs)
        assert self.kv.block_pool.num_free_blocks == free_before + released
        self.kv.cache_full_blocks(s)
        for i, h in enumerate(table.block_hashes):
            self.prefixes[h] = tuple(s.token_ids[: (i + 1) * self.bs])

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def fork(self, data):
        parent = self.live[data.draw(st.sampled_from(sorted(self.live)))]
        self.names += 1
        child = seq(parent.prompt_token_ids, self.names)
        child.output_token_ids = list(parent.output_token_ids)
        self.kv.fork(parent, child)
        child.num_computed_tokens = parent.num_computed_tokens
        self.live[child.seq_id] = child

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free(self, data):
        s = self.live.pop(data.draw(st.sampled_from(sorted(self.live))))
        self.kv.free(s)
        self._step([])

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def swap_out(self, data):
        """One sequence, or a parent with every live sequence sharing one of its blocks (copied once)."""
        s = self.live[data.draw(st.sampled_from(sorted(self.live)))]
        held = {b for b in s.block_table.block_ids if b != NULL_BLOCK}
        group = [s] + [o for o in self.live.values() if o is not s and held & set(o.block_table.block_ids)]
        group = group if data.draw(st.booleans()) else [s]
        distinct = {b for o in group for b in o.block_table.block_ids if b != NULL_BLOCK}
        before = self.tier.stats.swap_out_blocks
        if self.kv_tier.swap_out(group):
            assert self.tier.stats.swap_out_blocks - before == len(distinct)  # shared blocks once
            for o in group:
                self.swapped[o.seq_id] = self.live.pop(o.seq_id)
                assert o.block_table is None and o.swapped_table is not None
        self._step([])

    @precondition(lambda self: self.swapped)
    @rule(data=st.data())
    def swap_in(self, data):
        s = self.swapped[data.draw(st.sampled_from(sorted(self.swapped)))]
        if self.kv_tier.swap_in([s]):
            self.live[s.seq_id] = self.swapped.pop(s.seq_id)
        self._step([])

    @invariant()
    def consistent(self):
        if not hasattr(self, "kv"):
            return
        self.kv.check_invariants(list(self.live.values()))
        self.tier.check_invariants()
        for s in self.live.values():  # every position the next token reads holds its value
            t = s.block_table
            first = self._readable_from(s)
            got = self.device[t.slots(first, t.num_tokens)]
            assert list(got) == [_value(s.token_ids, p) for p in range(first, t.num_tokens)]
        bs = self.bs
        for h, slot in self.tier._prefix.items():  # every tier block holds its prefix's values
            tokens = self.prefixes[h]
            got = self.host[slot * bs : (slot + 1) * bs]
            assert list(got) == [_value(tokens, p) for p in range(len(tokens) - bs, len(tokens))]
        held_slots = sum(1 for s in self.swapped.values() for x in s.swapped_table.slots if x != NULL_BLOCK)
        assert (held_slots == 0) == (self.tier.num_swap_blocks == 0)
        if not self.live and not self.swapped:
            assert self.kv.block_pool.num_free_blocks == self.kv.num_blocks


TestTieredKVMachine = TieredKVMachine.TestCase
TestTieredKVMachine.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)
