"""KV cache groups without a model: how layers are grouped, the per-group block tables, the sliding group's
freeing and its prefix-hit rule (every group must serve a hit; a sliding group only the blocks of the last
W - 1 tokens before it), forks and frees per group, and the pool's invariants throughout."""

import pytest

from rawpaged.core.block_table import NULL_BLOCK
from rawpaged.core.kv_cache_groups import KVCacheGroupSpec, group_layers, group_size, layer_slots
from rawpaged.core.kv_cache_manager import KVCacheManager
from rawpaged.core.sequence import Sequence
from rawpaged.engine.input_processor import InputProcessor
from rawpaged.errors import InvalidRequestError
from rawpaged.sampling_params import SamplingParams

W, BS = 8, 4
#: 2 full layers then 2 sliding ones (the hybrid Qwen2 of tests/model_reference.py)
HYBRID = group_layers([None, None, W, W])


def seq(tokens, seq_id=0) -> Sequence:
    return Sequence(seq_id, f"r{seq_id}", 0, list(tokens), SamplingParams(), None, 0.0)


def manager(num_blocks=64, groups=HYBRID, caching=True) -> KVCacheManager:
    return KVCacheManager(num_blocks, BS, enable_prefix_caching=caching, groups=groups)


def test_gemma3_layers_make_six_groups_of_three():
    """Gemma 3's 18 layers, every 6th global (W = 512): 1 full group and 5 sliding ones, 3 layers each (as
    vLLM groups them); hybrid off: one full-attention group of every layer; one kind: one group."""
    windows = [None if i % 6 == 5 else 512 for i in range(18)]
    groups = group_layers(windows)
    assert [g.layer_ids for g in groups] == [
        (0, 1, 2),
        (3, 4, 6),
        (5, 11, 17),
        (7, 8, 9),
        (10, 12, 13),
        (14, 15, 16),
    ]
    assert [g.sliding_window for g in groups] == [512, 512, None, 512, 512, 512] and group_size(groups) == 3
    assert layer_slots(groups, 18)[11] == (2, 1) and layer_slots(groups, 18)[6] == (1, 2)
    assert group_layers(windows, hybrid=False) == (KVCacheGroupSpec(tuple(range(18)), None),)
    assert group_layers([12] * 4) == (KVCacheGroupSpec((0, 1, 2, 3), 12),)  # Mistral: one sliding group
    assert HYBRID == (KVCacheGroupSpec((0, 1), None), KVCacheGroupSpec((2, 3), W))
    with pytest.raises(ValueError, match="two KV cache groups"):
        layer_slots((KVCacheGroupSpec((0, 1)), KVCacheGroupSpec((1,))), 2)


def _run(kv, s, chunk=4) -> list:
    """Prefill ``s`` in chunks, marking them computed and caching its full blocks, as the scheduler does.
    Returns each group's block of each logical block, as it was before the window released it."""
    ids = [[] for _ in kv.groups]
    while s.num_computed_tokens < s.num_tokens:
        n = min(chunk, s.num_tokens - s.num_computed_tokens)
        assert kv.allocate_slots(s, n)
        for g, t in zip(ids, s.block_tables):
            g.extend(t.block_ids[len(g) :])
        s.num_computed_tokens += n
        kv.cache_full_blocks(s)
    return ids


