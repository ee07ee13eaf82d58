"""Sequence: token positions, the prefill test, and forks that continue from their parent's state."""

import numpy as np

from rawpaged.core.sequence import Sequence, SequenceStatus
from rawpaged.sampling_params import SamplingParams


def make():
    s = Sequence(3, "r", 0, [10, 11, 12], SamplingParams(n=2), np.random.default_rng(0), 1.5)
    s.output_token_ids = [20, 21]
    s.num_cached_tokens, s.cumulative_logprob, s.logprobs = 2, -1.25, [{20: -0.5}, {21: -0.75}]
    s.output_text, s.prefix_offset, s.read_offset, s.num_text_emitted = "ab", 1, 2, 1
    s.first_token_time = 9.0
    return s


def test_positions_and_counts():
    s = make()
    assert (s.num_prompt_tokens, s.num_tokens, s.token_ids) == (3, 5, [10, 11, 12, 20, 21])
    assert [s.token_at(p) for p in range(5)] == [10, 11, 12, 20, 21]
    assert s.status is SequenceStatus.WAITING and not s.is_finished
    s.status = SequenceStatus.FINISHED
    assert s.is_finished


def test_is_prefill_until_only_the_last_token_is_missing():
    s = make()
    for computed, prefill in ((0, True), (3, True), (4, False), (5, False)):
        s.num_computed_tokens = computed
        assert s.is_prefill == prefill, computed


def test_fork_copies_the_state_but_not_the_blocks():
    parent = make()
    parent.block_table, parent.num_computed_tokens, parent.finish_reason = object(), 5, None
    rng = np.random.default_rng(1)
    child = parent.fork(7, 4, rng)
    assert (child.seq_id, child.request_id, child.index, child.rng, child.arrival_time) == (7, "r", 4, rng, 1.5)
    assert child.prompt_token_ids is parent.prompt_token_ids and child.sampling_params is parent.sampling_params
    assert child.output_token_ids == [20, 21] and child.output_token_ids is not parent.output_token_ids
    assert child.logprobs == parent.logprobs and child.logprobs is not parent.logprobs
    assert (child.num_cached_tokens, child.cumulative_logprob, child.first_token_time) == (2, -1.25, 9.0)
    assert (child.output_text, child.prefix_offset, child.read_offset, child.num_text_emitted) == ("ab", 1, 2, 1)
    assert child.block_table is None and child.num_computed_tokens == 0 and child.status is SequenceStatus.WAITING
    child.output_token_ids.append(30)
    child.logprobs.append({30: -1.0})
    assert parent.output_token_ids == [20, 21] and len(parent.logprobs) == 2
