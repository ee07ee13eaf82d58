"""The data-parallel router's policy without Ray: prefix affinity while load allows, spill-over, least
loaded otherwise, replicas taken out and back, and the in-flight counts back to zero."""

import pytest

from rawpaged.engine.router import Router, prefix_key

BLOCK = 16


def prompt(prefix: int, length: int = 80, tail: int = 0) -> list:
    return [prefix] * (length - 1) + [1000 + tail]


def test_prefix_key_covers_whole_blocks_only():
    assert prefix_key(list(range(15)), BLOCK, 4) is None
    a = list(range(200))
    assert prefix_key(a, BLOCK, 4) == prefix_key(a[:64] + [7] * 50, BLOCK, 4)  # only the first 4 blocks count
    assert prefix_key(a, BLOCK, 4) != prefix_key(a[:63] + [7] * 50, BLOCK, 4)
    assert prefix_key(a[:20], BLOCK, 4) == prefix_key(a[:16] + [9] * 4, BLOCK, 4)  # 1 full block
    assert prefix_key(a[:20], BLOCK, 4) != prefix_key(a[:32], BLOCK, 4)  # 1 block vs 2


def test_shared_prefixes_stick_to_one_replica_while_load_allows():
    r = Router(2, BLOCK, prefix_blocks=4, imbalance_tolerance=2)
    first = r.choose(prompt(1))
    assert first == 0  # least loaded, lowest index
    other = r.choose(prompt(2))
    assert other == 1  # a new prefix goes to the least loaded
    # prefix 1 stays on replica 0 until it has 2 more in flight than replica 1
    assert [r.choose(prompt(1, tail=i)) for i in range(3)] == [0, 0, 0]
    assert r.load == [4, 1] and r.stats.prefix_hits == 3
    assert r.choose(prompt(1, tail=9)) == 1  # 4 > 1 + 2: spill over
    assert r.stats.spills == 1 and r.load == [4, 2]
    assert r.choose(prompt(1, tail=10)) == 0  # the owner stays replica 0: 4 <= 2 + 2
    for replica in (0, 0, 0, 0, 0, 1, 1):
        r.finished(replica)
    assert r.load == [0, 0]
    r.finished(0)
    assert r.load == [0, 0], "never below zero"


def test_prompts_without_a_full_block_go_to_the_least_loaded():
    r = Router(3, BLOCK)
    assert [r.choose([5, 6, 7]) for _ in range(6)] == [0, 1, 2, 0, 1, 2]
    assert r.stats.least_loaded == 6 and r.stats.prefix_hits == 0


def test_replicas_not_ready_get_nothing_and_a_dead_owner_is_replaced():
    r = Router(2, BLOCK)
    assert r.choose(prompt(3)) == 0
    r.finished(0)
    r.set_ready(0, False)
    assert r.choose(prompt(3)) == 1  # the owner is down: the prefix moves
    r.set_ready(0, True)
    r.finished(1)
    assert r.choose(prompt(3)) == 1  # and stays on its new owner
    r.set_ready(0, False)
    r.set_ready(1, False)
    with pytest.raises(RuntimeError, match="no replica is ready"):
        r.choose(prompt(3))


def test_the_owner_table_is_bounded():
    r = Router(2, BLOCK, max_prefixes=3)
    for p in range(10):
        r.choose(prompt(p))
    assert len(r._owners) == 3
    with pytest.raises(ValueError):
        Router(0)
