"""The KV-memory study's accounting on hand-computed traces (benchmarks/memsim.py), so the study cannot
silently measure the wrong thing; plus the ReservationAdmission baseline in the scheduler's admission hook."""

import json

import pytest

from benchmarks.baselines import ReservationAdmission
from benchmarks.memsim import ExtentAdmission, Layout, TraceRequest, load_trace, simulate, synthetic_trace
from rawpaged.core.kv_cache_manager import KVCacheManager
from rawpaged.core.scheduler import Scheduler
from rawpaged.core.sequence import Sequence
from rawpaged.sampling_params import SamplingParams

PAGED4 = Layout("paged-4", "paged", block_size=4)
ORACLE = Layout("contig-oracle", "contiguous", reserve="oracle")


def test_paged_two_requests_block_size_4_exact_per_step():
    # A: 5 prompt + 3 output -> KV for 7 positions; B: 2 + 2 -> 3 positions. Pool 8 blocks of 4.
    # step 0: A 5 tok (2 blocks), B 2 tok (1 block): R 12, U 7; slack A 3 (2 written later, 1 never), B 2 (1, 1)
    # step 1: A 6, B 3: R 12, U 9; A slack 2 (1 later, 1 never), B 1 (never). B finishes.
    # step 2: A 7: R 8, U 7, 1 never. A finishes.
    trace = [TraceRequest(5, [3]), TraceRequest(2, [2])]
    r = simulate(trace, PAGED4, num_slots=32, max_model_len=16, check_invariants=True)
    s = r.series
    assert s["reserved"] == [12, 12, 8]
    assert s["used"] == [7, 9, 7]
    assert s["internal_future"] == [3, 1, 0]
    assert s["internal_never"] == [2, 2, 1]
    assert s["external"] == [0, 0, 0]
    assert s["running_seqs"] == [2, 2, 1]
    assert r.steps == 3 and r.output_tokens == 5 and r.num_preemptions == 0
    assert r.utilization == pytest.approx(23 / 32)
    assert r.peak_running_requests == 2
    assert r.summary()["requests_per_1k_steps"] == pytest.approx(2000 / 3)
    # Floor: (block_size-1)/2 = 1.5 slots per running sequence: 5 sequence-steps * 1.5 / 32 reserved.
    assert r.paged_floor == pytest.approx(5 * 1.5 / 32)
    assert r.mean_latency_steps == pytest.approx((3 + 2) / 2)


def test_contiguous_oracle_same_trace_reserves_whole_footprint():
    trace = [TraceRequest(5, [3]), TraceRequest(2, [2])]
    r = simulate(trace, ORACLE, num_slots=32, max_model_len=16, check_invariants=True)
    # Extents 8 and 4 for the whole run; B leaves after step 1.
    assert r.series["reserved"] == [12, 12, 8]
    assert r.series["used"] == [7, 9, 7]
    assert r.series["internal_future"] == [3, 1, 0]
    assert r.series["internal_never"] == [2, 2, 1]  # the last sampled token's slot is never written
    maxlen = simulate(trace, Layout("m", "contiguous", reserve="max_model_len"), 32, max_model_len=16)
    assert maxlen.series["reserved"] == [32, 32, 16]
    assert maxlen.series["internal_never"] == [(16 - 7) + (16 - 3)] * 2 + [16 - 7]
    over = simulate(trace, Layout("2x", "contiguous", reserve="overestimate", factor=2.0), 32, max_model_len=16)
    assert over.series["reserved"] == [(5 + 6) + (2 + 4)] * 2 + [11]


def test_contiguous_external_fragmentation_blocks_admission():
    # Pool 10 slots, first fit. A [0,3) leaves after step 0, B [3,6) and C [6,9) after step 1, [9,10) free.
    # At step 1 D (reserve 2+2 = 4) finds 4 free slots in two holes (3 + 1): refused -> external 4 slots.
    trace = [TraceRequest(2, [1]), TraceRequest(1, [2]), TraceRequest(1, [2]), TraceRequest(2, [2])]
    r = simulate(trace, ORACLE, num_slots=10, max_model_len=10, check_invariants=True)
    s = r.series
    assert s["reserved"] == [9, 6, 4, 4]
    assert s["used"] == [4, 4, 2, 3]
    assert s["external"] == [0, 4, 0, 0]  # step 0: only 1 slot free, memory is simply full
    assert s["waiting"] == [1, 1, 0, 0]
    assert r.ext_blocked_steps == 1 and r.sum_external == 4
    assert r.steps == 4
    # Paged over the same 10 slots (block_size 1) admits D at once: no external fragmentation.
    p = simulate(trace, Layout("p1", "paged", block_size=1), num_slots=10, max_model_len=10, check_invariants=True)
    assert p.series["running_seqs"][0] == 4 and p.sum_external == 0 and p.steps == 2


