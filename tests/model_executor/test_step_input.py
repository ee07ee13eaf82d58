"""A step's inputs, made once from the scheduler's output (``rawpaged/model_executor/step_input.py``), and
the forward paths that take them (``forward_paths``): hand-worked arrays and logits layout for a mixed
step, and the path each kind of step runs on, each giving the op-by-op logits."""

from __future__ import annotations

import numpy as np

from rawpaged import SamplingParams
from rawpaged.core.block_table import BlockTable
from rawpaged.core.scheduler import SchedulerOutput
from rawpaged.core.sequence import Sequence
from rawpaged.kernels.cpu.backend import CPUBackend
from rawpaged.model_executor.forward_paths import EagerForward
from rawpaged.model_executor.step_input import build_step_input
from tests.conftest import tiny_engine


def _seq(seq_id, prompt, output, computed, block_ids, reserved):
    seq = Sequence(seq_id, f"r{seq_id}", 0, list(prompt), SamplingParams(), None, 0.0, list(output))
    seq.num_computed_tokens = computed
    seq.block_table = BlockTable(seq_id, 4, list(block_ids), num_tokens=reserved)
    return seq


def test_a_mixed_step_flattens_decodes_first_and_lays_out_the_sampling_rows():
    chunk = _seq(0, range(30, 38), [], 0, [1], 4)  # a prefill chunk short of its end: does not sample
    decode = _seq(1, range(10, 15), [15], 5, [3, 7], 6)
    prefill = _seq(2, [50, 51, 52], [], 1, [8], 3)  # its first token cached
    drafting = _seq(3, [20, 21, 22], [], 2, [5, 9], 5)  # its last token and 2 drafts
    out = SchedulerOutput(scheduled=[(chunk, 4), (decode, 1), (prefill, 2), (drafting, 3)])
    out.spec_token_ids[drafting.seq_id] = [40, 41]
    step = build_step_input(out)
    assert step.decodes == ((decode, 1), (drafting, 3)) and step.prefills == ((chunk, 4), (prefill, 2))
    assert step.has_drafts and step.num_decode_tokens == 4
    np.testing.assert_array_equal(step.input_ids, [15, 22, 40, 41, 30, 31, 32, 33, 51, 52])
    np.testing.assert_array_equal(step.positions, [5, 2, 3, 4, 0, 1, 2, 3, 1, 2])
    np.testing.assert_array_equal(step.slot_mapping, [29, 22, 23, 36, 4, 5, 6, 7, 33, 34])
    np.testing.assert_array_equal(step.decode_context_lens, [6, 3, 4, 5])
    layout = step.layout  # scheduled order; the drafting sequence's 3 rows are its last 3 hidden rows
    assert layout.seqs == (decode, prefill, drafting)
    assert layout.draft_token_ids == ((), (), (40, 41)) and layout.first_rows == (0, 1, 2)
    np.testing.assert_array_equal(layout.logits_indices, [0, 9, 1, 2, 3])
    assert layout.num_rows == 5 and list(layout.rows(2)) == [2, 3, 4]
    attn = step.attention_metadata(CPUBackend())
    np.testing.assert_array_equal(attn.decode_block_tables, [[3, 7], [5, 9], [5, 9], [5, 9]])
    np.testing.assert_array_equal(attn.prefill_block_tables, [[1], [8]])  # as wide as its widest
    np.testing.assert_array_equal(attn.query_start_loc, [0, 4, 6])
    np.testing.assert_array_equal(attn.prefill_seq_lens, [4, 3])
    assert (attn.num_decode_tokens, attn.max_query_len, attn.max_context_len) == (4, 4, 6)


def test_an_empty_step_has_no_rows():
    step = build_step_input(SchedulerOutput())
    assert step.layout.num_rows == 0 and step.layout.seqs == () and not step.has_drafts
    assert step.input_ids.dtype == np.int64 and step.decode_context_lens.dtype == np.int32


def test_each_step_runs_on_the_first_path_that_takes_it_with_the_op_by_op_logits(tiny_dir):
    """Prefills run op by op; plain decodes on the static (CUDA graph) buffers; decodes with drafts in
    the CPU's fused call. Each path's logits of a step equal the op-by-op forward's."""
    llm = tiny_engine(tiny_dir, enforce_eager=False, max_num_seqs=4, block_size=4)
    runner, kv = llm.engine.runner, llm.engine.kv_cache_manager
    seqs = [Sequence(i, f"r{i}", 0, list(range(3, 9 + i)), SamplingParams(), None, 0.0) for i in range(2)]
    for s in seqs:
        assert kv.allocate_slots(s, s.num_tokens)
    prefill = build_step_input(SchedulerOutput(scheduled=[(s, s.num_tokens) for s in seqs]))
    assert isinstance(runner._forward_path(prefill), EagerForward)
    eager = EagerForward(runner.model, runner.key_caches, runner.value_caches)
    eager.forward_step(prefill)
    for s in seqs:
        s.num_computed_tokens = s.num_tokens
        s.output_token_ids.append(7)
        assert kv.allocate_slots(s, 3)
    decode = build_step_input(SchedulerOutput(scheduled=[(s, 1) for s in seqs]))
    drafts = SchedulerOutput(scheduled=[(seqs[0], 3), (seqs[1], 1)])
    drafts.spec_token_ids[seqs[0].seq_id] = [11, 12]
    drafting = build_step_input(drafts)
    assert runner._forward_path(decode) is runner.cuda_graph
    assert runner._forward_path(drafting) is runner.fused_decode
    for step, rows in ((decode, 2), (drafting, 4)):
        logits, _ = runner._forward_path(step).forward_step(step)
        want, hidden = eager.forward_step(step)
        assert logits.shape == (rows, runner.model.config.vocab_size) and hidden.shape[0] == len(step.input_ids)
        np.testing.assert_allclose(np.asarray(logits), np.asarray(want), rtol=1e-5, atol=1e-5)
    for s in seqs:
        kv.free(s)
