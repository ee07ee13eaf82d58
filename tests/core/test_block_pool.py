"""Block pool: the free queue is the eviction order, cached blocks stay findable until reused, ref
counts and owners, copy-on-write records, misuse raises."""

import pytest

from rawpaged.core.block_pool import BlockPool, BlockPoolError
from rawpaged.core.prefix_cache import find_longest_cache_hit, hash_block_tokens, root_hash


def test_take_pops_least_recently_freed_and_release_appends():
    pool = BlockPool(4)
    a, b, c = (pool.take(owner=i).block_id for i in range(3))
    assert (a, b, c) == (0, 1, 2) and pool.num_free_blocks == 1 and pool.peak_used_blocks == 3
    pool.release(b, 1)
    pool.release(a, 0)
    # Free queue now: 3, 1, 0 (oldest first).
    assert [pool.take(owner=9).block_id for _ in range(3)] == [3, 1, 0]
    assert pool.num_free_blocks == 0 and pool.usage() == 1.0
    pool.check_invariants()


def test_cached_block_survives_release_until_taken_again():
    pool = BlockPool(2)
    h = hash_block_tokens(None, (1, 2))
    blk = pool.take(owner=0)
    pool.cache_block(blk.block_id, h, (1, 2))
    pool.release(blk.block_id, 0)
    assert pool.get_cached_block(h, (1, 2)) == blk.block_id and pool.num_cached_free_blocks == 1
    assert pool.get_cached_block(h, (1, 3)) is None  # same hash, other tokens: never a hit
    pool.share(blk.block_id, owner=5)  # a hit on a free cached block takes it off the free queue
    assert pool.blocks[blk.block_id].ref_count == 1 and pool.num_free_blocks == 1
    pool.release(blk.block_id, 5)
    other = pool.take(owner=1)  # the other block is older in the queue
    assert other.block_id != blk.block_id and pool.get_cached_block(h, (1, 2)) == blk.block_id
    evicting = pool.take(owner=2)  # now the cached block is reused: its prefix is evicted
    assert evicting.block_id == blk.block_id and evicting.block_hash is None
    assert pool.get_cached_block(h, (1, 2)) is None
    pool.check_invariants()


def test_cache_block_registers_each_hash_once():
    pool = BlockPool(3)
    h = hash_block_tokens(None, (4,))
    x, y = pool.take(0).block_id, pool.take(1).block_id
    pool.cache_block(x, h, (4,))
    pool.cache_block(y, h, (4,))  # same content in another block: the first one stays the cached one
    assert pool.get_cached_block(h, (4,)) == x and pool.blocks[y].block_hash is None
    pool.cache_block(x, hash_block_tokens(h, (5,)), (5,))  # an already cached block keeps its identity
    assert pool.blocks[x].block_hash == h


def test_copy_on_write_replaces_the_reference_and_records_the_copy():
    pool = BlockPool(3)
    src = pool.take(owner=0).block_id
    pool.share(src, owner=1)
    dst = pool.copy_on_write(src, owner=1)
    assert dst != src and pool.take_copies() == [(src, dst)] and pool.take_copies() == []
    assert pool.blocks[src].owners == {0} and pool.blocks[dst].owners == {1} and pool.num_cow_copies == 1
    pool.check_invariants()


def test_release_by_a_non_owner_raises():
    pool = BlockPool(2)
    b = pool.take(owner=0).block_id
    with pytest.raises(BlockPoolError, match="does not own"):
        pool.release(b, 7)
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(0)


def test_check_invariants_catches_a_corrupt_ref_count():
    pool = BlockPool(2)
    b = pool.take(owner=0)
    b.ref_count = 2
    with pytest.raises(AssertionError):
        pool.check_invariants()


def test_longest_cache_hit_stops_at_the_first_miss_and_at_max_blocks():
    pool = BlockPool(4)
    tokens = list(range(8))
    parent = None
    for i in range(2):  # cache the first two 4-token blocks... but only blocks 0 and 1 of a 3-block prompt
        blk = pool.take(owner=i)
        parent = hash_block_tokens(parent, tuple(tokens[4 * i : 4 * i + 4]))
        pool.cache_block(blk.block_id, parent, tuple(tokens[4 * i : 4 * i + 4]))
    assert find_longest_cache_hit(pool, tokens + [9, 9, 9, 9], 4, max_blocks=3) == ([0, 1], 3)
    assert find_longest_cache_hit(pool, tokens, 4, max_blocks=1) == ([0], 1)
    assert find_longest_cache_hit(pool, [99] + tokens[1:], 4, max_blocks=2) == ([], 1)  # chained: no later hit