def test_a_sliding_group_holds_at_most_its_window_and_the_full_group_everything():
    kv = manager()
    s = seq(range(40))
    most = 0
    while s.num_computed_tokens < s.num_tokens:
        assert kv.allocate_slots(s, 1)
        s.num_computed_tokens += 1
        full, sliding = kv.group_blocks(s)
        assert len(full) == -(-s.num_computed_tokens // BS)
        most = max(most, len(sliding))
        kv.check_invariants([s])
    assert most <= -(-W // BS) + 1 and kv.num_window_frees > 0
    assert s.block_tables[1].block_ids[:5] == [NULL_BLOCK] * 5
    kv.free(s)
    kv.check_invariants([s])
    assert kv.block_pool.num_free_blocks == kv.num_blocks


def test_a_prefix_hit_needs_the_full_groups_blocks_and_the_sliding_groups_window_only():
    """After a 24-token prompt ran and finished, a prompt with the same 24 tokens hits 5 blocks (the last
    token is never taken): the full group shares all 5, the sliding group only blocks 3 and 4 (the last
    W - 1 = 7 tokens before position 20), even after its earlier blocks were evicted."""
    kv = manager(num_blocks=14)
    a = seq(range(24))
    a_sliding = _run(kv, a)[1]
    kv.free(a)
    # The sliding group's blocks 0-2 went back while `a` ran, before its free: evicted before the others.
    evicted = kv.block_pool._free.copy()
    filler = seq(range(100, 108), seq_id=1)
    assert kv.allocate_slots(filler, 8)  # 2 blocks per group: 2 never used, then sliding blocks 0 and 1
    assert list(evicted)[2:4] == [a_sliding[0], a_sliding[1]]
    b = seq(range(24), seq_id=2)
    hit = kv.get_computed_blocks(b)
    full, sliding = hit.groups
    assert len(hit) == 5 and NULL_BLOCK not in full
    assert sliding[:3] == [NULL_BLOCK] * 3 and NULL_BLOCK not in sliding[3:]
    assert kv.allocate_slots(b, 4, hit)
    assert kv.group_blocks(b)[0][:5] == full and b.block_tables[1].block_ids[3:5] == sliding[3:]
    kv.check_invariants([filler, b])


def test_a_prefix_hit_counts_only_where_every_group_serves_it():
    """A full group's missing block cuts the hit there; a sliding group's missing block inside the window
    cuts it to the longest length whose window is whole."""
    kv = manager()
    a = seq(range(24))
    full_ids, _ = _run(kv, a)
    kv.free(a)
    pool = kv.block_pool
    pool._cached.pop(pool.blocks[full_ids[2]].block_hash)  # the full group loses block 2: 2 blocks at most
    assert len(kv.get_computed_blocks(seq(range(24), seq_id=1))) == 2

    kv = manager()
    a = seq(range(24))
    _, sliding_ids = _run(kv, a)
    kv.free(a)
    kv.block_pool._cached.pop(kv.block_pool.blocks[sliding_ids[4]].block_hash)  # inside a 5-block hit's window
    hit = kv.get_computed_blocks(seq(range(24), seq_id=1))
    # 4 blocks: the window before position 16 is positions 9..15, blocks 2 and 3, both still cached
    assert len(hit) == 4 and hit.groups[1][2:] == sliding_ids[2:4] and hit.groups[1][:2] == [NULL_BLOCK] * 2


def test_fork_copy_on_write_and_free_apply_to_every_group():
    kv = manager()
    parent, child = seq(range(6)), seq(range(6), seq_id=1)
    _run(kv, parent, chunk=6)
    kv.fork(parent, child)
    assert [t.block_ids for t in child.block_tables] == [t.block_ids for t in parent.block_tables]
    assert kv.allocate_slots(child, 1)  # the shared half-full last block is copied in each group
    copies = kv.take_block_copies()
    assert len(copies) == 2 and {src for src, _ in copies} == {t.block_ids[1] for t in parent.block_tables}
    kv.check_invariants([parent, child])
    kv.free(parent)
    kv.free(child)
    kv.check_invariants([parent, child])
    assert kv.block_pool.num_free_blocks == kv.num_blocks and all(b.ref_count == 0 for b in kv.block_pool.blocks)


def test_out_of_blocks_in_any_group_changes_nothing():
    kv = manager(num_blocks=5)
    s = seq(range(12))
    assert not kv.allocate_slots(s, 12)  # 3 blocks per group: 6 > 5
    assert s.block_tables is None and kv.block_pool.num_free_blocks == 5
    assert kv.allocate_slots(s, 8)
    assert not kv.allocate_slots(s, 4)
    assert [t.num_tokens for t in s.block_tables] == [8, 8]
    kv.check_invariants([s])


def test_the_input_processor_counts_every_groups_blocks():
    """A 64-token request of block size 4: 16 blocks in a full group, 2 + 1 + 1 in a window-8 group (one
    step of at most 4 tokens): it fits 20 blocks, not 19."""

    class Tok:
        def encode(self, text):
            return []

    def processor(num_blocks):
        return InputProcessor(Tok(), 300, 128, BS, num_blocks, max_num_batched_tokens=4, group_windows=(None, W))

    params = SamplingParams(max_tokens=32)
    processor(20).process({"prompt_token_ids": list(range(32))}, params)
    with pytest.raises(InvalidRequestError, match="20 KV blocks"):
        processor(19).process({"prompt_token_ids": list(range(32))}, params)


def _scheduler(num_blocks, **kw):
    from rawpaged.core.scheduler import Scheduler

    return Scheduler(manager(num_blocks, caching=kw.pop("caching", False)), 8, 64, 128, **kw)


def _step(sched, token=7):
    out = sched.schedule()
    sampled = [(s, token) for s, n in out.scheduled if s.num_computed_tokens + n == s.num_tokens]
    sched.update_from_output(out, sampled)
    return out


def test_the_scheduler_preempts_by_recompute_across_groups_and_returns_every_block():
    """Two sequences of 8 + 16 tokens outgrow a pool of 14 blocks (6 full blocks each, their sliding groups 3):
    the newest is preempted, its blocks in both groups freed, and it comes back; all blocks return."""
    sched = _scheduler(14)
    a = seq(range(8), seq_id=0)
    b = seq(range(100, 108), seq_id=1)
    a.sampling_params = b.sampling_params = SamplingParams(max_tokens=16, ignore_eos=True)
    sched.add(a)
    sched.add(b)
    preempted = 0
    while sched.num_unfinished:
        out = _step(sched)
        preempted += len(out.preempted)
        sched.kv_cache_manager.check_invariants(sched.running)
        for s, n in out.scheduled:
            if n == 1 and s.block_tables is not None:  # a decode step: the window's blocks only
                assert len(sched.kv_cache_manager.group_blocks(s)[1]) <= -(-W // BS) + 1
    assert preempted > 0 and len(a.output_token_ids) == len(b.output_token_ids) == 16
    kv = sched.kv_cache_manager
    kv.check_invariants([a, b])
    assert kv.block_pool.num_free_blocks == kv.num_blocks


def test_the_kv_view_shows_each_groups_tables_and_blocks():
    from rawpaged.core.kv_cache_snapshot import capture, to_json

    sched = _scheduler(32)
    a = seq(range(20))
    sched.add(a)
    for _ in range(4):
        _step(sched)
    snap = to_json(capture(sched))
    (entry,) = snap["requests"][0]["sequences"]
    assert entry["block_tables"] == [t.block_ids for t in a.block_tables]
    assert entry["block_table"] == a.block_tables[0].block_ids and NULL_BLOCK in entry["block_tables"][1]
    groups = snap["kv_cache_groups"]
    assert [(g["kind"], g["layer_ids"], g["sliding_window"]) for g in groups] == [
        ("full_attention", [0, 1], None),
        ("sliding_window_8", [2, 3], W),
    ]
    full, sliding = sched.kv_cache_manager.group_blocks(a)
    assert [g["num_used_blocks"] for g in groups] == [len(full), len(sliding)] and groups[1]["num_window_frees"] > 0
    by_id = {b["block_id"]: b["group"] for b in snap["blocks"]}
    assert {by_id[b] for b in full} == {0} and {by_id[b] for b in sliding} == {1}


def test_swap_out_and_in_keeps_every_groups_table_and_the_tier_serves_each_groups_prefix():
    """A forked pair swapped out and back: each group's table comes back with the same layout (``NULL_BLOCK``
    entries where the window released a block, shared blocks shared again), each distinct block through one
    swap slot. Then an evicted prefix comes back from the tier into both groups' blocks."""
    from rawpaged.core.kv_offload import OffloadingManager
    from rawpaged.core.kv_tier import KVTier

    kv = manager(num_blocks=24)
    tier = KVTier(kv, OffloadingManager(32))
    a, b = seq(range(18)), seq(range(18), seq_id=1)
    _run(kv, a, chunk=6)
    kv.fork(a, b)
    b.num_computed_tokens = a.num_computed_tokens
    layout = [[b != NULL_BLOCK for b in t.block_ids] for t in a.block_tables]
    distinct = {x for blocks in kv.group_blocks(a) for x in blocks}
    assert tier.swap_out([a, b]) and kv.block_pool.num_free_blocks == kv.num_blocks
    assert len(tier.take_transfers().stores) == len(distinct)
    tier.end_transfers()
    assert tier.swap_in([a, b])
    loads = tier.take_transfers().loads
    tier.end_transfers()
    assert len(loads) == len(distinct)
    assert [[b != NULL_BLOCK for b in t.block_ids] for t in a.block_tables] == layout
    assert [t.block_ids for t in a.block_tables] == [t.block_ids for t in b.block_tables]
    kv.check_invariants([a, b])
    kv.free(a)
    kv.free(b)
    # every pool block reused: the prefix lives only in the tier now
    filler = seq(range(500, 548), seq_id=2)
    assert kv.allocate_slots(filler, 48)
    tier.end_transfers()
    kv.free(filler)
    c = seq(range(18), seq_id=3)
    hit = kv.get_computed_blocks(c)
    offloaded = tier.get_offloaded_blocks(c, len(hit))
    assert len(hit) + len(offloaded) == 4 and all(len(slots) == 2 for _, _, slots in offloaded)
    assert tier.allocate_slots(c, 18 - 4 * BS, hit, offloaded)
    loaded = {bid for _, bid in tier.take_transfers().loads}
    assert loaded == {x for t in c.block_tables for x in t.block_ids[len(hit) : 4] if x != NULL_BLOCK}
    kv.check_invariants([c])
