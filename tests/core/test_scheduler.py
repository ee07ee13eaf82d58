"""Scheduler, without a model: the token budget, FCFS admission, chunked prefill, max_num_seqs counting
forks, preemption by recompute (beams as a group), prefix-cache hits at admission, the admission hook,
and ``update_from_output``'s bookkeeping and token-level stop checks."""

import pytest

from rawpaged.core.kv_cache_manager import KVCacheManager
from rawpaged.core.kv_offload import OffloadingManager
from rawpaged.core.kv_tier import KVTier
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


@pytest.mark.parametrize("name", ["max_num_seqs", "max_num_batched_tokens", "max_model_len"])
def test_limit_messages_name_the_limit(name):
    args = dict(max_num_seqs=1, max_num_batched_tokens=1, max_model_len=1) | {name: 0}
    with pytest.raises(ValueError) as e:
        Scheduler(KVCacheManager(4, 4), **args)
    assert str(e.value) == f"{name} must be >= 1, got 0"


def test_add_fork_and_finish_set_the_status():
    sched = make()
    a = seq(0, 4, SamplingParams(n=2, temperature=1.0))
    a.status = SequenceStatus.FINISHED
    sched.add(a)
    assert a.status is SequenceStatus.WAITING
    out = sched.schedule()
    assert a.status is SequenceStatus.RUNNING
    child = a.fork(1, 1, None)
    sched.fork(a, child)
    assert child.status is SequenceStatus.RUNNING and sched.running == [a, child]
    sched.update_from_output(out, [(a, 5), (child, 6)])
    b = seq(2, 4)
    sched.add(b)
    sched.finish_seqs([a, child, b], "abort")  # running and waiting, in one call
    sched.finish_seqs([a, b], "stop")
    assert [s.finish_reason for s in (a, child, b)] == ["abort"] * 3 and sched.num_unfinished == 0
    assert sched.kv_cache_manager.block_pool.num_free_blocks == 16


def test_finish_seqs_goes_on_past_a_finished_one():
    sched = make()
    a, b = seq(0, 4), seq(1, 4)
    sched.add(a)
    sched.add(b)
    sched.finish_seqs([a], "abort")
    sched.finish_seqs([a, b], "stop")
    assert b.finish_reason == "stop" and not sched.waiting


def test_every_token_of_the_budget_is_used():
    sched = make(max_num_batched_tokens=3)
    seqs = [seq(i, 1, SamplingParams(max_tokens=10)) for i in range(3)]
    for s in seqs:
        sched.add(s)
    out, _ = run_step(sched)
    assert [n for _, n in out.scheduled] == [1, 1, 1]  # the last token of the budget admits the third
    out, _ = run_step(sched)
    assert [n for _, n in out.scheduled] == [1, 1, 1]  # and serves the third decode


def test_running_prefills_share_the_budget_in_order():
    sched = make(num_blocks=32, max_num_batched_tokens=12)
    a, b = seq(0, 30, SamplingParams(max_tokens=2)), seq(1, 30, SamplingParams(max_tokens=2))
    sched.add(a)
    sched.add(b)
    out, _ = run_step(sched)
    assert [(s, n) for s, n in out.scheduled] == [(a, 12)]
    out, _ = run_step(sched)
    assert [(s, n) for s, n in out.scheduled] == [(a, 12)]
    out, _ = run_step(sched)
    assert [(s, n) for s, n in out.scheduled] == [(a, 6), (b, 6)]  # a's last chunk, then b gets the rest
    assert (a.num_computed_tokens, b.num_computed_tokens) == (30, 6) and a.output_token_ids == [7]
    assert sched.stats.num_prompt_tokens == 36


def test_a_sequence_with_nothing_to_compute_is_passed_over():
    sched = make()
    a, b, c = (seq(i, 4, SamplingParams(max_tokens=9)) for i in range(3))
    for s in (a, b, c):
        sched.add(s)
    out = sched.schedule()
    sched.update_from_output(out, [(a, 7), (b, 7), (c, 7)])
    out = sched.schedule()
    # a gets no token this step (as a beam waiting for its siblings' rows): its KV is complete.
    sched.update_from_output(out, [(b, 7), (c, 7)])
    assert a.num_computed_tokens == a.num_tokens
    out = sched.schedule()
    assert [s for s, _ in out.scheduled] == [b, c]
    sched.update_from_output(out, [(b, 7), (c, 7)])
    sched.running[:2] = [b, a]  # the one with nothing to compute in the middle
    out = sched.schedule()
    assert [s for s, _ in out.scheduled] == [b, c]


