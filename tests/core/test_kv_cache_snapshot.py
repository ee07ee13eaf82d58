"""The KV cache view's data, without a model: block events (fork, copy-on-write, preemption) as the
scheduler and the manager make them, snapshots checked against the block tables they are built from,
block ranges, the event ring, and the deltas a subscriber receives."""

import pytest

from rawpaged.core.kv_cache_snapshot import (
    MAX_SNAPSHOT_BLOCKS,
    KVCacheSnapshotDiffer,
    capture,
    check_range,
    to_json,
)
from rawpaged.core.kv_events import KVCacheEventLog
from rawpaged.sampling_params import SamplingParams
from tests.core.test_scheduler import make, run_step, seq


def snapshot(sched, **kw):
    return to_json(capture(sched, **kw))


def check_against_tables(snap, seqs, num_blocks):
    """Every block's ref_count and owners as recomputed from the sequences' own tables."""
    expected_refs = [0] * num_blocks
    expected_owners = [set() for _ in range(num_blocks)]
    for s in seqs:
        for bid in s.block_table.block_ids if s.block_table else []:
            expected_refs[bid] += 1
            expected_owners[bid].add(s.request_id)
    assert [b["block_id"] for b in snap["blocks"]] == list(range(num_blocks))
    assert [b["ref_count"] for b in snap["blocks"]] == expected_refs
    assert [set(b["owners"]) for b in snap["blocks"]] == expected_owners
    assert all(len(b["owners"]) == len(set(b["owners"])) for b in snap["blocks"])
    assert snap["num_free_blocks"] == expected_refs.count(0)
    tables = {(r["request_id"], q["index"]): q["block_table"] for r in snap["requests"] for q in r["sequences"]}
    assert tables == {(s.request_id, s.index): (s.block_table.block_ids if s.block_table else []) for s in seqs}


def test_fork_then_copy_on_write_events_and_shared_blocks():
    sched = make(num_blocks=8, block_size=4)
    parent = seq(0, 6, SamplingParams(n=2, temperature=1.0, max_tokens=8))
    sched.add(parent)
    run_step(sched)  # prefill: 6 tokens in blocks 0-1 (block 1 half full), one token sampled
    child = parent.fork(1, 1, None)
    sched.fork(parent, child)
    snap = snapshot(sched)
    check_against_tables(snap, [parent, child], 8)
    assert [b["ref_count"] for b in snap["blocks"][:2]] == [2, 2] and snap["blocks"][0]["owners"] == ["r0"]
    (fork,) = snap["events"]
    assert fork == {"event_id": 0, "type": "fork", "request_id": "r0", "index": 1, "parent_index": 0, "num_blocks": 2}
    run_step(sched)  # both write position 6 into the shared, half-full block 1: the first writer copies it
    snap = snapshot(sched, since_event=snap["next_event_id"])
    check_against_tables(snap, [parent, child], 8)
    (copy,) = snap["events"]
    assert copy["type"] == "copy" and copy["src"] == 1 and copy["request_id"] == "r0"
    assert parent.block_table.block_ids == [0, copy["dst"]] and child.block_table.block_ids == [0, 1]
    assert [b["ref_count"] for b in snap["blocks"][:2]] == [2, 1]
    assert snap["events_missed"] == 0 and snap["next_event_id"] == 2


def test_preemption_event_names_the_blocks_released():
    sched = make(num_blocks=4, block_size=4, max_num_batched_tokens=64)
    a, b = seq(0, 7, SamplingParams(max_tokens=20, ignore_eos=True)), seq(1, 7, SamplingParams(max_tokens=20))
    sched.add(a)
    sched.add(b)
    run_step(sched)  # both prefilled: 2 blocks each, the pool is full
    held = list(b.block_table.block_ids)
    run_step(sched)  # position 7 still fits in each one's second block
    assert snapshot(sched, since_event=0)["events"] == []
    run_step(sched)  # a's position 8 needs a third block: b (newest) is preempted
    snap = snapshot(sched, since_event=0)
    (event,) = snap["events"]
    assert event == {"event_id": 0, "type": "preempt", "request_id": "r1", "index": 0, "block_ids": held}
    check_against_tables(snap, [a, b], 4)
    waiting = [q for r in snap["requests"] for q in r["sequences"] if q["status"] == "waiting"]
    assert waiting == [
        {
            "index": 0,
            "seq_id": 1,
            "status": "waiting",
            "num_tokens": 9,
            "num_computed_tokens": 0,
            "block_table": [],
            "block_tables": [[]],
        }
    ]


