"""Scheduler, without a model: the token budget, FCFS admission, chunked prefill, max_num_seqs counting
forks, preemption by recompute (beams as a group), prefix-cache hits at admission, the admission hook,
and ``update_from_output``'s bookkeeping and token-level stop checks."""

import pytest

from rawpaged.core.kv_cache_manager import KVCacheManager
from rawpaged.core.scheduler import Scheduler, SchedulerOutput
from rawpaged.core.sequence import Sequence, SequenceStatus
from rawpaged.sampling_params import SamplingParams

EOS = 2


def make(
    num_blocks=16, block_size=4, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64, prefix_caching=False, **kw
):
    kv = KVCacheManager(num_blocks, block_size, prefix_caching)
    return Scheduler(kv, max_num_seqs, max_num_batched_tokens, max_model_len, eos_token_ids=(EOS,), **kw)


def seq(i, prompt_len, params=None, start=1000, index=0):
    return Sequence(
        i,
        f"r{i}",
        index,
        list(range(start * (i + 1), start * (i + 1) + prompt_len)),
        params or SamplingParams(max_tokens=8),
        None,
        0.0,
    )


def run_step(sched, token=7):
    """One step: every sequence reaching its last token samples ``token``."""
    out = sched.schedule()
    sampled = [(s, token) for s, n in out.scheduled if s.num_computed_tokens + n == s.num_tokens]
    return out, sched.update_from_output(out, sampled)


def test_decodes_first_then_fcfs_admission_under_the_token_budget():
    sched = make(max_num_batched_tokens=10)
    a, b, c = seq(0, 6), seq(1, 6), seq(2, 3)
    for s in (a, b, c):
        sched.add(s)
    out, _ = run_step(sched)
    assert [(s.seq_id, n) for s, n in out.scheduled] == [(0, 6), (1, 4)]  # b's prompt is chunked
    assert b.num_computed_tokens == 4 and not b.output_token_ids and a.output_token_ids == [7]
    assert list(sched.waiting) == [c]
    out, _ = run_step(sched)
    # Running first, in order: a decodes (1), b finishes its prompt (2); then c is admitted (3).
    assert [(s.seq_id, n) for s, n in out.scheduled] == [(0, 1), (1, 2), (2, 3)]
    assert out.num_batched_tokens == 6 and sched.stats.num_steps == 2
    assert sched.stats.num_prompt_tokens == 15 and sched.stats.num_generation_tokens == 4


def test_max_num_seqs_counts_the_forks_a_request_will_make():
    sched = make(max_num_seqs=3)
    sched.add(seq(0, 4, SamplingParams(n=3, temperature=1.0, max_tokens=4)))
    sched.add(seq(1, 4))
    out = sched.schedule()
    assert [s.seq_id for s, _ in out.scheduled] == [0]  # its 3 samples take every slot
    lone = make(max_num_seqs=1)
    lone.add(seq(0, 4, SamplingParams(n=3, temperature=1.0)))
    assert len(lone.schedule().scheduled) == 1  # an empty batch always admits its head


def test_a_prompt_that_does_not_fit_waits_and_changes_nothing():
    sched = make(num_blocks=2)
    sched.add(seq(0, 12))  # needs 3 blocks
    out = sched.schedule()
    assert out.is_empty and sched.stats.num_steps == 0
    assert sched.waiting[0].block_table is None and sched.kv_cache_manager.block_pool.num_free_blocks == 2


def test_preemption_frees_the_newest_and_recomputes_it_later():
    sched = make(num_blocks=4, block_size=4)
    a, b = seq(0, 7, SamplingParams(max_tokens=20)), seq(1, 7, SamplingParams(max_tokens=20))
    sched.add(a)
    sched.add(b)
    run_step(sched)  # both prompts: 2 blocks each, the pool is full
    run_step(sched)  # 8 tokens each, still 2 blocks each
    out, _ = run_step(sched)  # a's 9th token needs a block: b (the newest) is preempted
    assert out.preempted == [b] and [s for s, _ in out.scheduled] == [a]
    assert b.status is SequenceStatus.WAITING and b.num_computed_tokens == 0 and b.block_table is None
    assert list(sched.waiting) == [b] and sched.stats.num_preemptions == 1
    assert b.output_token_ids == [7, 7]  # kept: recomputed with its prompt when readmitted
    sched.finish_seqs([a], "abort")
    out, _ = run_step(sched)
    assert [(s, n) for s, n in out.scheduled] == [(b, 9)]  # prompt + generated tokens, recomputed
    sched.kv_cache_manager.check_invariants([b])


def test_a_sequence_preempting_itself_is_not_scheduled():
    sched = make(num_blocks=1, block_size=4)
    a = seq(0, 3, SamplingParams(max_tokens=20))
    sched.add(a)
    run_step(sched)  # the prompt's 3 tokens
    run_step(sched)  # the first generated token fills the only block
    out, _ = run_step(sched)  # the second needs another block: only a itself can make room
    assert out.scheduled == [] and out.preempted == [a] and list(sched.waiting) == [a]


