"""The static-buffer decode path behind CUDA graphs (``rawpaged/model_executor/cuda_graph.py``), on the CPU:
bucket choice, padding, buffer reuse and a stand-in capture; everything but recording a real graph."""

from __future__ import annotations

import numpy as np
import pytest

from rawpaged import SamplingParams
from rawpaged.core.block_table import BlockTable
from rawpaged.kernels.cpu.backend import CPUBackend
from rawpaged.model_executor.cuda_graph import (
    CUDAGraphRunner,
    DecodeInputBuffers,
    cudagraph_capture_sizes,
    padded_batch_size,
)
from tests.conftest import tiny_engine


@pytest.mark.parametrize(
    "max_num_seqs, sizes",
    [
        (1, [1]),
        (3, [1, 2, 3]),
        (8, [1, 2, 4, 8]),
        (20, [1, 2, 4, 8, 16, 20]),
        (64, [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]),
    ],
)
def test_capture_sizes_end_at_max_num_seqs(max_num_seqs, sizes):
    assert cudagraph_capture_sizes(max_num_seqs) == sizes


def test_capture_sizes_reject_zero():
    with pytest.raises(ValueError, match="max_num_seqs"):
        cudagraph_capture_sizes(0)


@pytest.mark.parametrize("n, want", [(1, 1), (2, 2), (3, 4), (5, 8), (8, 8), (9, 16), (17, 20), (20, 20), (21, None)])
def test_padded_batch_size_is_the_smallest_size_that_holds_the_batch(n, want):
    assert padded_batch_size(n, [1, 2, 4, 8, 16, 20]) == want


class _Seq:
    """What ``DecodeInputBuffers.fill`` reads of a decoding sequence."""

    def __init__(self, tokens, block_ids, block_size=4):
        self.tokens = list(tokens)
        self.num_computed_tokens = len(tokens) - 1
        self.block_tables = [BlockTable(0, block_size, list(block_ids), num_tokens=len(tokens))]  # one KV cache group

    @property
    def num_tokens(self):
        return len(self.tokens)

    def token_at(self, p):
        return self.tokens[p]


def test_buffers_start_as_padding_and_fill_rows_then_padding():
    bufs = DecodeInputBuffers(CPUBackend(), max_batch_size=8, max_blocks_per_seq=5)
    assert (bufs.slot_mapping == -1).all() and (bufs.context_lens == 0).all() and (bufs.block_tables == 0).all()
    bufs.host[:] = 0xAB  # poison: every byte must be written by fill or be padding that fill resets
    bufs._row_width[:] = 5
    a = _Seq(range(10, 19), [7, 3, 9])  # 9 tokens: last at position 8 -> block 9, offset 0
    b = _Seq([5], [2])  # 1 token at position 0 -> block 2, offset 0
    c = _Seq(range(20, 36), [1, 4, 6, 8])  # 16 tokens: position 15 -> block 8, offset 3
    bufs.fill([a, b, c], bucket=4)
    ids, pos, slots, ctx, tables = bufs.host_views
    np.testing.assert_array_equal(ids[:4], [18, 5, 35, 0])
    np.testing.assert_array_equal(pos[:4], [8, 0, 15, 0])
    np.testing.assert_array_equal(slots[:4], [9 * 4 + 0, 2 * 4 + 0, 8 * 4 + 3, -1])
    np.testing.assert_array_equal(ctx[:4], [9, 1, 16, 0])
    np.testing.assert_array_equal(tables[:4], [[7, 3, 9, 0, 0], [2, 0, 0, 0, 0], [1, 4, 6, 8, 0], [0] * 5])
    bufs.upload(4)
    used = bufs.used_bytes(4)
    np.testing.assert_array_equal(bufs.device[:used], bufs.host[:used])
    np.testing.assert_array_equal(bufs.block_tables[:4], tables[:4])  # the device views see the upload
    np.testing.assert_array_equal(bufs.block_tables[4:], 0)  # rows past the bucket were not copied
    np.testing.assert_array_equal(ids[:4], bufs.input_ids[:4])
    np.testing.assert_array_equal(ctx[:4], bufs.context_lens[:4])


def test_a_smaller_step_clears_what_the_larger_one_left():
    bufs = DecodeInputBuffers(CPUBackend(), max_batch_size=4, max_blocks_per_seq=4)
    long = [_Seq(range(14), [1, 2, 3, 4]) for _ in range(4)]
    bufs.fill(long, bucket=4)
    bufs.fill([_Seq(range(3), [9])], bucket=2)
    _, _, slots, ctx, tables = bufs.host_views
    np.testing.assert_array_equal(tables[:2], [[9, 0, 0, 0], [0, 0, 0, 0]])
    np.testing.assert_array_equal(slots[:2], [9 * 4 + 2, -1])
    np.testing.assert_array_equal(ctx[:2], [3, 0])
    np.testing.assert_array_equal(tables[2:], [[1, 2, 3, 4]] * 2)  # rows past the bucket are not read


