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
    owner = r.choose(prompt(1))
    other = 1 - owner
    assert r.choose(prompt(2)) == other  # a new prefix goes to the least loaded
    # prefix 1 stays on its owner until the owner has 2 more in flight than the other replica
    assert [r.choose(prompt(1, tail=i)) for i in range(3)] == [owner] * 3
    assert r.load[owner] == 4 and r.load[other] == 1 and r.stats.prefix_hits == 3
    assert r.choose(prompt(1, tail=9)) == other  # 4 > 1 + 2: spill over
    assert r.stats.spills == 1 and r.load[other] == 2
    assert r.choose(prompt(1, tail=10)) == owner  # the owner stays: 4 <= 2 + 2
    for replica in [owner] * 5 + [other] * 2:
        r.finished(replica)
    assert r.load == [0, 0]
    r.finished(0)
    assert r.load == [0, 0], "never below zero"


def test_prompts_without_a_full_block_go_to_the_least_loaded_in_turn():
    r = Router(3, BLOCK)
    first = [r.choose([5, 6, 7]) for _ in range(3)]
    assert sorted(first) == [0, 1, 2] and r.load == [1, 1, 1]
    for i in range(3):
        r.finished(i)
    idle = [r.choose([5, 6, 7]) for _ in range(3)]
    assert sorted(idle) == [0, 1, 2]
    for i in range(3):
        r.finished(i)
    sequential = []
    for _ in range(6):  # one at a time on an idle cluster: still every replica in turn
        sequential.append(r.choose([5, 6, 7]))
        r.finished(sequential[-1])
    assert sorted(sequential) == [0, 0, 1, 1, 2, 2]
    assert r.stats.least_loaded == 12 and r.stats.prefix_hits == 0


def test_new_prefixes_on_an_idle_cluster_spread_over_the_replicas():
    r = Router(2, BLOCK)
    owners = []
    for p in range(40):
        owners.append(r.choose(prompt(p)))
        r.finished(owners[-1])
    assert 10 <= owners.count(0) <= 30, owners


def test_replicas_not_ready_get_nothing_and_a_dead_owner_is_replaced():
    r = Router(2, BLOCK)
    owner = r.choose(prompt(3))
    r.finished(owner)
    r.set_ready(owner, False)
    assert r.choose(prompt(3)) == 1 - owner  # the owner is down: the prefix moves
    r.finished(1 - owner)
    r.set_ready(owner, True)
    assert r.choose(prompt(3)) == 1 - owner  # and stays on its new owner
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