def test_counters_start_at_zero_and_count_every_event():
    pool = BlockPool(4)
    assert (pool.peak_used_blocks, pool.num_cow_copies, pool.num_shared_blocks, pool.usage()) == (0, 0, 0, 0.0)
    a = pool.take(owner=0).block_id
    b = pool.take(owner=0).block_id
    pool.share(a, owner=1)
    pool.share(b, owner=1)
    assert pool.num_shared_blocks == 2
    pool.copy_on_write(a, owner=1)
    pool.copy_on_write(b, owner=1)
    assert pool.num_cow_copies == 2 and pool.peak_used_blocks == 4 and pool.num_shared_blocks == 0
    assert pool.take_copies() == [(a, 2), (b, 3)]


def test_a_cache_hit_on_a_free_block_counts_toward_the_peak():
    pool = BlockPool(3)
    blk = pool.take(owner=0)
    pool.cache_block(blk.block_id, 7, (1,))
    pool.release(blk.block_id, 0)
    assert pool.num_used_blocks == 0 and pool.peak_used_blocks == 1
    pool.take(owner=1)
    pool.share(blk.block_id, owner=2)  # the hit takes a free block: 2 in use now
    assert pool.peak_used_blocks == 2
    pool.take(owner=3)
    assert pool.peak_used_blocks == 3 and pool.num_free_blocks == 0


def test_an_evicted_block_loses_its_identity():
    pool = BlockPool(1)
    blk = pool.take(owner=0)
    pool.cache_block(blk.block_id, 11, (5, 6))
    pool.release(blk.block_id, 0)
    again = pool.take(owner=1)
    assert again.block_hash is None and again.token_ids is None and pool.get_cached_block(11, (5, 6)) is None
    pool.cache_block(again.block_id, 12, (7, 8))  # rewritten with new content: found under its new hash only
    assert pool.get_cached_block(12, (7, 8)) == again.block_id and pool.get_cached_block(11, (5, 6)) is None


@pytest.mark.parametrize("corrupt, message", [
    (lambda pool: pool._free.pop(2), "free + referenced != total"),
    (lambda pool: setattr(pool.blocks[2], "ref_count", -1), "block 2 ref_count -1 < 0"),
    (lambda pool: pool.blocks[1].owners.add(9), "block 1 ref_count != owners"),
    (lambda pool: pool._free.__setitem__(1, None) or pool._free.pop(2), "block 1 free/referenced"),
    (lambda pool: pool._cached.__setitem__(99, 0), "cache entry 99 -> block 0 is stale"),
])  # fmt: skip
def test_check_invariants_names_what_is_broken(corrupt, message):
    pool = BlockPool(3)
    pool.take(owner=0)
    pool.take(owner=0)
    pool.check_invariants()
    corrupt(pool)
    with pytest.raises(AssertionError) as e:
        pool.check_invariants()
    assert str(e.value) == message


def test_longest_cache_hit_with_a_partial_last_block():
    pool = BlockPool(2)
    tokens = list(range(10))  # two full blocks of 4 and 2 tokens over
    parent = None
    for i in range(2):
        blk = pool.take(owner=i)
        parent = hash_block_tokens(parent, tuple(tokens[4 * i : 4 * i + 4]))
        pool.cache_block(blk.block_id, parent, tuple(tokens[4 * i : 4 * i + 4]))
    assert find_longest_cache_hit(pool, tokens, 4, max_blocks=5) == ([0, 1], 2)
    assert find_longest_cache_hit(pool, tokens, 4, max_blocks=0) == ([], 0)


def test_block_hashes_are_content_hashes_the_same_in_every_process():
    """The chained hash is SHA-256 based, not Python's per-process ``hash``: another interpreter (another
    hash seed) computes the same values; the root keys (KV-cache dtype, block size) change every hash."""
    import subprocess
    import sys

    code = (
        "from rawpaged.core.prefix_cache import hash_block_tokens as h, root_hash as r; "
        "print(h(h(r('int8', 16), (1, 2)), (3,)))"
    )
    here = hash_block_tokens(hash_block_tokens(root_hash("int8", 16), (1, 2)), (3,))
    for seed in ("1", "2"):
        out = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=True, env={"PYTHONHASHSEED": seed}
        )
        assert int(out.stdout) == here
    assert len({root_hash("int8", 16), root_hash("float32", 16), root_hash("int8", 32), root_hash()}) == 4
    assert hash_block_tokens(root_hash("int8", 16), (1, 2)) != hash_block_tokens(root_hash("float32", 16), (1, 2))
    assert 0 <= here < 2**64