def test_fill_rejects_a_batch_over_its_bucket_and_a_table_over_the_width():
    bufs = DecodeInputBuffers(CPUBackend(), max_batch_size=4, max_blocks_per_seq=2)
    with pytest.raises(ValueError, match="bucket"):
        bufs.fill([_Seq([1], [0])] * 3, bucket=2)
    with pytest.raises(ValueError, match="bucket"):
        bufs.fill([_Seq([1], [0])], bucket=8)
    with pytest.raises(ValueError, match="width"):
        bufs.fill([_Seq(range(9), [0, 1, 2])], bucket=1)


def _workload(llm):
    """Greedy requests that end at different steps (so the batch shrinks through several buckets),
    seeded n=3 sampling with copy-on-write, and a prefix-cache hit."""
    prompts = [{"prompt_token_ids": list(range(3, 3 + n))} for n in (5, 16, 33, 1, 7, 40, 2, 9, 11, 18)]
    greedy = [SamplingParams(temperature=0.0, max_tokens=4 + 3 * i, ignore_eos=True) for i in range(len(prompts))]
    sampled = SamplingParams(n=3, temperature=0.9, top_p=0.9, seed=5, max_tokens=9, ignore_eos=True)
    out = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]
    out += [[c.token_ids for c in o.outputs] for o in llm.generate(prompts[:3], sampled)]
    out.append(llm.generate(prompts[2:3], greedy[0])[0].outputs[0].token_ids)
    stats = llm.stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"]
    return out


def test_static_decode_path_gives_the_eager_engines_tokens_and_kv(tiny_dir):
    """Same tokens, and byte-identical KV caches afterwards: padded rows wrote nothing (slot -1), and
    each real row computed what it computes eagerly."""
    kw = dict(max_num_seqs=12, block_size=4)
    eager = tiny_engine(tiny_dir, **kw)
    static = tiny_engine(tiny_dir, enforce_eager=False, **kw)
    assert eager.engine.runner.cuda_graph is None
    assert _workload(static) == _workload(eager)
    steps = static.engine.runner.cuda_graph.num_steps
    assert sum(v > 0 for v in steps.values()) >= 4, steps  # several buckets, with padding in most
    for a, b in zip(
        eager.engine.runner.key_caches + eager.engine.runner.value_caches,
        static.engine.runner.key_caches + static.engine.runner.value_caches,
    ):
        np.testing.assert_array_equal(a, b)


def test_decode_steps_read_their_inputs_at_fixed_addresses(tiny_dir):
    """What a replayed graph relies on: every static decode step of a bucket reads the same arrays."""
    llm = tiny_engine(tiny_dir, enforce_eager=False, max_num_seqs=4)
    model = llm.engine.model
    seen, max_context = [], []
    forward = model.forward

    def recording(input_ids, positions, attn, kc, vc):
        max_context.append(attn.max_context_len)
        seen.append(
            (
                len(input_ids),
                input_ids.ctypes.data,
                positions.ctypes.data,
                attn.slot_mapping.ctypes.data,
                attn.decode_block_tables.ctypes.data,
                attn.decode_context_lens.ctypes.data,
                attn.num_decode_tokens == len(input_ids),
            )
        )
        return forward(input_ids, positions, attn, kc, vc)

    model.forward = recording
    prompts = [{"prompt_token_ids": [3 + i, 4, 5]} for i in range(3)]
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    decode_steps = [s for s in seen[1:] if s[0] == 4]  # the first forward is the prefill
    assert len(decode_steps) == 5 and len(set(decode_steps)) == 1 and decode_steps[0][-1]
    # without a graph, attention is sized for the step's longest context (4..8 tokens), not max_model_len
    assert max_context[1:] == [4, 5, 6, 7, 8]


class _CapturingCPU(CPUBackend):
    """A backend that "captures": ``capture_graph`` keeps ``fn`` and its output, and a replay re-runs
    ``fn`` into that same output array, as a replayed graph rewrites its captured buffers."""

    supports_cuda_graphs = True

    def __init__(self):
        super().__init__()
        self.captured = []
        self.replays = 0

    def capture_graph(self, fn):
        output = fn()
        self.captured.append(output.shape[0])

        def replay():
            self.replays += 1
            output[...] = fn()

        return replay, output


def test_runner_captures_each_size_largest_first_without_touching_the_kv_cache(tiny_dir):
    llm = tiny_engine(tiny_dir, max_num_seqs=4)
    model = llm.engine.model
    runner = llm.engine.runner
    backend = _CapturingCPU()
    model.backend = backend
    caches = [np.full_like(c, 7.0) for c in runner.key_caches], [np.full_like(c, 7.0) for c in runner.value_caches]
    graphs = CUDAGraphRunner(model, *caches, cudagraph_capture_sizes(4), max_model_len=256, block_size=16)
    graphs.capture_all()
    assert backend.captured == [4, 2, 1]
    assert all((c == 7.0).all() for c in caches[0] + caches[1])  # the capture's rows are all padding
    seqs = [_Seq([3, 4, 5], [0], block_size=16), _Seq([6, 7], [1], block_size=16), _Seq([8], [2], block_size=16)]
    logits = graphs.run(seqs)
    assert backend.replays == 1 and graphs.num_steps[4] == 1
    assert logits.shape == (3, model.config.vocab_size)
    assert np.shares_memory(logits, graphs.graphs[4][1])  # the captured output, not a new array
    with pytest.raises(ValueError, match="1 to 4"):
        graphs.run(seqs * 2)