def test_beams_are_preempted_and_readmitted_together():
    sched = make(num_blocks=6, block_size=4)
    params = SamplingParams(beam_width=2, max_tokens=20)
    other = seq(0, 3, SamplingParams(max_tokens=30))
    beam = seq(1, 4, params)
    sched.add(other)
    sched.add(beam)
    out = sched.schedule()
    sibling = beam.fork(9, 1, None)  # beams branch when they sample, before the step's update
    sched.fork(beam, sibling)
    assert sibling.num_computed_tokens == beam.num_tokens and sibling in sched.running
    sched.update_from_output(out, [(other, 7), (beam, 7), (sibling, 8)])
    assert sibling.num_computed_tokens == beam.num_computed_tokens == 4
    for _ in range(6):
        out, _ = run_step(sched)
        if out.preempted:
            break
    assert set(out.preempted) == {beam, sibling}
    assert list(sched.waiting) == [beam, sibling]
    sched.finish_seqs([other], "abort")
    out = sched.schedule()
    assert {s for s, _ in out.scheduled} == {beam, sibling}  # the whole group, from scratch
    assert all(s.num_computed_tokens == 0 for s in (beam, sibling))


def test_update_from_output_stop_checks():
    sched = make(max_model_len=12)
    cases = {
        "eos": seq(0, 4),
        "ignore_eos": seq(1, 4, SamplingParams(max_tokens=8, ignore_eos=True)),
        "stop_id": seq(2, 4, SamplingParams(max_tokens=8, stop_token_ids=[7])),
        "max_tokens": seq(3, 4, SamplingParams(max_tokens=1)),
        "max_model_len": seq(4, 11),
        "running": seq(5, 4),
    }
    for s in cases.values():
        sched.add(s)
    out = sched.schedule()
    tokens = {"eos": EOS, "ignore_eos": EOS, "stop_id": 7, "max_tokens": 5, "max_model_len": 5, "running": 5}
    finished = sched.update_from_output(out, [(cases[k], t) for k, t in tokens.items()])
    assert finished == [cases[k] for k in ("eos", "stop_id", "max_tokens", "max_model_len")]
    reasons = {k: s.finish_reason for k, s in cases.items()}
    assert reasons == {
        "eos": "stop",
        "ignore_eos": None,
        "stop_id": "stop",
        "max_tokens": "length",
        "max_model_len": "length",
        "running": None,
    }
    assert all(s.block_table is None for s in finished)
    assert sched.running == [cases["ignore_eos"], cases["running"]]
    assert all(s.num_computed_tokens == s.num_prompt_tokens for s in cases.values())


def test_update_from_output_caches_full_blocks_for_later_requests():
    sched = make(block_size=4, prefix_caching=True)
    first = seq(0, 9)
    sched.add(first)
    run_step(sched)
    assert len(first.block_table.block_hashes) == 2  # 9 computed tokens: 2 full blocks
    again = Sequence(5, "r5", 0, list(first.prompt_token_ids), SamplingParams(), None, 0.0)
    sched.add(again)
    out = sched.schedule()
    assert (again, 1) in out.scheduled and again.num_computed_tokens == again.num_cached_tokens == 8
    assert again.block_table.block_ids[:2] == first.block_table.block_ids[:2]


def test_fork_shares_and_the_first_writes_copy_the_partial_block():
    sched = make(block_size=4)
    parent = seq(0, 6, SamplingParams(n=2, temperature=1.0))
    sched.add(parent)
    out = sched.schedule()
    child = parent.fork(1, 1, None)
    sched.fork(parent, child)
    sched.update_from_output(out, [(parent, 5), (child, 6)])
    assert child.block_table.block_ids == parent.block_table.block_ids
    out = sched.schedule()
    assert [n for _, n in out.scheduled] == [1, 1]
    assert len(out.blocks_to_copy) == 1  # the first writer copies the shared partly filled block


def test_finish_seqs_frees_waiting_and_running_and_skips_finished():
    sched = make()
    a, b = seq(0, 4), seq(1, 4)
    sched.add(a)
    sched.schedule()
    sched.add(b)
    sched.finish_seqs([a, b], "abort")
    assert a.finish_reason == b.finish_reason == "abort" and sched.num_unfinished == 0
    sched.finish_seqs([a], "stop")  # already finished: unchanged
    assert a.finish_reason == "abort" and sched.kv_cache_manager.block_pool.num_free_blocks == 16


class CountingPolicy:
    def __init__(self, limit):
        self.limit, self.live, self.log = limit, set(), []

    def can_admit(self, s):
        return len(self.live) < self.limit

    def admitted(self, s):
        self.live.add(s.seq_id)
        self.log.append(("admitted", s.seq_id))

    def released(self, s):
        self.live.discard(s.seq_id)
        self.log.append(("released", s.seq_id))


def test_admission_hook_can_hold_back_admissions():
    policy = CountingPolicy(limit=1)
    sched = make(admission_policy=policy)
    a, b = seq(0, 4, SamplingParams(max_tokens=1)), seq(1, 4, SamplingParams(max_tokens=1))
    sched.add(a)
    sched.add(b)
    out, finished = run_step(sched)
    assert [s for s, _ in out.scheduled] == [a] and finished == [a]
    out, _ = run_step(sched)
    assert [s for s, _ in out.scheduled] == [b]
    assert policy.log == [("admitted", 0), ("released", 0), ("admitted", 1), ("released", 1)]


def test_limits_must_be_positive():
    kv = KVCacheManager(4, 4)
    for kw in (dict(max_num_seqs=0), dict(max_num_batched_tokens=0), dict(max_model_len=0)):
        args = dict(max_num_seqs=1, max_num_batched_tokens=1, max_model_len=1) | kw
        with pytest.raises(ValueError, match=next(iter(kw))):
            Scheduler(kv, **args)


def test_scheduler_output_empty():
    assert SchedulerOutput().is_empty and SchedulerOutput().num_batched_tokens == 0