def test_max_num_seqs_admits_up_to_the_limit_and_counts_forks_once():
    sched = make(max_num_seqs=3)
    for i in range(4):
        sched.add(seq(i, 4))
    out = sched.schedule()
    assert len(out.scheduled) == 3 and len(sched.waiting) == 1  # exactly max_num_seqs, not one fewer
    forked = make(max_num_seqs=3)
    first = seq(0, 4, SamplingParams(n=2, temperature=1.0))
    forked.add(first)
    forked.add(seq(1, 4))
    forked.add(seq(2, 4))
    out = forked.schedule()
    assert [s.seq_id for s, _ in out.scheduled] == [0, 1]  # 2 slots for the samples + 1 = 3
    later_sample = Sequence(9, "r9", 1, [1, 2, 3], SamplingParams(n=4, temperature=1.0), None, 0.0)
    assert forked_slots(later_sample) == 1  # only a request's first sequence forks


def forked_slots(s):
    from rawpaged.core.scheduler import _seq_slots

    return _seq_slots(s)


def test_preempting_a_beam_group_unschedules_a_sibling_scheduled_earlier():
    sched = make(num_blocks=4, block_size=4, max_num_batched_tokens=64)
    beams = _beams(sched, prompt=4, width=2)  # each beam: 5 tokens, 4 computed, one block of its own coming
    other = seq(9, 8, SamplingParams(max_tokens=20))
    sched.running.insert(1, other)  # running: beam 0, other, beam 1
    assert sched.kv_cache_manager.allocate_slots(other, 8)
    other.num_computed_tokens = 7
    other.prompt_token_ids.append(1)  # other computes tokens 8 and 9: a third block
    assert sched.kv_cache_manager.block_pool.num_free_blocks == 1  # beam 0 takes it first
    out = sched.schedule()
    # beam 0 was scheduled, then other's block forced a preemption of the newest: beam 1 and its sibling.
    assert set(out.preempted) == set(beams)
    assert [(s, n) for s, n in out.scheduled] == [(other, 2)] and list(sched.waiting)[:2] == beams
    assert all(b.block_table is None and b.num_computed_tokens == 0 for b in beams)


def test_two_preemptions_are_counted_and_policies_released():
    policy = CountingPolicy(limit=10)
    sched = make(num_blocks=2, block_size=4, admission_policy=policy)
    a, b = seq(0, 4, SamplingParams(max_tokens=20)), seq(1, 4, SamplingParams(max_tokens=20))
    sched.add(a)
    sched.add(b)
    run_step(sched)  # both prompts: one block each
    out, _ = run_step(sched)  # a's 5th token needs a block: b is preempted
    assert out.preempted == [b] and ("released", 1) in policy.log and sched.stats.num_preemptions == 1
    for _ in range(3):
        out, _ = run_step(sched)  # a's tokens 6 to 8 fit its two blocks
        assert not out.preempted
    out, _ = run_step(sched)  # its 9th needs a third: a preempts itself
    assert out.preempted == [a] and ("released", 0) in policy.log and sched.stats.num_preemptions == 2


def _beams(sched, request=1, prompt=4, width=2):
    """A beam request of ``width`` beams that each generated one token, running."""
    params = SamplingParams(beam_width=width, max_tokens=30)
    head = seq(request, prompt, params)
    sched.add(head)
    out = sched.schedule()
    beams = [head] + [head.fork(100 + i, i + 1, None) for i in range(width - 1)]
    for child in beams[1:]:
        sched.fork(head, child)
    sched.update_from_output(out, [(b, 7) for b in beams])
    return beams