def test_finished_blocks_are_free_and_stay_cached():
    sched = make(num_blocks=8, block_size=4, prefix_caching=True)
    s = seq(0, 9, SamplingParams(max_tokens=1))
    sched.add(s)
    run_step(sched)
    assert s.is_finished
    snap = snapshot(sched)
    check_against_tables(snap, [], 8)
    assert [b["cached"] for b in snap["blocks"][:3]] == [True, True, False]  # two full blocks hashed
    assert snap["requests"] == [] and snap["num_free_blocks"] == 8


def test_block_ranges():
    sched = make(num_blocks=8, block_size=4)
    s = seq(0, 14)
    sched.add(s)
    run_step(sched)  # blocks 0-3
    snap = snapshot(sched, start=2, count=3)
    assert (snap["start"], snap["count"]) == (2, 3)
    assert [(b["block_id"], b["ref_count"], b["owners"]) for b in snap["blocks"]] == [
        (2, 1, ["r0"]),
        (3, 1, ["r0"]),
        (4, 0, []),
    ]
    assert snap["requests"][0]["sequences"][0]["block_table"] == [0, 1, 2, 3]  # tables stay whole
    assert check_range(8, 6, 100) == (6, 8) and check_range(8, 7, 1) == (7, 8)
    assert check_range(10**6) == (0, MAX_SNAPSHOT_BLOCKS)
    for start, count, since, field in (
        (8, None, None, "start"),
        (-1, None, None, "start"),
        (0, 0, None, "count"),
        (0, None, -1, "since_event"),
    ):
        with pytest.raises(ValueError, match=f"^{field} "):
            check_range(8, start, count, since)


def test_event_ring_reports_what_it_dropped():
    log = KVCacheEventLog(capacity=3)
    s = seq(0, 4)
    for i in range(5):
        log.record("copy", s, src=i, dst=i + 10)
    events, missed = log.since(0)
    assert [e["src"] for e in events] == [2, 3, 4] and missed == 2
    assert [e["event_id"] for e in events] == [2, 3, 4]
    assert log.since(4) == ([events[-1]], 0)
    assert log.since(1)[1] == 1
    assert log.since(5) == ([], 0)
    with pytest.raises(ValueError, match="capacity"):
        KVCacheEventLog(0)
    one = KVCacheEventLog(capacity=1)
    one.record("copy", s, src=1, dst=2)
    one.record("copy", s, src=3, dst=4)
    assert [e["src"] for e in one.since(0)[0]] == [3] and one.since(0)[1] == 1


def test_snapshot_counters_and_the_default_recent_events():
    from rawpaged.core.kv_cache_snapshot import DEFAULT_RECENT_EVENTS

    sched = make(num_blocks=8, block_size=4)
    s = seq(0, 5)
    sched.add(s)
    run_step(sched)
    for i in range(DEFAULT_RECENT_EVENTS + 6):
        sched.kv_cache_manager.events.record("copy", s, src=i, dst=i)
    snap = snapshot(sched)
    assert (snap["block_size"], snap["num_blocks"], snap["step"]) == (4, 8, 1)
    assert [e["src"] for e in snap["events"]] == list(range(6, DEFAULT_RECENT_EVENTS + 6))  # the last 64
    assert snap["events_missed"] == 0 and snap["next_event_id"] == DEFAULT_RECENT_EVENTS + 6
    with pytest.raises(ValueError, match="^since_event "):
        capture(sched, since_event=-1)


def test_differ_sends_a_snapshot_then_only_what_changed():
    sched = make(num_blocks=8, block_size=4)
    differ = KVCacheSnapshotDiffer()
    kind, first = differ.update(snapshot(sched))
    assert kind == "snapshot" and len(first["blocks"]) == 8
    assert differ.update(snapshot(sched)) == ("delta", None)  # nothing changed: nothing to send
    s = seq(0, 5)
    sched.add(s)
    run_step(sched)
    snap = snapshot(sched)
    kind, delta = differ.update(snap)
    assert kind == "delta" and [b["block_id"] for b in delta["blocks"]] == [0, 1]
    assert delta["requests"] == snap["requests"] and delta["num_free_blocks"] == 6
    run_step(sched)  # a decode inside block 1: tokens change, blocks do not
    kind, delta = differ.update(snapshot(sched))
    assert delta["blocks"] == [] and delta["requests"][0]["sequences"][0]["num_tokens"] == 7
    kind, again = differ.update(snapshot(sched, start=4))  # another range: whole again
    assert kind == "snapshot" and again["start"] == 4