def test_extent_admission_first_fit_and_coalescing():
    sizes = {}
    pol = ExtentAdmission(10, lambda s: sizes[s.seq_id])

    class S:
        def __init__(self, i, n):
            self.seq_id = i
            sizes[i] = n

    a, b, c = S(0, 3), S(1, 3), S(2, 3)
    for s in (a, b, c):
        assert pol.can_admit(s)
        pol.admitted(s)
    assert pol.extents == {0: (0, 3), 1: (3, 3), 2: (6, 3)} and pol.free_slots == 1
    pol.released(a)
    pol.released(c)
    assert pol.free_extents() == [(0, 3), (6, 4)]
    d = S(3, 4)
    assert pol.can_admit(d)
    pol.admitted(d)
    assert pol.extents[3] == (6, 4)
    assert not pol.can_admit(S(4, 4)) and pol.free_slots == 3
    pol.released(b)
    pol.check()
    assert pol.free_extents() == [(0, 6)]


def test_fork_shares_prompt_blocks_and_counts_physical_slots():
    # One request, 4-token prompt (exactly one block), n=2 samples of 2 tokens, block_size 4.
    trace = [TraceRequest(4, [2, 2])]
    share = simulate(trace, Layout("s", "paged", block_size=4, sharing=True), 32, 16, check_invariants=True)
    # step 0: prompt block (fork happens after the step's measurement). step 1: shared block + 1 new each.
    assert share.series["reserved"] == [4, 12]
    assert share.series["used"] == [4, 6]
    assert share.sum_logical == 4 + 10
    assert share.series["running_seqs"] == [1, 2] and share.steps == 2
    plain = simulate(trace, PAGED4, 32, 16, check_invariants=True)
    assert plain.series["reserved"] == [8, 16]
    assert plain.series["used"] == [8, 10] and plain.sum_logical == plain.sum_used


def test_fork_copy_on_write_of_partly_filled_block():
    # Prompt 5 = one full block + 1 token; after the fork the partly filled block is shared, the
    # parent's first decode copies it (COW), the child then owns the original alone.
    trace = [TraceRequest(5, [2, 2])]
    r = simulate(trace, Layout("s", "paged", block_size=4, sharing=True), 32, 16, check_invariants=True)
    assert r.series["reserved"] == [8, 12]
    assert r.series["used"] == [5, 4 + 2 + 2]


def test_shared_system_prompt_hits_prefix_cache():
    # Two requests sharing an 8-token system prompt (2 blocks of 4); token budget 9 so the second is
    # admitted one step later, after the first's prompt blocks are cached.
    trace = [TraceRequest(9, [3], shared_prefix_len=8), TraceRequest(9, [3], shared_prefix_len=8)]
    lay = Layout("s", "paged", block_size=4, sharing=True)
    r = simulate(trace, lay, 64, 32, max_num_batched_tokens=9, check_invariants=True)
    # step 0: A 9 tokens = 3 blocks. step 1: A 10 tok (3 blocks), B attaches 2 cached blocks + 1 new.
    assert r.series["reserved"][:2] == [12, 16]
    assert r.series["used"][:2] == [9, 10 + 1]
    nosh = simulate(trace, PAGED4, 64, 32, max_num_batched_tokens=9, check_invariants=True)
    # Without sharing B's prompt is computed again, chunked to the 8 tokens left in the budget.
    assert nosh.series["reserved"][:2] == [12, 20]


def test_preemption_under_paged_keeps_accounting_consistent():
    trace = synthetic_trace(
        "alpaca", 24, seed=3, max_model_len=256, n=2, shared_prefix_len=16, shared_fraction=0.5, arrival_rate=2.0
    )
    for lay in (
        PAGED4,
        Layout("s", "paged", block_size=4, sharing=True),
        ORACLE,
        Layout("m", "contiguous", reserve="max_model_len"),
    ):
        r = simulate(trace, lay, 384, 256, check_invariants=True)
        assert r.output_tokens >= sum(sum(t.output_lens) for t in trace)
        assert r.sum_reserved - r.sum_used == r.sum_internal_future + r.sum_internal_never
        assert all(u <= v <= 512 for u, v in zip(r.series["used"], r.series["reserved"]))


