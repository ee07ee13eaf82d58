"""Block allocator: invariants, copy-on-write, errors, and a hypothesis state machine that checks every
sequence reads back exactly the KV it wrote through a simulated slot store."""

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from rawpaged.block_allocator import BlockAllocator, BlockAllocatorError


@pytest.mark.parametrize("n", [1, 15, 16, 17, 31, 32, 33])
def test_slot_mapping_at_block_boundaries(n):
    alloc = BlockAllocator(num_blocks=8, block_size=16)
    # Take blocks in a scrambled order so block ids differ from logical indices.
    decoy = alloc.new_table()
    alloc.allocate_slots(decoy, 16)
    t = alloc.new_table()
    assert alloc.allocate_slots(t, n)
    assert len(t.block_ids) == -(-n // 16)
    expected = [t.block_ids[p // 16] * 16 + p % 16 for p in range(n)]
    assert t.slots(0, n) == expected
    assert decoy.block_ids[0] not in t.block_ids
    # One more token: a new block exactly when n is a multiple of 16.
    before = len(t.block_ids)
    assert alloc.allocate_slots(t, 1)
    assert len(t.block_ids) == before + (n % 16 == 0)
    assert t.slots(n, n + 1) == [t.block_ids[n // 16] * 16 + n % 16]
    alloc.check_invariants([t, decoy])


def test_out_of_blocks_is_a_signal_and_changes_nothing():
    alloc = BlockAllocator(num_blocks=2, block_size=4)
    t = alloc.new_table()
    assert alloc.allocate_slots(t, 8)
    assert not alloc.allocate_slots(t, 1)
    assert t.num_tokens == 8 and len(t.block_ids) == 2
    alloc.check_invariants([t])
    alloc.free(t)
    assert alloc.num_free_blocks == 2


def test_fork_shares_blocks_and_cow_on_partial_last_block():
    alloc = BlockAllocator(num_blocks=8, block_size=4)
    parent = alloc.new_table()
    alloc.allocate_slots(parent, 6)  # blocks: full, half
    child = alloc.fork(parent)
    assert child.block_ids == parent.block_ids
    assert [alloc.blocks[b].ref_count for b in parent.block_ids] == [2, 2]
    shared_last = parent.block_ids[1]
    assert alloc.allocate_slots(child, 1)
    assert child.block_ids[0] == parent.block_ids[0]
    assert child.block_ids[1] != shared_last
    assert alloc.drain_copies() == [(shared_last, child.block_ids[1])]
    assert alloc.drain_copies() == []
    assert alloc.blocks[shared_last].ref_count == 1
    # The parent now owns its last block alone: no copy on its next write.
    assert alloc.allocate_slots(parent, 1)
    assert parent.block_ids[1] == shared_last and alloc.drain_copies() == []
    alloc.check_invariants([parent, child])
    alloc.free(parent)
    alloc.free(child)
    assert alloc.num_free_blocks == 8 and all(b.ref_count == 0 for b in alloc.blocks)


def test_fork_at_block_boundary_needs_no_copy():
    alloc = BlockAllocator(num_blocks=8, block_size=4)
    parent = alloc.new_table()
    alloc.allocate_slots(parent, 8)
    child = alloc.fork(parent)
    assert alloc.blocks_needed(child, 1) == 1
    alloc.allocate_slots(child, 1)
    assert alloc.drain_copies() == []
    assert child.block_ids[:2] == parent.block_ids


def test_cow_counts_toward_blocks_needed_and_fails_atomically():
    alloc = BlockAllocator(num_blocks=2, block_size=4)
    parent = alloc.new_table()
    alloc.allocate_slots(parent, 6)
    child = alloc.fork(parent)
    assert alloc.blocks_needed(child, 1) == 1  # the copy
    assert not alloc.allocate_slots(child, 1)  # pool empty
    assert alloc.drain_copies() == [] and child.block_ids == parent.block_ids
    alloc.check_invariants([parent, child])


def test_double_free_and_foreign_block_raise():
    alloc = BlockAllocator(num_blocks=4, block_size=4)
    t = alloc.new_table()
    alloc.allocate_slots(t, 5)
    alloc.free(t)
    with pytest.raises(BlockAllocatorError, match="already freed"):
        alloc.free(t)
    a, b = alloc.new_table(), alloc.new_table()
    alloc.allocate_slots(a, 4)
    b.block_ids = list(a.block_ids)  # forged: b never got these from the allocator
    b.num_tokens = 4
    with pytest.raises(BlockAllocatorError, match="does not own"):
        alloc.free(b)
    alloc.check_invariants([a])


def test_bad_arguments():
    with pytest.raises(ValueError, match="num_blocks"):
        BlockAllocator(0, 16)
    with pytest.raises(ValueError, match="block_size"):
        BlockAllocator(4, 0)
    alloc = BlockAllocator(4, 4)
    with pytest.raises(ValueError, match="num_new_tokens"):
        alloc.allocate_slots(alloc.new_table(), -1)


class PagedKVMachine(RuleBasedStateMachine):
    """Sequences write unique values into their slots; forks must never see each other's later writes."""

    @initialize(num_blocks=st.integers(1, 24), block_size=st.sampled_from([1, 2, 4, 16]))
    def setup(self, num_blocks, block_size):
        self.alloc = BlockAllocator(num_blocks, block_size)
        self.store = np.full(num_blocks * block_size, -1, dtype=np.int64)  # one "KV" value per slot
        self.seqs = {}  # name -> (table, list of values it wrote, in position order)
        self.counter = 0
        self.names = 0

    def _run_copies(self):
        """The runner's ``copy_blocks``, run before the step's kernels."""
        bs = self.alloc.block_size
        for src, dst in self.alloc.drain_copies():
            self.store[dst * bs:(dst + 1) * bs] = self.store[src * bs:(src + 1) * bs]

    def _write(self, table, values, n):
        if not self.alloc.allocate_slots(table, n):
            return False
        self._run_copies()
        new = list(range(self.counter, self.counter + n))
        self.counter += n
        self.store[table.slots(table.num_tokens - n, table.num_tokens)] = new
        values.extend(new)
        return True

    @rule(n=st.integers(1, 40))
    def new_sequence(self, n):
        table = self.alloc.new_table()
        values = []
        if self._write(table, values, n):
            self.seqs[self.names] = (table, values)
            self.names += 1
        else:
            assert table.block_ids == [] and table.num_tokens == 0
            assert self.alloc.blocks_needed(table, n) > self.alloc.num_free_blocks

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def fork(self, data):
        name = data.draw(st.sampled_from(sorted(self.seqs)))
        table, values = self.seqs[name]
        self.seqs[self.names] = (self.alloc.fork(table), list(values))
        self.names += 1

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def fork_by_copy(self, data):
        name = data.draw(st.sampled_from(sorted(self.seqs)))
        table, values = self.seqs[name]
        free_before = self.alloc.num_free_blocks
        child = self.alloc.fork(table, share=False)
        if child is None:
            assert len(table.block_ids) > free_before
            return
        self._run_copies()
        assert not set(child.block_ids) & set(table.block_ids)
        self.seqs[self.names] = (child, list(values))
        self.names += 1

    @precondition(lambda self: self.seqs)
    @rule(data=st.data(), n=st.integers(1, 20))
    def append(self, data, n):
        name = data.draw(st.sampled_from(sorted(self.seqs)))
        table, values = self.seqs[name]
        free_before, len_before = self.alloc.num_free_blocks, list(table.block_ids)
        if not self._write(table, values, n):
            assert self.alloc.num_free_blocks == free_before and table.block_ids == len_before

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def free(self, data):
        name = data.draw(st.sampled_from(sorted(self.seqs)))
        table, _ = self.seqs.pop(name)
        self.alloc.free(table)
        with pytest.raises(BlockAllocatorError):
            self.alloc.free(table)

    @invariant()
    def pool_invariants(self):
        if not hasattr(self, "alloc"):
            return
        tables = [t for t, _ in self.seqs.values()]
        self.alloc.check_invariants(tables)
        for table, values in self.seqs.values():
            assert list(self.store[table.slots(0, table.num_tokens)]) == values
        if not self.seqs:
            assert self.alloc.num_free_blocks == self.alloc.num_blocks


TestPagedKVMachine = PagedKVMachine.TestCase
TestPagedKVMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