def test_waiting_beams_are_readmitted_as_a_group_when_their_blocks_fit():
    sched = make(num_blocks=4, block_size=4, max_num_batched_tokens=64)
    beams = _beams(sched, width=2)
    sched.finish_seqs([], "abort")
    victims = sched._preempt_newest(SchedulerOutput())
    assert victims == beams and list(sched.waiting) == beams
    other = seq(9, 12, SamplingParams(max_tokens=1))
    sched.waiting.append(other)
    out = sched.schedule()
    assert [s for s, _ in out.scheduled] == beams  # 5 tokens each from scratch: 2 + 2 blocks; 0 left for other
    assert all(b.status is SequenceStatus.RUNNING and b.num_computed_tokens == 0 for b in beams)
    assert other in sched.waiting
    assert sum(n for _, n in out.scheduled) == 10


def test_waiting_beams_that_do_not_fit_wait_and_change_nothing():
    sched = make(num_blocks=4, block_size=4)
    beams = _beams(sched, width=2)
    sched._preempt_newest(SchedulerOutput())
    hog = seq(8, 8, SamplingParams(max_tokens=1))
    assert sched.kv_cache_manager.allocate_slots(hog, 8)  # 2 blocks left: the beams need 4
    out = sched.schedule()
    assert out.is_empty and list(sched.waiting) == beams and all(b.block_table is None for b in beams)


def test_readmitted_beams_share_the_budget_and_are_chunked():
    sched = make(num_blocks=8, block_size=4, max_num_batched_tokens=7)
    beams = _beams(sched, prompt=4, width=2)
    sched._preempt_newest(SchedulerOutput())
    out = sched.schedule()
    assert [(s, n) for s, n in out.scheduled] == [(beams[0], 5), (beams[1], 2)]
    assert all(b in sched.running for b in beams)
    sched.update_from_output(out, [])
    out = sched.schedule()
    assert [(s, n) for s, n in out.scheduled] == [(beams[1], 3)]


def test_readmitted_beams_leave_room_for_other_admissions():
    sched = make(num_blocks=8, block_size=4, max_num_batched_tokens=14)
    beams = _beams(sched, prompt=4, width=2)
    sched._preempt_newest(SchedulerOutput())
    other = seq(9, 3, SamplingParams(max_tokens=1))
    sched.add(other)
    out = sched.schedule()
    assert [(s, n) for s, n in out.scheduled] == [(beams[0], 5), (beams[1], 5), (other, 3)]


def test_readmitted_beams_count_toward_max_num_seqs():
    sched = make(num_blocks=8, block_size=4, max_num_seqs=2)
    beams = _beams(sched, prompt=4, width=2)
    sched._preempt_newest(SchedulerOutput())
    other = seq(9, 3, SamplingParams(max_tokens=1))
    sched.add(other)
    out = sched.schedule()
    assert [s for s, _ in out.scheduled] == beams and list(sched.waiting) == [other]


def test_a_preempted_sequence_finds_its_own_cached_blocks_again():
    sched = make(num_blocks=4, block_size=4, prefix_caching=True)
    a = seq(0, 8, SamplingParams(max_tokens=20))
    sched.add(a)
    run_step(sched)  # its prompt's two full blocks are cached
    assert sched._preempt_newest(SchedulerOutput()) == [a] and a.num_computed_tokens == 0
    out = sched.schedule()  # readmitted: the cache holds its prompt; only the generated token is computed
    assert [(s, n) for s, n in out.scheduled] == [(a, 1)] and a.num_computed_tokens == 8
    assert a.num_cached_tokens == 0  # counted at its first admission only


def test_a_beam_group_takes_what_the_running_batch_left_and_others_the_rest():
    sched = make(num_blocks=16, block_size=4, max_num_batched_tokens=8)
    beams = _beams(sched, request=1, prompt=4, width=2)
    sched._preempt_newest(SchedulerOutput())
    runner = seq(5, 2, SamplingParams(max_tokens=20))
    assert sched.kv_cache_manager.allocate_slots(runner, 2)
    runner.num_computed_tokens, runner.output_token_ids, runner.status = 2, [7], SequenceStatus.RUNNING
    sched.running.append(runner)  # a decode already in the batch
    other = seq(9, 6, SamplingParams(max_tokens=1))
    sched.add(other)
    out = sched.schedule()
    # runner decodes 1; the group gets 7 of the 8: 5 + 2; nothing is left for other.
    assert [(s, n) for s, n in out.scheduled] == [(runner, 1), (beams[0], 5), (beams[1], 2)]
    assert other in sched.waiting
    roomy = make(num_blocks=16, block_size=4, max_num_batched_tokens=14)
    beams = _beams(roomy, prompt=4, width=2)
    roomy._preempt_newest(SchedulerOutput())
    other = seq(9, 6, SamplingParams(max_tokens=1))
    roomy.add(other)
    out = roomy.schedule()
    assert [(s, n) for s, n in out.scheduled] == [(beams[0], 5), (beams[1], 5), (other, 4)]  # other: the last 4