def test_paged_waste_tracks_the_last_block_floor():
    trace = synthetic_trace("sharegpt", 150, seed=1)
    r = simulate(trace, Layout("p16", "paged", block_size=16), 8192, 2048, record_series=False)
    assert r.waste == pytest.approx(r.paged_floor, abs=0.01)
    assert r.waste < 0.04


def test_synthetic_trace_is_deterministic_and_bounded():
    a = synthetic_trace("sharegpt", 300, seed=7)
    b = synthetic_trace("sharegpt", 300, seed=7)
    assert [(r.input_len, r.output_lens) for r in a] == [(r.input_len, r.output_lens) for r in b]
    assert all(1 <= r.input_len <= 1024 and r.input_len + max(r.output_lens) <= 2048 for r in a)
    p = synthetic_trace("alpaca", 50, seed=0, arrival_rate=0.5)
    arr = [r.arrival for r in p]
    assert arr == sorted(arr) and arr[-1] > 0


def test_load_trace_csv_and_jsonl(tmp_path):
    csv_path = tmp_path / "t.csv"
    csv_path.write_text("input_len,output_len,arrival\n5,3,0\n2,2,1\n")
    jl = tmp_path / "t.jsonl"
    jl.write_text(
        json.dumps({"input_len": 5, "output_len": 3})
        + "\n"
        + json.dumps({"input_len": 2, "output_len": 2, "n": 2})
        + "\n"
    )
    t = load_trace(csv_path)
    assert [(r.input_len, r.output_lens, r.arrival) for r in t] == [(5, [3], 0), (2, [2], 1)]
    t = load_trace(jl)
    assert [(r.input_len, r.output_lens) for r in t] == [(5, [3]), (2, [2, 2])]
    with pytest.raises(ValueError):
        load_trace(csv_path, max_model_len=6)


def test_memory_study_cli_end_to_end(tmp_path):
    from benchmarks import memory_study

    rep = memory_study.main(
        [
            "--sharegpt-requests",
            "16",
            "--alpaca-requests",
            "40",
            "--no-plot",
            "--num-slots",
            "2048",
            "--max-model-len",
            "1024",
            "--out",
            str(tmp_path),
        ]
    )
    data = json.loads((tmp_path / "memory_study.json").read_text())
    assert set(data["workloads"]) == {"sharegpt", "alpaca", "alpaca+sys", "alpaca-n4", "sharegpt-n4"}
    rows = {r["layout"]: r for r in data["workloads"]["sharegpt"]["layouts"]}
    assert rows["paged-16"]["external_frac_of_pool"] == 0
    assert rows["paged-16"]["peak_running_requests"] >= 2 * rows["contig-maxlen"]["peak_running_requests"]
    assert len(rep["goals"]) == 4


def _seq(i, prompt_len, max_tokens):
    return Sequence(
        i, f"r{i}", 0, list(range(1000 * i, 1000 * i + prompt_len)), SamplingParams(max_tokens=max_tokens), None, 0.0
    )


def test_reservation_admission_policy_in_scheduler():
    # 8 blocks of 4; each request reserves 16 tokens (4 blocks) up front -> only 2 admitted.
    kv = KVCacheManager(8, 4)
    pol = ReservationAdmission(kv, lambda s: 16)
    sched = Scheduler(kv, max_num_seqs=16, max_num_batched_tokens=1024, max_model_len=64, admission_policy=pol)
    seqs = [_seq(i, 4, 8) for i in range(4)]
    for s in seqs:
        sched.add(s)
    out = sched.schedule()
    assert [s for s, _ in out.scheduled] == seqs[:2]
    assert kv.block_pool.num_used_blocks == 2 and pol.outstanding_blocks == 6
    sched.finish_seqs([seqs[0]], "length")
    seqs[1].num_computed_tokens = 4  # its prompt ran; nothing new to compute
    out = sched.schedule()  # the finished one's reservation is back: seqs[2] is admitted, seqs[3] waits
    assert seqs[2] in [s for s, _ in out.scheduled] and seqs[3] in sched.waiting
    # Without a policy the same pool admits all four (one prompt block each).
    sched2 = Scheduler(KVCacheManager(8, 4), 16, 1024, 64)
    for i in range(4):
        sched2.add(_seq(i, 4, 8))
    assert len(sched2.schedule().scheduled) == 4