def test_a_beam_group_needs_every_block_before_it_is_readmitted():
    sched = make(num_blocks=5, block_size=4)
    beams = _beams(sched, width=2)  # each beam: 5 tokens, 2 blocks from scratch
    sched._preempt_newest(SchedulerOutput())
    hog = seq(8, 8, SamplingParams(max_tokens=1))
    assert sched.kv_cache_manager.allocate_slots(hog, 8)  # 3 blocks free: 2.5 + 2.5 would pass, 4 do not
    out = sched.schedule()
    assert out.is_empty and all(b.block_table is None for b in beams)


class SeenPolicy(CountingPolicy):
    def can_admit(self, s):
        self.log.append(("asked", s.seq_id))
        return super().can_admit(s)


def test_the_admission_hook_sees_the_candidate():
    policy = SeenPolicy(limit=5)
    sched = make(admission_policy=policy)
    sched.add(seq(3, 4))
    sched.schedule()
    assert policy.log[:2] == [("asked", 3), ("admitted", 3)]


def test_prefill_tokens_are_capped_only_in_steps_that_carry_decodes():
    sched = make(num_blocks=32, max_num_batched_tokens=64, max_prefill_tokens_while_decoding=5)
    a, b = seq(0, 12), seq(1, 12)
    sched.add(a)
    sched.add(b)
    out, _ = run_step(sched)  # nothing decodes yet: both prompts whole
    assert [(s.seq_id, n) for s, n in out.scheduled] == [(0, 12), (1, 12)]
    c, d = seq(2, 9), seq(3, 9)
    sched.add(c)
    sched.add(d)
    out, _ = run_step(sched)  # a and b decode: 5 prompt tokens in all, c's first chunk
    assert [(s.seq_id, n) for s, n in out.scheduled] == [(0, 1), (1, 1), (2, 5)]
    out, _ = run_step(sched)  # c's running chunk goes first, then d gets what is left of the cap
    assert [(s.seq_id, n) for s, n in out.scheduled] == [(0, 1), (1, 1), (2, 4), (3, 1)]
    assert c.output_token_ids == [7] and not d.output_token_ids
    sched.finish_seqs([a, b, c], "abort")
    out, _ = run_step(sched)  # d alone, no decodes: the rest of its prompt at once
    assert [(s.seq_id, n) for s, n in out.scheduled] == [(3, 8)]
    sched.finish_seqs([d], "abort")
    kv = sched.kv_cache_manager
    assert kv.block_pool.num_free_blocks == kv.block_pool.num_blocks


def test_prefill_cap_must_be_positive():
    with pytest.raises(ValueError, match="max_prefill_tokens_while_decoding"):
        make(max_prefill_tokens_while_decoding=0)


def test_drafts_are_budgeted_and_rolled_back_to_the_accepted_tokens():
    sched = make(num_blocks=16, block_size=2, max_num_batched_tokens=6, max_model_len=64)
    a, b = seq(0, 3, SamplingParams(max_tokens=20)), seq(1, 3, SamplingParams(max_tokens=20))
    sched.add(a)
    sched.add(b)
    run_step(sched)  # both prefilled; one token each: 4 tokens, 3 computed
    a.spec_token_ids, b.spec_token_ids = [11, 12, 13, 14], [21, 22, 23]
    out = sched.schedule()
    # a takes its last token and 4 drafts (5 of the budget 6); b gets 1: it decodes without drafts.
    assert [(s.seq_id, n) for s, n in out.scheduled] == [(0, 5), (1, 1)]
    assert out.spec_token_ids == {0: [11, 12, 13, 14]}
    assert len(a.block_table.block_ids) == 4 and a.block_table.num_tokens == 8  # 3 + 5 slots
    # a's target agreed with 11 and 12, then sampled 99: three tokens; b sampled one.
    finished = sched.update_from_output(out, [(a, 11), (a, 12), (a, 99), (b, 5)])
    assert finished == [] and a.output_token_ids == [7, 11, 12, 99]
    assert a.num_computed_tokens == 6 == a.block_table.num_tokens  # last token + 2 accepted
    assert len(a.block_table.block_ids) == 3  # the block of rejected drafts only went back
    assert sched.stats.num_generation_tokens == 2 + 4
    sched.kv_cache_manager.check_invariants([a, b])


def test_drafts_never_preempt_and_tokens_after_a_stop_are_dropped():
    sched = make(num_blocks=4, block_size=4, max_model_len=64)
    a = seq(0, 3, SamplingParams(max_tokens=20, stop_token_ids=[42]))
    sched.add(a)
    run_step(sched)
    b = seq(1, 3, SamplingParams(max_tokens=20))
    sched.add(b)
    run_step(sched)
    # a: 5 tokens, b: 4, one block each and 2 free; a's 8 drafts would need 3 more: a decodes alone.
    a.spec_token_ids = [1, 2, 3, 4, 5, 6, 7, 8]
    out = sched.schedule()
    assert (a, 1) in out.scheduled and out.spec_token_ids == {} and not out.preempted
    sched.update_from_output(out, [(s, 9) for s, _ in out.scheduled])
    a.spec_token_ids = [1]
    out = sched.schedule()
    assert out.spec_token_ids == {0: [1]}
    finished = sched.update_from_output(out, [(a, 42), (a, 8), (b, 9)])  # a stops at its first token
    assert finished == [a] and a.output_token_ids[-1] == 42 and a.finish_reason == "stop"
    assert sched.stats.num_generation_tokens == 1 + 2 + 2 + 2  # a's 8 after its stop is not counted
    sched.kv_cache_manager.check_invariants([b])


def test_a_request_waiting_for_blocks_is_one_prefix_cache_lookup():
    """Counted when admitted, not at every scheduling attempt while it waits."""
    sched = make(num_blocks=4, block_size=4, prefix_caching=True)
    kv = sched.kv_cache_manager
    a = seq(0, 8, SamplingParams(max_tokens=20))
    sched.add(a)
    run_step(sched)  # a's two prompt blocks are cached; with its first token it holds 3 of the 4 blocks
    assert (kv.num_prefix_queries, kv.num_prefix_hits) == (1, 0)  # a missed at its first block
    b = Sequence(1, "r1", 0, [*a.prompt_token_ids, *range(50, 58)], SamplingParams(max_tokens=4), None, 0.0)
    sched.add(b)  # 16 tokens: the 2 cached blocks and 2 new ones, but 1 is free
    for _ in range(5):
        run_step(sched)
        assert list(sched.waiting) == [b]
    assert (kv.num_prefix_queries, kv.num_prefix_hits) == (1, 0)
    sched.finish_seqs((a,), "stop")
    out, _ = run_step(sched)
    assert [s for s, _ in out.scheduled] == [b] and b.num_cached_tokens == 8
    assert (kv.num_prefix_queries, kv.num_prefix_hits) == (1 + 3, 2)  # 2 hits and the miss after them


def test_one_swap_out_and_one_swap_in_are_counted_once_each():
    """b is swapped out once; its swap-in attempts while the pool is full count nothing; then one swap-in."""
    kv = KVCacheManager(2, 4, False)
    tier = KVTier(kv, OffloadingManager(8))
    sched = Scheduler(kv, 8, 64, 64, eos_token_ids=(EOS,), preemption_mode="swap", kv_tier=tier)
    a, b = seq(0, 4, SamplingParams(max_tokens=20)), seq(1, 4, SamplingParams(max_tokens=20))
    sched.add(a)
    sched.add(b)
    run_step(sched)  # both prompts: one block each
    out, _ = run_step(sched)  # a's 5th token needs a block: b is swapped out
    assert out.preempted == [b]
    for _ in range(3):
        run_step(sched)  # b cannot come back: a holds both blocks
        assert list(sched.waiting) == [b]
    s = sched.stats
    assert (s.num_preemptions, s.num_swapped_out, s.num_swapped_in) == (1, 1, 0)
    sched.finish_seqs((a,), "stop")
    tier.end_transfers()
    run_step(sched)
    assert b in sched.running and (s.num_preemptions, s.num_swapped_out, s.num_swapped_in) == (1, 1, 1)
