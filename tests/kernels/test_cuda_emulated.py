"""The real CUDA kernels (cuda/*.cu) executed on the CPU through the g++ emulation in tests/cuda_emu,
launched by the real runtime code (``CudaBackend`` over NumPy arrays), compared against the Numba CPU
backend and the float64 references. Outputs are NaN-poisoned before the kernels write them, pools hold
NaN in every unused slot, blocks are scattered randomly. A replay of the launches under ThreadSanitizer
checks the kernels for shared-memory races (and that the check itself can fail).
"""

from __future__ import annotations

import os
import re
import subprocess

import numpy as np
import pytest

from rawpaged.dtypes import FP8_E4M3, INT8
from rawpaged.kernels.cpu import attention as cpu_attention
from rawpaged.kernels.cpu import cache as cpu_cache
from rawpaged.kernels.cpu import elementwise as cpu_elementwise
from rawpaged.kernels.cpu import sampling as cpu_sampling
from rawpaged.kernels.cuda import launch_config, program
from rawpaged.kernels.cuda import linear as cuda_linear
from rawpaged.kernels.kv_cache import QuantizedKVCache
from rawpaged.testing import reference_sampler
from tests.cuda_emu import (
    SELFTEST_NAMES,
    Emulator,
    Recorder,
    build,
    emulated_backend,
    missing_requirements,
    read_replay_output,
)
from tests.kv_reference import (
    BF16,
    assert_cache_rows_written,
    assert_prefill_matches,
    assert_rows_quantized,
    attention_ref,
    copy_blocks_expected,
    make_paged_kv,
    poison_before,
    quantized_paged_kv,
    rms_norm_ref,
    rope_cache,
    rope_ref,
)
from tests.sampling_reference import SAMPLE_CASES, assert_draws_match, sample_args

_why = missing_requirements()
pytestmark = pytest.mark.skipif(_why is not None, reason=f"CUDA emulation unavailable: {_why}")

CONTEXTS = [1, 15, 16, 17, 31, 32, 33, 700]  # 700: several flash-decoding partitions, ends mid-block
GROUPS = [1, 2, 4, 8, 16, 3, 6]
F16 = np.dtype(np.float16)


@pytest.fixture(scope="module")
def emu():
    return Emulator(build())


def backend(emu, num_sms=64):
    """num_sms=64 makes small grids split the context (flash-decoding path); num_sms=1 never splits."""
    return emulated_backend(emu, num_sms=num_sms)


def dev(a):
    """Host array -> the emulated backend's representation (bf16 as uint16 bits, shares memory)."""
    return a.view(np.uint16) if a.dtype == BF16 else a


def host(a, dtype):
    return a.view(BF16) if dtype == BF16 else a


def tol(act):
    if act == BF16:
        return dict(rtol=1e-2, atol=1e-2)
    if act == F16:
        return dict(rtol=2e-3, atol=2e-3)
    return dict(rtol=2e-4, atol=2e-5)


def _decode_case(rng, contexts, num_kv_heads, group, head_dim, block_size, cache_dtype):
    kc, vc, bt, keys, values = make_paged_kv(rng, contexts, num_kv_heads, head_dim, block_size, cache_dtype)
    q = rng.standard_normal((len(contexts), num_kv_heads * group, head_dim)).astype(np.float32)
    return kc, vc, bt, keys, values, q


# ------------------------------------------------------------------------------------------ decode
@pytest.mark.parametrize("cache_dtype", [np.float32, BF16], ids=["f32", "bf16"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", GROUPS)
def test_paged_attention_split_k_matches_cpu_and_float64(emu, cache_dtype, head_dim, group):
    rng = np.random.default_rng(group * 1000 + head_dim)
    num_kv_heads = 2
    kc, vc, bt, keys, values, q = _decode_case(rng, CONTEXTS, num_kv_heads, group, head_dim, 16, cache_dtype)
    ctx = np.array(CONTEXTS, np.int32)
    scale = head_dim**-0.5
    be = backend(emu)
    emu.launches.clear()
    out = np.full_like(q, np.nan)
    be.paged_attention(out, q, dev(kc), dev(vc), bt, ctx, scale)
    assert [n.split("<")[0] for n, *_ in emu.launches] == ["paged_attention_kernel", "paged_attention_reduce_kernel"]
    assert emu.launches[0][1][2] >= 4, "the long context should span several partitions"
    ref_cpu = np.full_like(q, np.nan)
    cpu_attention.paged_attention(ref_cpu, q, kc, vc, bt, ctx, scale)
    np.testing.assert_allclose(out, ref_cpu, rtol=2e-4, atol=2e-5)
    for s, c in enumerate(CONTEXTS):
        ref = attention_ref(q[s : s + 1], keys[s], values[s], scale)[0]
        np.testing.assert_allclose(out[s], ref, rtol=2e-4, atol=2e-5, err_msg=f"ctx={c}")


@pytest.mark.parametrize("group", GROUPS)
def test_paged_attention_single_partition_path(emu, group):
    """num_splits == 1: the decode kernel writes the output itself (no merge kernel)."""
    rng = np.random.default_rng(group)
    contexts = [1, 16, 17, 33, 200]
    kc, vc, bt, keys, values, q = _decode_case(rng, contexts, 3, group, 64, 16, np.float32)
    be = backend(emu, num_sms=1)
    emu.launches.clear()
    out = np.full_like(q, np.nan)
    be.paged_attention(out, q, kc, vc, bt, np.array(contexts, np.int32), 0.125)
    assert [n.split("<")[0] for n, *_ in emu.launches] == ["paged_attention_kernel"]
    for s in range(len(contexts)):
        ref = attention_ref(q[s : s + 1], keys[s], values[s], 0.125)[0]
        np.testing.assert_allclose(out[s], ref, rtol=2e-4, atol=2e-5)


def test_paged_attention_group_beyond_gmax_and_empty_context(emu):
    """Group 24 > GMAX 16 (two head chunks per KV head, the second partial), an empty context (zeros, as
    on the CPU), strided query/out views of a wider buffer, both kernel paths."""
    rng = np.random.default_rng(7)
    contexts = [0, 5, 300]
    group, head_dim = 24, 64
    kc, vc, bt, keys, values, q = _decode_case(rng, contexts, 1, group, head_dim, 16, np.float32)
    for num_sms in (1, 64):
        wide = np.full((len(contexts), group + 5, head_dim), np.nan, np.float32)
        out = wide[:, 2 : 2 + group]
        qwide = np.zeros((len(contexts), group + 3, head_dim), np.float32)
        qwide[:, 1 : 1 + group] = q
        backend(emu, num_sms).paged_attention(
            out, qwide[:, 1 : 1 + group], kc, vc, bt, np.array(contexts, np.int32), 0.1
        )
        np.testing.assert_array_equal(out[0], 0.0)
        for s in (1, 2):
            ref = attention_ref(q[s : s + 1], keys[s], values[s], 0.1)[0]
            np.testing.assert_allclose(out[s], ref, rtol=2e-4, atol=2e-5)
        assert np.isnan(wide[:, :2]).all() and np.isnan(wide[:, 2 + group :]).all(), "wrote outside the out view"


@pytest.mark.parametrize("act,cache", [(np.float32, F16), (F16, F16), (BF16, BF16)], ids=["f32-f16", "f16", "bf16"])
def test_paged_attention_half_precision_activations(emu, act, cache):
    rng = np.random.default_rng(11)
    contexts = [3, 16, 47, 400]
    kc, vc, bt, keys, values, q32 = _decode_case(rng, contexts, 2, 4, 128, 16, cache)
    q = q32.astype(act)
    out = np.full(q.shape, np.nan, np.float32).astype(act)
    backend(emu).paged_attention(dev(out), dev(q), dev(kc), dev(vc), bt, np.array(contexts, np.int32), 128**-0.5)
    for s in range(len(contexts)):
        ref = attention_ref(q[s : s + 1].astype(np.float64), keys[s], values[s], 128**-0.5)[0]
        np.testing.assert_allclose(out[s].astype(np.float64), ref, **tol(act))


@pytest.mark.parametrize("num_sms", [1, 64], ids=["one-partition", "split-k"])
@pytest.mark.parametrize("window", [1, 20, 300])
def test_paged_attention_sliding_window(emu, window, num_sms):
    """Windowed decode on both kernel paths: partitions cover only the window (positions before it hold
    NaN, so one read would show), merged by the reduce kernel over the window's partitions only."""
    rng = np.random.default_rng(window)
    contexts = [1, 17, 40, 700]
    kc, vc, bt, keys, values, q = _decode_case(rng, contexts, 2, 3, 64, 16, BF16)
    poison_before(kc, vc, bt, [max(0, c - window) for c in contexts])
    be = backend(emu, num_sms)
    emu.launches.clear()
    out = np.full_like(q, np.nan)
    be.paged_attention(out, q, dev(kc), dev(vc), bt, np.array(contexts, np.int32), 0.125, sliding_window=window)
    assert (len(emu.launches) == 2) == (num_sms == 64 and window == 300), [n for n, *_ in emu.launches]
    for s, c in enumerate(contexts):
        ref = attention_ref(q[s : s + 1], keys[s], values[s], 0.125, window=window)[0]
        np.testing.assert_allclose(out[s], ref, rtol=2e-4, atol=2e-5, err_msg=f"ctx={c}")


# ------------------------------------------------------------------------------------------ prefill
@pytest.mark.parametrize("window", [1, 8, 45])
def test_prefill_attention_sliding_window(emu, window):
    """Windowed prefill: full prompts longer than the window, a chunk after a prefix, a single token;
    the positions before the first new token's window hold NaN (the key loop starts at the window)."""
    rng = np.random.default_rng(window)
    seq_lens = [100, 70, 33, 9]
    new_tokens = [100, 20, 1, 9]
    kc, vc, bt, keys, values = make_paged_kv(rng, seq_lens, 2, 64, 16, np.float32)
    poison_before(kc, vc, bt, [max(0, s - n + 1 - window) for s, n in zip(seq_lens, new_tokens)])
    qsl = np.concatenate([[0], np.cumsum(new_tokens)]).astype(np.int32)
    q = rng.standard_normal((qsl[-1], 6, 64)).astype(np.float32)
    out = np.full_like(q, np.nan)
    lens = np.array(seq_lens, np.int32)
    backend(emu).prefill_attention(out, q, kc, vc, bt, qsl, lens, 0.125, sliding_window=window)
    assert_prefill_matches(out, q, qsl, seq_lens, keys, values, 0.125, window=window)


@pytest.mark.parametrize("cache_dtype", [np.float32, BF16], ids=["f32", "bf16"])
@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_prefill_attention_causal_chunked(emu, cache_dtype, block_size):
    """Full prefill, prefill after a cached prefix, and one-token chunks in one call (the CPU test's case)."""
    rng = np.random.default_rng(block_size)
    num_kv_heads, group, head_dim = 3, 3, 64
    seq_lens = [17, 33, 40, 1, 100, 16]
    new_tokens = [17, 1, 24, 1, 37, 16]
    kc, vc, bt, keys, values = make_paged_kv(rng, seq_lens, num_kv_heads, head_dim, block_size, cache_dtype)
    qsl = np.concatenate([[0], np.cumsum(new_tokens)]).astype(np.int32)
    q = rng.standard_normal((qsl[-1], num_kv_heads * group, head_dim)).astype(np.float32)
    out = np.full_like(q, np.nan)
    lens = np.array(seq_lens, np.int32)
    backend(emu).prefill_attention(out, q, dev(kc), dev(vc), bt, qsl, lens, head_dim**-0.5)
    ref_cpu = np.full_like(q, np.nan)
    cpu_attention.prefill_attention(ref_cpu, q, kc, vc, bt, qsl, lens, head_dim**-0.5)
    np.testing.assert_allclose(out, ref_cpu, rtol=2e-4, atol=2e-5)
    assert_prefill_matches(out, q, qsl, seq_lens, keys, values, head_dim**-0.5)


@pytest.mark.parametrize("num_kv_heads,group,head_dim", [(2, 1, 128), (1, 16, 64), (2, 6, 128), (1, 8, 64)])
def test_prefill_attention_gqa_shapes(emu, num_kv_heads, group, head_dim):
    """Tile geometry across GQA groups: 64 tokens x 1 head ... 4 tokens x 16 heads per tile, partial
    tiles, several key tiles, a 2-token chunk after a prefix that ends mid-block."""
    rng = np.random.default_rng(group * 10 + head_dim)
    seq_lens = [70, 37, 9]
    new_tokens = [70, 2, 9]
    kc, vc, bt, keys, values = make_paged_kv(rng, seq_lens, num_kv_heads, head_dim, 16, BF16)
    qsl = np.concatenate([[0], np.cumsum(new_tokens)]).astype(np.int32)
    q = rng.standard_normal((qsl[-1], num_kv_heads * group, head_dim)).astype(np.float32)
    out = np.full_like(q, np.nan)
    backend(emu).prefill_attention(out, q, dev(kc), dev(vc), bt, qsl, np.array(seq_lens, np.int32), 0.1)
    assert_prefill_matches(out, q, qsl, seq_lens, keys, values, 0.1)


def test_prefill_attention_group_larger_than_a_tile(emu):
    """Group 80 > 64 rows per tile: two head chunks per KV head, one token per tile."""
    rng = np.random.default_rng(80)
    seq_lens = [5, 3]  # 3 new tokens each
    kc, vc, bt, keys, values = make_paged_kv(rng, seq_lens, 1, 64, 8, np.float32)
    qsl = np.array([0, 3, 6], np.int32)
    q = rng.standard_normal((6, 80, 64)).astype(np.float32)
    out = np.full_like(q, np.nan)
    backend(emu).prefill_attention(out, q, kc, vc, bt, qsl, np.array(seq_lens, np.int32), 0.125)
    assert_prefill_matches(out, q, qsl, seq_lens, keys, values, 0.125)


@pytest.mark.parametrize("act", [F16, BF16], ids=["f16", "bf16"])
def test_prefill_attention_half_precision(emu, act):
    rng = np.random.default_rng(5)
    seq_lens = [20, 45]  # 20 and 13 new tokens
    kc, vc, bt, keys, values = make_paged_kv(rng, seq_lens, 2, 128, 16, act)
    qsl = np.array([0, 20, 33], np.int32)
    q = rng.standard_normal((33, 4, 128)).astype(np.float32).astype(act)
    out = np.full(q.shape, np.nan, np.float32).astype(act)
    # Device-side query_start_loc/seq_lens: no host validation, max_query_len given explicitly.
    backend(emu).prefill_attention(
        dev(out), dev(q), dev(kc), dev(vc), bt, qsl, np.array(seq_lens, np.int32), 128**-0.5, max_query_len=20
    )
    assert_prefill_matches(out, q, qsl, seq_lens, keys, values, 128**-0.5, **tol(act))


# ------------------------------------------------------------------------------------------ caches
@pytest.mark.parametrize(
    "act,cache",
    [(np.float32, np.float32), (np.float32, BF16), (np.float32, F16), (BF16, BF16), (F16, F16)],
    ids=["f32", "f32-bf16", "f32-f16", "bf16", "f16"],
)
def test_reshape_and_cache_writes_slots_and_skips_padding(emu, act, cache):
    rng = np.random.default_rng(0)
    num_blocks, block_size, H, D = 9, 16, 3, 64
    kc = np.full((num_blocks, block_size, H, D), np.nan, np.float32).astype(cache)
    vc = kc.copy()
    slots = rng.permutation(num_blocks * block_size)[:40].astype(np.int64)
    slots[[3, 17]] = -1
    # key/value as views into a fused [tokens, (Hq + 2 Hkv) * D] projection output (token stride != H * D).
    qkv = rng.standard_normal((40, (5 + 2 * H) * D)).astype(np.float32).astype(act)
    key = qkv[:, 5 * D : (5 + H) * D].reshape(40, H, D)
    value = qkv[:, (5 + H) * D :].reshape(40, H, D)
    backend(emu).reshape_and_cache(dev(key), dev(value), dev(kc), dev(vc), slots)
    assert_cache_rows_written(kc, vc, key, value, slots)


@pytest.mark.parametrize(
    "act,cache",
    [(np.float32, np.float32), (np.float32, BF16), (np.float32, F16), (BF16, BF16), (F16, F16)],
    ids=["f32", "f32-bf16", "f32-f16", "bf16", "f16"],
)
def test_rotary_embedding_and_cache_equals_the_two_kernels_it_fuses(emu, act, cache):
    """The fused kernel against rotary_embedding_kernel + reshape_and_cache_kernel (bit for bit: query and
    both caches) and against float64 RoPE; -1 slots rotate the query and write nothing; the key and value
    inputs (views into a fused QKV output) are left as they were."""
    rng = np.random.default_rng(4)
    num_blocks, block_size, Hq, H, D, T, theta = 6, 16, 6, 2, 64, 20, 10000.0
    cos_sin = rope_cache(D, 300, theta)
    pos = rng.integers(0, 300, T).astype(np.int64)
    slots = rng.permutation(num_blocks * block_size)[:T].astype(np.int64)
    slots[[2, 11]] = -1
    qkv = rng.standard_normal((T, (Hq + 2 * H) * D)).astype(np.float32).astype(act)

    def views(a):
        return (
            a[:, : Hq * D].reshape(T, Hq, D),
            a[:, Hq * D : (Hq + H) * D].reshape(T, H, D),
            a[:, (Hq + H) * D :].reshape(T, H, D),
        )

    nan_cache = np.full((num_blocks, block_size, H, D), np.nan, np.float32).astype(cache)
    be = backend(emu)
    fused_qkv = qkv.copy()
    fq, fk, fv = views(fused_qkv)
    kc, vc = nan_cache.copy(), nan_cache.copy()
    emu.launches.clear()
    be.rotary_embedding_and_cache(pos, dev(fq), dev(fk), dev(fv), dev(kc), dev(vc), slots, cos_sin)
    assert [n.split("<")[0] for n, *_ in emu.launches] == ["rotary_embedding_and_cache_kernel"]
    np.testing.assert_array_equal(fused_qkv[:, Hq * D :].view(np.uint8), qkv[:, Hq * D :].view(np.uint8))

    two_qkv = qkv.copy()
    q2, k2, v2 = views(two_qkv)
    kc2, vc2 = nan_cache.copy(), nan_cache.copy()
    be.rotary_embedding(pos, dev(q2), dev(k2), cos_sin)
    be.reshape_and_cache(dev(k2), dev(v2), dev(kc2), dev(vc2), slots)
    np.testing.assert_array_equal(fused_qkv[:, : Hq * D].view(np.uint8), two_qkv[:, : Hq * D].view(np.uint8))
    np.testing.assert_array_equal(kc.view(np.uint8), kc2.view(np.uint8))
    np.testing.assert_array_equal(vc.view(np.uint8), vc2.view(np.uint8))

    q0, k0, v0 = views(qkv)
    np.testing.assert_allclose(fq.astype(np.float64), rope_ref(q0, pos, theta), **tol(act))
    assert_cache_rows_written(kc, vc, k2, v0, slots)  # the rotated key rows, in their slots only
    rotated = rope_ref(k0, pos, theta)
    for t in np.flatnonzero(slots >= 0):
        b, o = divmod(int(slots[t]), block_size)
        np.testing.assert_allclose(kc[b, o].astype(np.float64), rotated[t], **tol(cache if act == np.float32 else act))


def test_bf16_rounding_is_nearest_even(emu):
    vals = np.array([1.0, 1.00390625, 1.01171875, -3.3e38, 1e-40, 65504.0, np.inf, -np.inf], np.float32)
    key = np.tile(vals[:, None, None], (1, 1, 2)).astype(np.float32)
    kc = np.zeros((1, 8, 1, 2), np.uint16)
    vc = np.zeros_like(kc)
    backend(emu).reshape_and_cache(key, key, kc, vc, np.arange(8, dtype=np.int64))
    np.testing.assert_array_equal(kc[0, :, 0, 0], vals.astype(BF16).view(np.uint16))


@pytest.mark.parametrize(
    "dtype,shape",
    [(np.float32, (10, 16, 3, 64)), (BF16, (10, 16, 2, 128)), (F16, (10, 3, 1, 6)), (F16, (10, 1, 1, 3))],
    ids=["f32-w16", "bf16-w16", "f16-w4", "f16-w2"],
)
def test_copy_blocks_all_layers_one_launch(emu, dtype, shape):
    rng = np.random.default_rng(1)
    kcs = [rng.standard_normal(shape).astype(np.float32).astype(dtype) for _ in range(3)]
    vcs = [rng.standard_normal(shape).astype(np.float32).astype(dtype) for _ in range(3)]
    mapping = np.array([[2, 7], [5, 1], [2, 9]], np.int64)
    exp_k, exp_v = copy_blocks_expected(kcs, mapping), copy_blocks_expected(vcs, mapping)
    emu.launches.clear()
    backend(emu).copy_blocks([dev(k) for k in kcs], [dev(v) for v in vcs], mapping)
    assert len(emu.launches) == 1
    for layer in range(3):
        np.testing.assert_array_equal(kcs[layer].view(np.uint8), exp_k[layer].view(np.uint8))
        np.testing.assert_array_equal(vcs[layer].view(np.uint8), exp_v[layer].view(np.uint8))


# ------------------------------------------------------------------------------------------ quantized caches
QKINDS = [INT8, FP8_E4M3]
QIDS = ["int8", "fp8"]


def _qcache(shape, kind, poison=True):
    """A QuantizedKVCache of host arrays; values 0x55 and NaN scales where nothing was written."""
    fill = 0x55 if poison else 0
    return QuantizedKVCache(
        np.full(shape, fill, kind.storage), np.full(shape[:3], np.nan if poison else 0, np.float32), kind
    )


@pytest.mark.parametrize("kind", QKINDS, ids=QIDS)
@pytest.mark.parametrize("act", [np.float32, BF16, F16], ids=["f32", "bf16", "f16"])
def test_quantized_reshape_and_cache_equals_the_float64_quantizer(emu, act, kind):
    """Each written row against the reference quantizer of the activation-dtype input (nearest values, either
    side of a tie; scales to float32 rounding), other slots untouched; float32 inputs give the CPU kernel's
    values (one code apart at most, at ties)."""
    rng = np.random.default_rng(3)
    num_blocks, block_size, H, D = 6, 16, 3, 64
    slots = rng.permutation(num_blocks * block_size)[:30].astype(np.int64)
    slots[[1, 9]] = -1
    qkv = (rng.standard_normal((30, 8 * D)) * rng.uniform(0.01, 20, (30, 1))).astype(np.float32).astype(act)
    key, value = qkv[:, 2 * D : 5 * D].reshape(30, H, D), qkv[:, 5 * D :].reshape(30, H, D)
    kc, vc = _qcache((num_blocks, block_size, H, D), kind), _qcache((num_blocks, block_size, H, D), kind)
    emu.launches.clear()
    backend(emu).reshape_and_cache(dev(key), dev(value), kc, vc, slots)
    assert [n.split("<")[0] for n, *_ in emu.launches] == ["reshape_and_cache_kernel"]
    w = slots >= 0
    b, o = slots[w] // block_size, slots[w] % block_size
    for cache, rows in ((kc, key), (vc, value)):
        assert_rows_quantized(cache.data[b, o], cache.scales[b, o], rows[w].astype(np.float32), kind)
        hole = np.ones((num_blocks, block_size), bool)
        hole[b, o] = False
        assert (cache.data[hole] == 0x55).all() and np.isnan(cache.scales[hole]).all()
    if act == np.float32:
        kc2, vc2 = _qcache(kc.shape, kind), _qcache(kc.shape, kind)
        cpu_cache.reshape_and_cache(np.ascontiguousarray(key), np.ascontiguousarray(value), kc2, vc2, slots)
        for a, c in ((kc, kc2), (vc, vc2)):
            step = np.abs(a.data[b, o].astype(int) - c.data[b, o].astype(int))
            assert step.max() <= 1 and (step == 0).mean() > 0.999
            np.testing.assert_allclose(a.scales[b, o], c.scales[b, o], rtol=1e-6)


@pytest.mark.parametrize("kind", QKINDS, ids=QIDS)
@pytest.mark.parametrize("act", [np.float32, BF16], ids=["f32", "bf16"])
def test_quantized_rotary_embedding_and_cache_equals_the_two_kernels(emu, act, kind):
    """The fused RoPE + quantizing cache write against rotary_embedding then reshape_and_cache, bit for bit
    (query, values and scales); the key and value inputs are left as they were."""
    rng = np.random.default_rng(6)
    num_blocks, block_size, Hq, H, D, T = 5, 16, 6, 2, 128, 18
    cos_sin = rope_cache(D, 300, 10000.0)
    pos = rng.integers(0, 300, T).astype(np.int64)
    slots = rng.permutation(num_blocks * block_size)[:T].astype(np.int64)
    slots[[3]] = -1
    qkv = rng.standard_normal((T, (Hq + 2 * H) * D)).astype(np.float32).astype(act)

    def views(a):
        return (
            a[:, : Hq * D].reshape(T, Hq, D),
            a[:, Hq * D : (Hq + H) * D].reshape(T, H, D),
            a[:, (Hq + H) * D :].reshape(T, H, D),
        )

    be = backend(emu)
    fused_qkv, two_qkv = qkv.copy(), qkv.copy()
    shape = (num_blocks, block_size, H, D)
    kc, vc, kc2, vc2 = (_qcache(shape, kind) for _ in range(4))
    fq, fk, fv = views(fused_qkv)
    be.rotary_embedding_and_cache(pos, dev(fq), dev(fk), dev(fv), kc, vc, slots, cos_sin)
    q2, k2, v2 = views(two_qkv)
    be.rotary_embedding(pos, dev(q2), dev(k2), cos_sin)
    be.reshape_and_cache(dev(k2), dev(v2), kc2, vc2, slots)
    np.testing.assert_array_equal(fused_qkv[:, : Hq * D].view(np.uint8), two_qkv[:, : Hq * D].view(np.uint8))
    np.testing.assert_array_equal(fused_qkv[:, Hq * D :].view(np.uint8), qkv[:, Hq * D :].view(np.uint8))
    for a, c in ((kc, kc2), (vc, vc2)):
        np.testing.assert_array_equal(a.data, c.data)
        np.testing.assert_array_equal(a.scales.view(np.uint32), c.scales.view(np.uint32))


@pytest.mark.parametrize("kind", QKINDS, ids=QIDS)
@pytest.mark.parametrize("head_dim,group", [(64, 3), (128, 1), (64, 8)])
def test_paged_attention_on_quantized_blocks_matches_cpu_and_float64(emu, kind, head_dim, group):
    """Split-K decode over quantized caches (the reference quantizer's rows; NaN scales where unused) against
    the CPU kernel and float64 attention over the values the cache holds."""
    rng = np.random.default_rng(head_dim + group)
    contexts = [1, 16, 17, 33, 700]
    kf, vf, bt, _, _ = make_paged_kv(rng, contexts, 2, head_dim, 16, np.float32)
    kc, vc, keys, values = quantized_paged_kv(kf, vf, bt, contexts, kind)
    q = rng.standard_normal((len(contexts), 2 * group, head_dim)).astype(np.float32)
    ctx = np.array(contexts, np.int32)
    out, ref_cpu = np.full_like(q, np.nan), np.full_like(q, np.nan)
    emu.launches.clear()
    backend(emu).paged_attention(out, q, kc, vc, bt, ctx, head_dim**-0.5)
    assert (
        emu.launches[0][0]
        == f"paged_attention_kernel<float, {kind.cxx}, {head_dim}, {1 if group == 1 else 4 if group == 3 else 8}>"
    )
    cpu_attention.paged_attention(ref_cpu, q, kc, vc, bt, ctx, head_dim**-0.5)
    np.testing.assert_allclose(out, ref_cpu, rtol=2e-4, atol=2e-5)
    for s in range(len(contexts)):
        ref = attention_ref(q[s : s + 1], keys[s], values[s], head_dim**-0.5)[0]
        np.testing.assert_allclose(out[s], ref, rtol=2e-4, atol=2e-5)


@pytest.mark.parametrize("kind", QKINDS, ids=QIDS)
@pytest.mark.parametrize("act", [np.float32, BF16], ids=["f32", "bf16"])
def test_prefill_attention_on_quantized_blocks(emu, kind, act):
    rng = np.random.default_rng(9)
    seq_lens = [17, 33, 70, 1]
    new_tokens = [17, 1, 40, 1]
    kf, vf, bt, _, _ = make_paged_kv(rng, seq_lens, 3, 64, 16, np.float32)
    kc, vc, keys, values = quantized_paged_kv(kf, vf, bt, seq_lens, kind)
    qsl = np.concatenate([[0], np.cumsum(new_tokens)]).astype(np.int32)
    q = rng.standard_normal((qsl[-1], 6, 64)).astype(np.float32).astype(act)
    out = np.full(q.shape, np.nan, np.float32).astype(act)
    lens = np.array(seq_lens, np.int32)
    backend(emu).prefill_attention(dev(out), dev(q), kc, vc, bt, qsl, lens, 0.125, sliding_window=24)
    assert_prefill_matches(out, q, qsl, seq_lens, keys, values, 0.125, window=24, **tol(act))


@pytest.mark.parametrize("kind", QKINDS, ids=QIDS)
def test_copy_blocks_moves_quantized_values_and_scales(emu, kind):
    rng = np.random.default_rng(2)
    layers = [
        QuantizedKVCache(
            rng.integers(0, 120, (10, 16, 2, 64)).astype(kind.storage), rng.random((10, 16, 2), np.float32), kind
        )
        for _ in range(4)
    ]
    mapping = np.array([[2, 7], [5, 1]], np.int64)
    want_d = copy_blocks_expected([c.data for c in layers], mapping)
    want_s = copy_blocks_expected([c.scales for c in layers], mapping)
    emu.launches.clear()
    backend(emu).copy_blocks(layers[:2], layers[2:], mapping)
    assert len(emu.launches) == 2  # the values, then the scales
    for c, d, sc in zip(layers, want_d, want_s):
        np.testing.assert_array_equal(c.data, d)
        np.testing.assert_array_equal(c.scales, sc)


# ------------------------------------------------------------------------------------------ dense layers
def test_rms_norm_rotary_silu_against_float64_and_cpu(emu):
    be = backend(emu)
    rng = np.random.default_rng(2)
    x = rng.standard_normal((5, 576)).astype(np.float32)
    res = rng.standard_normal((5, 576)).astype(np.float32)
    w = rng.standard_normal(576).astype(np.float32)
    ref, _ = rms_norm_ref(x, w, 1e-5, residual=res)
    res_in = res.copy()
    out = be.rms_norm(x, w, 1e-5, residual=res_in)
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(res_in, x + res)
    plain = be.rms_norm(x, w, 1e-5)
    np.testing.assert_allclose(plain, cpu_elementwise.rms_norm(x, w, 1e-5), rtol=1e-5, atol=1e-6)

    D, theta = 64, 100000.0
    cache = rope_cache(D, 50, theta)
    pos = np.array([0, 3, 49, 7], np.int64)
    qkv = rng.standard_normal((4, (9 + 3 + 3) * D)).astype(np.float32)
    q = qkv[:, : 9 * D].reshape(4, 9, D)  # views into a fused projection: token stride (9+3+3)*D
    k = qkv[:, 9 * D : 12 * D].reshape(4, 3, D)
    v_before = qkv[:, 12 * D :].copy()

    rq, rk = rope_ref(q, pos, theta), rope_ref(k, pos, theta)
    be.rotary_embedding(pos, q, k, cache)
    np.testing.assert_allclose(q, rq, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(k, rk, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(qkv[:, 12 * D :], v_before)

    g = rng.standard_normal((3, 2 * 300)).astype(np.float32)
    gd = g.astype(np.float64)
    np.testing.assert_allclose(
        be.silu_and_mul(g), gd[:, :300] / (1 + np.exp(-gd[:, :300])) * gd[:, 300:], rtol=1e-5, atol=1e-6
    )


@pytest.mark.parametrize("act", [F16, BF16], ids=["f16", "bf16"])
def test_dense_layers_half_precision(emu, act):
    be = backend(emu)
    rng = np.random.default_rng(3)
    x = rng.standard_normal((4, 200)).astype(np.float32).astype(act)
    res = rng.standard_normal((4, 200)).astype(np.float32).astype(act)
    res_in = res.copy()
    for w in (rng.standard_normal(200).astype(np.float32).astype(act), rng.standard_normal(200).astype(np.float32)):
        res_in = res.copy()
        out = host(be.rms_norm(dev(x), dev(w), 1e-6, residual=dev(res_in)), act)
        summed = (x.astype(np.float32) + res.astype(np.float32)).astype(act)
        np.testing.assert_array_equal(res_in.view(np.uint16), summed.view(np.uint16))  # one rounding, like T(x + r)
        ref, _ = rms_norm_ref(summed.astype(np.float32), w.astype(np.float32), 1e-6)
        np.testing.assert_allclose(out.astype(np.float64), ref, **tol(act))
    g = rng.standard_normal((3, 64)).astype(np.float32).astype(act)
    gd = g.astype(np.float64)
    np.testing.assert_allclose(
        host(be.silu_and_mul(dev(g)), act).astype(np.float64),
        gd[:, :32] / (1 + np.exp(-gd[:, :32])) * gd[:, 32:],
        **tol(act),
    )
    ang = np.arange(10)[:, None] * 0.3 ** np.arange(16)[None]
    cache = np.concatenate([np.cos(ang), np.sin(ang)], -1).astype(np.float32)
    q = rng.standard_normal((2, 2, 32)).astype(np.float32).astype(act)
    k = rng.standard_normal((2, 1, 32)).astype(np.float32).astype(act)
    pos = np.array([9, 4], np.int64)
    q64, k64 = q.astype(np.float64), k.astype(np.float64)
    be.rotary_embedding(pos, dev(q), dev(k), cache)
    for before, after in ((q64, q), (k64, k)):
        cos = np.concatenate([np.cos(ang[pos])] * 2, -1)[:, None]
        sin = np.concatenate([np.sin(ang[pos])] * 2, -1)[:, None]
        rot = np.concatenate([-before[..., 16:], before[..., :16]], -1)
        np.testing.assert_allclose(after.astype(np.float64), before * cos + rot * sin, **tol(act))


@pytest.mark.parametrize("act", [np.float32, F16, BF16], ids=["f32", "f16", "bf16"])
def test_gelu_tanh_and_mul_against_float64_and_cpu(emu, act):
    """GeGLU (PyTorch's tanh GeLU) on gates from -12 to 12, every activation dtype."""
    be = backend(emu)
    rng = np.random.default_rng(4)
    g = (rng.standard_normal((5, 2 * 300)) * 4).astype(np.float32)
    g[0, :300] = np.linspace(-12, 12, 300)
    g = g.astype(act)
    gd = g.astype(np.float64)
    ref = 0.5 * gd[:, :300] * (1 + np.tanh(np.sqrt(2 / np.pi) * (gd[:, :300] + 0.044715 * gd[:, :300] ** 3)))
    got = host(be.gelu_tanh_and_mul(dev(g)), act).astype(np.float64)
    np.testing.assert_allclose(
        got, ref * gd[:, 300:], **(tol(act) if act != np.float32 else dict(rtol=1e-5, atol=1e-5))
    )
    if act == np.float32:
        np.testing.assert_allclose(got, cpu_elementwise.gelu_tanh_and_mul(g), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("act", [np.float32, F16, BF16], ids=["f32", "f16", "bf16"])
def test_embedding_scale_rounds_the_scale_and_each_product_to_the_dtype(emu, act):
    """HF's Gemma normalizer: rows times sqrt(hidden) rounded to the rows' dtype, each product rounded."""
    be = backend(emu)
    rng = np.random.default_rng(5)
    table = rng.standard_normal((11, 48)).astype(np.float32).astype(act)
    ids = np.array([3, 0, 10, 3], np.int64)
    got = host(be.embedding(ids, dev(table), scale=48**0.5), act)
    s = np.asarray(48**0.5, np.float32).astype(act).astype(np.float32)
    want = (table[ids].astype(np.float32) * s).astype(act)
    np.testing.assert_array_equal(got.view(np.uint16 if act != np.float32 else np.uint32),
                                  want.view(np.uint16 if act != np.float32 else np.uint32))  # fmt: skip
    np.testing.assert_array_equal(host(be.embedding(ids, dev(table)), act), table[ids])


@pytest.mark.parametrize("num_sms", [1, 64], ids=["one-partition", "split-k"])
@pytest.mark.parametrize("window", [None, 20])
def test_paged_attention_logits_soft_cap(emu, window, num_sms):
    """Gemma 2's soft-cap on both decode paths, against the CPU kernel and float64."""
    rng = np.random.default_rng(11)
    contexts = [1, 17, 40, 700]
    kc, vc, bt, keys, values, q = _decode_case(rng, contexts, 2, 3, 64, 16, BF16)
    q *= 3  # scores well past the cap
    lens = np.array(contexts, np.int32)
    out = np.full_like(q, np.nan)
    backend(emu, num_sms).paged_attention(
        out, q, dev(kc), dev(vc), bt, lens, 0.125, sliding_window=window, logits_soft_cap=2.0
    )
    cpu = np.full_like(q, np.nan)
    cpu_attention.paged_attention(cpu, q, kc, vc, bt, lens, 0.125, sliding_window=window, logits_soft_cap=2.0)
    np.testing.assert_allclose(out, cpu, rtol=2e-4, atol=2e-5)
    for s, c in enumerate(contexts):
        ref = attention_ref(q[s : s + 1], keys[s], values[s], 0.125, window=window, soft_cap=2.0)[0]
        np.testing.assert_allclose(out[s], ref, rtol=2e-4, atol=2e-5, err_msg=f"ctx={c}")


@pytest.mark.parametrize("group", [1, 2, 4, 6])
def test_head_dim_256_decode_and_prefill(emu, group):
    """Gemma's head size: decode (GMAX up to 4; a group of 6 in two chunks) on both paths and prefill, with
    a window and a soft-cap, against float64."""
    rng = np.random.default_rng(group)
    contexts = [1, 40, 300]
    kc, vc, bt, keys, values, q = _decode_case(rng, contexts, 2, group, 256, 16, BF16)
    lens = np.array(contexts, np.int32)
    for num_sms in (1, 64):
        out = np.full_like(q, np.nan)
        backend(emu, num_sms).paged_attention(
            out, q, dev(kc), dev(vc), bt, lens, 0.0625, sliding_window=32, logits_soft_cap=1.5
        )
        for s, c in enumerate(contexts):
            ref = attention_ref(q[s : s + 1], keys[s], values[s], 0.0625, window=32, soft_cap=1.5)[0]
            np.testing.assert_allclose(out[s], ref, rtol=2e-4, atol=2e-5, err_msg=f"ctx={c} num_sms={num_sms}")
    new_tokens = [1, 40, 45]
    qsl = np.concatenate([[0], np.cumsum(new_tokens)]).astype(np.int32)
    qp = rng.standard_normal((qsl[-1], 2 * group, 256)).astype(np.float32)
    out = np.full_like(qp, np.nan)
    backend(emu).prefill_attention(out, qp, dev(kc), dev(vc), bt, qsl, lens, 0.0625, sliding_window=32)
    assert_prefill_matches(out, qp, qsl, contexts, keys, values, 0.0625, window=32)


@pytest.mark.parametrize("window", [None, 8])
def test_prefill_attention_logits_soft_cap(emu, window):
    rng = np.random.default_rng(12)
    seq_lens = [100, 70, 33, 9]
    new_tokens = [100, 20, 1, 9]
    kc, vc, bt, keys, values = make_paged_kv(rng, seq_lens, 2, 64, 16, np.float32)
    qsl = np.concatenate([[0], np.cumsum(new_tokens)]).astype(np.int32)
    q = (rng.standard_normal((qsl[-1], 6, 64)) * 3).astype(np.float32)
    out = np.full_like(q, np.nan)
    lens = np.array(seq_lens, np.int32)
    backend(emu).prefill_attention(out, q, kc, vc, bt, qsl, lens, 0.125, sliding_window=window, logits_soft_cap=3.0)
    assert_prefill_matches(out, q, qsl, seq_lens, keys, values, 0.125, window=window, soft_cap=3.0)


# ------------------------------------------------------------------------------------------ sampling
@pytest.mark.parametrize("staged", [True, False], ids=["smem", "global"])
@pytest.mark.parametrize("act", [np.float32, F16, BF16], ids=["f32", "f16", "bf16"])
@pytest.mark.parametrize("vocab", [1, 37, 1000, 5003])
def test_sample_kernel_matches_the_cpu_reference(emu, act, vocab, staged):
    """Greedy, temperature, top-k, top-p, min-p and their combinations; one row of integer logits (ties at
    every threshold); bf16 rows are full of ties too. Exact ids wherever the reference is not on a
    rounding boundary, and those must be the large majority. Probabilities staged in shared memory (a
    row fits) and in the global workspace (a device with less shared memory than a row needs)."""
    rng = np.random.default_rng(vocab)
    logits = (rng.standard_normal((3, vocab)) * 3).astype(np.float32)
    logits[2] = np.round(logits[2])
    logits = logits.astype(act)
    args = sample_args(3, SAMPLE_CASES, rng)
    be = backend(emu)
    if not staged:
        be.max_smem_optin = 4 * vocab - 4
    emu.launches.clear()
    got = be.sample(dev(logits), **args)
    assert [n for n, *_ in emu.launches] == [
        f"sample_kernel<{program.F32 if act == np.float32 else program.F16 if act == F16 else program.BF16}>"
    ]
    assert emu.launches[0][3] == (4 * vocab if staged else 0)
    assert got.dtype == np.int64 and ((got >= 0) & (got < vocab)).all()
    assert_draws_match(got, logits.astype(np.float32), args, min_stable=0.9)
    greedy = args["temperature"] == 0
    np.testing.assert_array_equal(got[greedy], logits.astype(np.float32)[args["sample_rows"][greedy]].argmax(-1))


@pytest.mark.parametrize("vocab", [57_000, 58_000])
def test_sample_kernel_near_the_shared_memory_limit(emu, vocab):
    """On Hopper's 227 KiB opt-in, a 57k row is staged in shared memory and a 58k row (whose 232000 bytes
    fit only without the kernel's static scratch) goes to the global workspace; either launch asks for
    no more than the device allows, and draws follow the reference."""
    rng = np.random.default_rng(vocab)
    logits = (rng.standard_normal((2, vocab)) * 3).astype(np.float32)
    args = sample_args(2, SAMPLE_CASES[:4], rng)
    be = backend(emu)
    be.max_smem_optin = 227 * 1024
    emu.launches.clear()
    got = be.sample(dev(logits), **args)
    smem = emu.launches[0][3]
    assert smem == (4 * vocab if vocab == 57_000 else 0)
    assert smem + launch_config.SAMPLE_STATIC_SMEM_BYTES <= be.max_smem_optin
    assert_draws_match(got, logits, args)  # float32 sums over 57k+ terms: more draws near a boundary


@pytest.mark.parametrize("act", [np.float32, F16, BF16], ids=["f32", "f16", "bf16"])
def test_apply_token_bitmask_kernel_matches_the_cpu_kernel(emu, act):
    """Structured outputs' mask on a padded logits view (row stride > vocab): the same -inf positions as
    the CPU kernel, rows without a mask untouched bit for bit, tokens past the mask's words forbidden."""
    rng = np.random.default_rng(13)
    vocab = 1000  # 31 words cover 992 ids: 992..999 are past the mask
    padded = rng.standard_normal((4, vocab + 24)).astype(np.float32).astype(act)
    logits = padded[:, :vocab]
    bitmask = rng.integers(-(2**31), 2**31, size=(2, 31), dtype=np.int64).astype(np.int32)
    rows = np.array([2, 0])
    before = padded.copy()
    backend(emu).apply_token_bitmask(dev(logits), bitmask, rows)
    expected = before[:, :vocab].astype(np.float32)
    cpu_sampling.apply_token_bitmask(expected, bitmask, rows)
    got = padded[:, :vocab].astype(np.float32)
    np.testing.assert_array_equal(np.isneginf(got), np.isneginf(expected))
    np.testing.assert_array_equal(got[~np.isneginf(got)], expected[~np.isneginf(expected)])
    assert np.isneginf(got[2, 992:]).all() and not np.isneginf(got[[1, 3]]).any()
    np.testing.assert_array_equal(padded[:, vocab:].view(np.uint8), before[:, vocab:].view(np.uint8))


@pytest.mark.parametrize("act", [np.float32, F16, BF16], ids=["f32", "f16", "bf16"])
def test_apply_logits_edits_kernel_matches_the_cpu_kernel(emu, act):
    """Penalties, bias and bans (``LogitsEdits`` from random rules and histories, long enough segments that
    threads stride) on a padded logits view: the CPU kernel's values (float32: equal to rounding; half
    types: as float32 then rounded), unedited rows and the padding untouched."""
    from rawpaged.model_executor.logits_processors import build_edits, logits_rules
    from rawpaged.sampling_params import SamplingParams

    rng = np.random.default_rng(21)
    vocab = 1000
    padded = rng.normal(0, 3, size=(5, vocab + 24)).astype(np.float32).astype(act)
    logits = padded[:, :vocab]
    entries = []
    for row, kw in ((0, dict(repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=-0.25)),
                    (3, dict(logit_bias={int(t): 1.5 for t in rng.choice(vocab, 300, replace=False)},
                             min_tokens=400, max_tokens=512, repetition_penalty=0.8)),
                    (4, dict(presence_penalty=1.0))):  # fmt: skip
        params = SamplingParams(**kw)
        rules = logits_rules(params, rng.integers(0, vocab, 400).tolist(), None, vocab, {0, 1})
        entries.append((row, rules, rng.integers(0, 600, 300).tolist()))
    edits = build_edits(entries)
    before = padded.copy()
    backend(emu).apply_logits_edits(dev(logits), edits)
    expected = before[:, :vocab].astype(np.float32)
    cpu_sampling.apply_logits_edits(expected, edits)
    got = padded[:, :vocab].astype(np.float32)
    if act != np.float32:  # the device rounds each edit to the activation type
        expected = expected.astype(act).astype(np.float32)
    np.testing.assert_array_equal(np.isneginf(got), np.isneginf(expected))
    finite = np.isfinite(expected)
    # half types round after each of the three segments: an ulp of the intermediate value (|x| < 16)
    atol = {np.dtype(np.float32): 1e-5, F16: 1e-2, BF16: 1e-1}[np.dtype(act)]
    np.testing.assert_allclose(got[finite], expected[finite], rtol=1e-6 if act == np.float32 else 1e-2, atol=atol)
    np.testing.assert_array_equal(got[[1, 2]], before[[1, 2], :vocab].astype(np.float32))
    np.testing.assert_array_equal(padded[:, vocab:].view(np.uint8), before[:, vocab:].view(np.uint8))
    assert np.isneginf(got[3, [0, 1]]).all() and not np.isneginf(got[[0, 4]]).any()


@pytest.mark.parametrize("act", [np.float32, F16, BF16], ids=["f32", "f16", "bf16"])
def test_logprobs_kernel_matches_the_cpu_reduction(emu, act):
    """Prompt logprobs' reduction on a padded logits view (ties at the top and at the target, a NaN, a row where
    the target is the maximum, k = 0, 1, 5, 20): the same top ids in the same order and the same ranks as the CPU
    kernel, logprobs within float32 summation order; the logits are left as they were."""
    from rawpaged.kernels.cpu import logprobs as cpu_logprobs

    rng = np.random.default_rng(5)
    vocab = 3000
    padded = rng.normal(0, 4, size=(6, vocab + 24)).astype(np.float32).astype(act)
    logits = padded[:, :vocab]
    logits[0, [10, 20, 30]] = logits[0].max() + 1  # a three-way tie at the top: lower ids first
    logits[1, 2999] = np.nan  # never a top id
    logits[2, [5, 6, 7]] = logits[2].max() + 1  # the target ties with two others at the top: all three count
    targets = np.array([20, 3, 7, 0, int(np.argmax(logits[4].astype(np.float32))), 2999])
    before = padded.copy()
    for k in (0, 1, 5, 20):
        got = backend(emu).logprob_rows(dev(logits), targets, k)
        want = cpu_logprobs.logprob_rows(logits.astype(np.float32), targets, k)
        np.testing.assert_array_equal(got[1], want[1])
        np.testing.assert_array_equal(got[2], want[2])
        for g, w in ((got[0], want[0]), (got[3], want[3])):
            assert g.dtype == np.float64 and g.shape == w.shape
            np.testing.assert_allclose(g[np.isfinite(w)], w[np.isfinite(w)], atol=1e-5)
        np.testing.assert_array_equal(padded.view(np.uint8), before.view(np.uint8))
    assert got[2][0, :3].tolist() == [10, 20, 30] and got[1][0] == 3 and got[1][2] == 3
    assert got[1][4] == 1 and 2999 not in got[2][1]
    with pytest.raises(ValueError, match="vocabulary"):
        backend(emu).logprob_rows(dev(logits), np.array([0, 0, 0, 0, 0, vocab]), 1)


def test_sample_kernel_draws_follow_the_filtered_distribution(emu):
    """Stratified uniforms through the kernel: each kept token is drawn for n * p of them (within one),
    a dropped token never."""
    rng = np.random.default_rng(11)
    logits = (rng.standard_normal((1, 40)) * 2).astype(np.float32)
    n = 150
    case = (0.8, 12, 0.9, 0.02)
    args = dict(
        sample_rows=np.zeros(n, np.int64),
        temperature=np.full(n, case[0]),
        top_k=np.full(n, case[1]),
        top_p=np.full(n, case[2]),
        min_p=np.full(n, case[3]),
        uniforms=(np.arange(n) + 0.5) / n,
    )
    got = backend(emu).sample(logits, **args)
    counts = np.bincount(got, minlength=40)
    expect = reference_sampler.filtered_probs(logits[0], *case) * n
    assert np.abs(counts - expect).max() <= 1.0
    assert (counts[expect == 0] == 0).all()


def test_sample_rejects_rows_outside_the_logits(emu):
    with pytest.raises(ValueError, match="sample_rows"):
        backend(emu).sample(
            np.zeros((2, 10), np.float32),
            np.array([2]),
            np.ones(1),
            np.full(1, -1),
            np.ones(1),
            np.zeros(1),
            np.zeros(1),
        )


# ------------------------------------------------------------------------------------------ weight loading
def test_convert_kernel_rounds_like_numpy_and_ml_dtypes(emu):
    """Every ordered dtype pair, including values that round to even, overflow fp16 and denormals."""
    be = backend(emu)
    rng = np.random.default_rng(4)
    x32 = np.concatenate(
        [rng.standard_normal(1000) * 10, [1 + 2**-8, 1 + 3 * 2**-8, 70000.0, 1e-40, -0.0, np.inf, 2**-20]]
    ).astype(np.float32)
    with np.errstate(over="ignore"):  # 70000 overflows fp16 to inf, on purpose
        sources = {"float32": x32, "float16": x32.astype(F16), "bfloat16": x32.astype(BF16)}
    for s_name, s_host in sources.items():
        for d_name, d_np in (("float32", np.float32), ("float16", F16), ("bfloat16", BF16)):
            if s_name == d_name:
                continue
            out = (
                np.full(x32.shape, 0xFFFF, np.uint16) if d_name == "bfloat16" else np.full(x32.shape, np.nan, d_np)
            )  # poisoned: NaN bits
            be.convert(out, dev(s_host))
            with np.errstate(over="ignore"):
                expect = s_host.astype(np.float32).astype(d_np)
            np.testing.assert_array_equal(
                host(out, d_np).view(np.uint8), expect.view(np.uint8), err_msg=f"{s_name} -> {d_name}"
            )


@pytest.mark.parametrize("target", ["float32", "bfloat16", "float16"])
def test_load_weight_and_fused_linear_from_any_checkpoint_dtype(emu, target):
    """The loader's device path: bytes in the checkpoint's dtype, then convert_kernel; fused parts land in
    their rows. Emulated arrays are host arrays, so the staged copy is a byte copy here (the pinned
    staging itself is tested in test_cuda_launch_config.py)."""
    be = backend(emu)
    rng = np.random.default_rng(6)
    t_np = {"float32": np.dtype(np.float32), "bfloat16": BF16, "float16": F16}[target]
    for ckpt in (np.float32, F16, BF16, np.float64):
        parts = [rng.standard_normal((r, 24)).astype(np.float32).astype(ckpt) for r in (8, 4, 4)]
        fused = host(be.load_linear(parts, target), t_np)
        np.testing.assert_array_equal(
            fused.view(np.uint8), np.concatenate(parts).astype(np.float32).astype(t_np).view(np.uint8)
        )
        norm = host(be.load_weight(parts[0][0], target), t_np)
        np.testing.assert_array_equal(norm.view(np.uint8), parts[0][0].astype(np.float32).astype(t_np).view(np.uint8))
    with pytest.raises(ValueError, match="dtype"):
        be.load_weight(parts[0], "int8")


# ------------------------------------------------------------------------------------------ quantized weights
class _PoisonedNumpy:
    """NumPy whose ``empty`` is NaN-filled (bf16/fp16 bits: a NaN pattern), so any output element a kernel
    leaves unwritten shows."""

    def __getattr__(self, name):
        return getattr(np, name)

    @staticmethod
    def empty(shape, dtype=np.float32):
        a = np.empty(shape, dtype=dtype)
        if a.dtype == np.uint16:
            a.fill(0x7FC0)
        elif a.dtype.kind == "f":
            a.fill(np.nan)
        return a


QUANT_ACTS = {"float32": np.dtype(np.float32), "float16": F16, "bfloat16": BF16}


@pytest.mark.parametrize("act", list(QUANT_ACTS))
@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1"])
def test_quant_linear_and_embedding_on_blocks(emu, qtype, act):
    """cuda/quant.cu against float64 products with the gguf package's dequantization: the GEMV (M <= 8)
    and the tiled GEMM (M > 8, partial tiles), fused parts, a bias, x with a row stride, the lookup."""
    from rawpaged.kernels.cuda.weights import DeviceQuantized
    from rawpaged.kernels.quantization import QuantizedTensor

    be = backend(emu)
    be.xp = _PoisonedNumpy()
    a_np = QUANT_ACTS[act]
    rng = np.random.default_rng(11)
    w = rng.standard_normal((70, 96)).astype(np.float32)
    w[5] = 0.0  # zero scales
    w[7, :32] *= 1e-3
    parts = [QuantizedTensor.quantize(w[:40], qtype), QuantizedTensor.quantize(w[40:], qtype)]
    ref_w = np.concatenate([p.dequantize() for p in parts]).astype(np.float64)
    dw = be.load_linear(parts, act)
    assert isinstance(dw, DeviceQuantized) and dw.qtype == qtype and dw.dtype == (np.uint16 if a_np == BF16 else a_np)
    bias = rng.standard_normal(70).astype(np.float32).astype(a_np)
    for M in (1, 3, 8, 9, 40):
        wide = rng.standard_normal((M, 128)).astype(np.float32).astype(a_np)
        x = wide[:, :96]  # rows 128 elements apart
        want = x.astype(np.float64) @ ref_w.T
        for b in (None, bias):
            got = be.linear(dev(x), dw, None if b is None else dev(b))
            expect = want if b is None else want + b.astype(np.float64)
            got = host(got, a_np).astype(np.float64)
            assert got.shape == (M, 70) and not np.isnan(got).any()
            scale = np.abs(expect).max()
            if a_np == np.float32:
                np.testing.assert_allclose(got, expect, rtol=1e-5, atol=1e-5 * scale)
            else:
                np.testing.assert_allclose(got, expect, rtol=1e-2, atol=1e-2 * scale)
    table = be.load_weight(parts[0], act)
    ids = np.array([39, 0, 5, 7, 7], np.int64)
    rows = host(be.embedding(ids, table), a_np)
    np.testing.assert_allclose(
        rows.astype(np.float64), ref_w[ids].astype(np.float32).astype(a_np).astype(np.float64), rtol=1e-6, atol=0
    )
    with pytest.raises(ValueError, match="do not chain"):
        be.linear(dev(np.zeros((2, 64), a_np)), dw)


@pytest.mark.parametrize("act", ["float32", "bfloat16"])
def test_sub_block_formats_on_blocks_and_stacked_parts(emu, act):
    """Q5_0, Q5_1, Q4_K, Q5_K and Q6_K read in their GGUF blocks by cuda/quant.cu (random super-blocks) against
    float64 products with the gguf package's dequantization, GEMV and tiled GEMM; a fused weight of mixed
    formats is a DeviceStacked computed part by part (with its bias); the lookup of each format."""
    from rawpaged.kernels.cuda.weights import DeviceQuantized, DeviceStacked
    from rawpaged.kernels.quantization import SUBBLOCK, QuantizedTensor
    from rawpaged.testing.quant_blocks import random_blocks

    gguf = pytest.importorskip("gguf")
    be = backend(emu)
    be.xp = _PoisonedNumpy()
    a_np = QUANT_ACTS[act]
    rng = np.random.default_rng(12)
    K = 512
    parts = [QuantizedTensor.from_blocks(t, (24, K), random_blocks(t, 24, K, rng, 0.1)) for t in SUBBLOCK]
    parts.insert(1, QuantizedTensor.from_blocks("Q5_0", (8, K), random_blocks("Q5_0", 8, K, rng, 0.1)))

    def ref(p):
        return gguf.quants.dequantize(p.blocks(), gguf.GGMLQuantizationType[p.qtype]).reshape(p.shape)

    ref_w = np.concatenate([ref(p) for p in parts]).astype(np.float64)
    dw = be.load_linear(parts, act)
    assert isinstance(dw, DeviceStacked) and dw.qtype == "Q5_0+Q5_1+Q4_K+Q5_K+Q6_K" and dw.shape == (128, K)
    bias = rng.standard_normal(128).astype(np.float32).astype(a_np)
    for M in (1, 8, 9):
        x = rng.standard_normal((M, K)).astype(np.float32).astype(a_np)
        expect = x.astype(np.float64) @ ref_w.T + bias.astype(np.float64)
        got = host(be.linear(dev(x), dw, dev(bias)), a_np).astype(np.float64)
        assert got.shape == (M, 128) and not np.isnan(got).any()
        tol = 1e-5 if a_np == np.float32 else 1e-2
        np.testing.assert_allclose(got, expect, rtol=tol, atol=tol * np.abs(expect).max())
    for p in parts:
        ids = np.array([p.shape[0] - 1, 0, 5, 5], np.int64)
        table = be.load_weight(p, act)
        assert isinstance(table, DeviceQuantized) and table.qtype == p.qtype
        rows = host(be.embedding(ids, table), a_np).astype(np.float64)
        want = ref(p)[ids].astype(np.float32).astype(a_np).astype(np.float64)
        np.testing.assert_allclose(rows, want, rtol=1e-6 if a_np == np.float32 else 1e-2, atol=1e-7)


# ------------------------------------------------------------------------------------------ the engine
def _numpy_linear_bf16(ctx, x, weight, bias, float32_out=False):
    """What the cuBLAS gemmEx call computes (bf16 inputs, float32 accumulation, then one rounding to bf16,
    or none with ``float32_out``)."""
    y = x.view(BF16).astype(np.float32) @ weight.view(BF16).astype(np.float32).T
    if bias is not None:
        y += bias.view(BF16).astype(np.float32)
    return y if float32_out else y.astype(BF16).view(np.uint16)


def test_engine_on_emulated_cuda_matches_the_cpu_engine(emu, tmp_path, monkeypatch):
    """The whole CUDA path (LLMEngine -> ModelRunner -> LlamaModel -> CudaBackend -> every kernel, device
    sampling, COW block copies for n > 1, prefix-cache hits, weight upload with dtype conversion) on a
    tiny random model, against the CPU engine. float32: the same greedy and seeded-sampled ids;
    bfloat16 (the CUDA default): first-step logits within bf16 precision."""
    from rawpaged import LLM, SamplingParams
    from rawpaged.engine import llm_engine as engine_mod
    from rawpaged.testing.random_model import write_random_model

    model = write_random_model(
        tmp_path / "m",
        num_layers=2,
        hidden_size=128,
        intermediate_size=96,
        num_heads=4,
        num_kv_heads=2,
        head_dim=64,
        seed=3,
    )
    kw = dict(model=str(model), num_kv_blocks=64, block_size=16, max_model_len=256)
    prompts = [{"prompt_token_ids": list(range(3, 3 + n))} for n in (5, 16, 33)]
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    sampled = SamplingParams(n=2, temperature=0.9, top_p=0.9, top_k=40, seed=5, max_tokens=4, ignore_eos=True)

    constrained = SamplingParams(n=2, temperature=0.9, seed=7, max_tokens=8, structured_outputs={"regex": "[a-c]{2,5}"})
    penalized = SamplingParams(
        temperature=0.0, max_tokens=6, ignore_eos=True, repetition_penalty=1.4, frequency_penalty=1.0,
        logit_bias={40: 0.05, 41: -100.0}, min_tokens=3, bad_words=["b"],
    )  # fmt: skip

    def run(llm):
        g = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]
        smp = [[c.token_ids for c in o.outputs] for o in llm.generate(prompts[1:], sampled)]
        again = llm.generate(prompts[2:], greedy)[0].outputs[0].token_ids  # prefix-cache hit
        regex = [c for o in llm.generate(prompts[:2], constrained) for c in o.outputs]  # masked logits
        pen = [o.outputs[0].token_ids for o in llm.generate(prompts, penalized)]  # logits edits
        assert not any(41 in t for t in pen)
        assert all(re.fullmatch("[a-c]{2,5}", c.text) for c in regex if c.finish_reason == "stop"), regex
        stats = llm.stats()
        assert stats["num_free_blocks"] == stats["num_total_blocks"]
        return g, smp, again, [c.token_ids for c in regex], pen

    cpu_llm = LLM(device="cpu", **kw)
    ref = run(cpu_llm)
    monkeypatch.setattr(cuda_linear, "linear_bf16", _numpy_linear_bf16)
    monkeypatch.setattr(engine_mod, "get_backend", lambda device: backend(emu, num_sms=4))
    f32 = LLM(device="cuda", dtype="float32", **kw)
    assert f32.engine.backend.name == "cuda" and f32.engine.kv_cache_dtype == "float32"
    emu.launches.clear()
    assert run(f32) == ref
    launched = {n.split("<")[0] for n, *_ in emu.launches}
    assert {
        "paged_attention_kernel",
        "prefill_attention_kernel",
        "rotary_embedding_and_cache_kernel",
        "copy_blocks_kernel",
        "rms_norm_kernel",
        "silu_and_mul_kernel",
        "sample_kernel",
        "apply_token_bitmask_kernel",
        "apply_logits_edits_kernel",
    } <= launched
    assert f32.stats()["prefix_cache_hits"] > 0
    scored = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=3)  # the LM head over every position
    for want, got in zip(cpu_llm.generate(prompts, scored), f32.generate(prompts, scored)):
        assert len(got.prompt_logprobs) == len(want.prompt_logprobs) and got.prompt_logprobs[0] is None
        for w, g in zip(want.prompt_logprobs[1:], got.prompt_logprobs[1:]):
            assert list(g)[0] == list(w)[0] and set(g) == set(w)
            assert all(abs(g[t].logprob - w[t].logprob) < 1e-4 and g[t].rank == w[t].rank for t in w)
    assert "logprobs_kernel" in {n.split("<")[0] for n, *_ in emu.launches}  # reduced on the device

    bf16 = LLM(device="cuda", **kw)
    assert (bf16.engine.dtype, bf16.engine.kv_cache_dtype) == ("bfloat16", "bfloat16")
    assert bf16.engine.model.embed_tokens.dtype == np.uint16
    hidden = bf16.engine.backend.asarray(np.ones((2, 128), np.float32), dtype=BF16)
    assert bf16.engine.model.compute_logits(hidden).dtype == np.float32  # logits keep float32's resolution
    from rawpaged.tools.check_cuda_engine import _first_logits

    for p in prompts:
        want = _first_logits(cpu_llm, p["prompt_token_ids"])
        got = _first_logits(bf16, p["prompt_token_ids"])
        assert np.max(np.abs(got - want)) < 0.05 * np.max(np.abs(want)) + 1e-3
    out = bf16.generate(prompts, sampled)
    assert all(len(c.token_ids) == 4 for o in out for c in o.outputs)


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8"])
def test_engine_with_a_quantized_kv_cache_on_emulated_cuda_matches_the_cpu_engine(
    emu, tmp_path, monkeypatch, kv_cache_dtype
):
    """The whole engine with ``--kv-cache-dtype int8`` / ``fp8`` on the emulated CUDA kernels (float32
    activations, so only the kernels differ) against the CPU engine: the same greedy tokens, logprobs to
    float32 rounding (the two quantize the same rows, at most one code apart at ties), copy-on-write (n = 2)
    and a prefix-cache hit, every block back at the end."""
    from rawpaged import LLM, SamplingParams
    from rawpaged.engine import llm_engine as engine_mod
    from rawpaged.testing.random_model import write_random_model

    model = write_random_model(
        tmp_path / "m",
        num_layers=2,
        hidden_size=128,
        intermediate_size=96,
        num_heads=4,
        num_kv_heads=2,
        head_dim=64,
        seed=5,
    )
    kw = dict(model=str(model), num_kv_blocks=64, block_size=16, max_model_len=256, kv_cache_dtype=kv_cache_dtype)
    prompts = [{"prompt_token_ids": list(range(3, 3 + n))} for n in (5, 16, 33)]
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=2)
    forks = SamplingParams(n=2, temperature=0.0, max_tokens=4, ignore_eos=True)

    def run(llm):
        out = llm.generate(prompts, greedy) + llm.generate(prompts[2:], forks) + llm.generate(prompts[2:], greedy)
        stats = llm.stats()
        assert stats["num_free_blocks"] == stats["num_total_blocks"]
        return [[c.token_ids for c in o.outputs] for o in out], [
            [v for step in o.outputs[0].logprobs for v in step.values()] for o in out if o.outputs[0].logprobs
        ]

    want_ids, want_lp = run(LLM(device="cpu", **kw))
    monkeypatch.setattr(engine_mod, "get_backend", lambda device: backend(emu, num_sms=4))
    gpu = LLM(device="cuda", dtype="float32", **kw)
    assert gpu.engine.kv_cache_dtype == ("int8" if kv_cache_dtype == "int8" else "fp8_e4m3")
    got_ids, got_lp = run(gpu)
    assert got_ids == want_ids
    for a, b in zip(got_lp, want_lp):
        np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-3)
    assert gpu.stats()["prefix_cache_hits"] > 0


def test_engine_with_a_second_kv_tier_on_emulated_cuda_matches_the_cpu_engine(emu, tmp_path, monkeypatch):
    """The second tier on CUDA (host slots; page-locked on a device): a pool too small for the batch swaps
    requests out and back in, and a prompt whose blocks were evicted comes back from the tier; the tokens
    are the CPU engine's with room, every block back."""
    from rawpaged import LLM, SamplingParams
    from rawpaged.engine import llm_engine as engine_mod
    from rawpaged.testing.random_model import write_random_model

    model = write_random_model(
        tmp_path / "m",
        num_layers=2,
        hidden_size=128,
        intermediate_size=96,
        num_heads=4,
        num_kv_heads=2,
        head_dim=64,
        seed=8,
    )
    rng = np.random.default_rng(3)
    prompts = [{"prompt_token_ids": [int(t) for t in rng.integers(3, 200, 20 + 15 * i)]} for i in range(5)]
    greedy = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    want = [
        o.outputs[0].token_ids for o in LLM(model=str(model), device="cpu", num_kv_blocks=64).generate(prompts, greedy)
    ]
    monkeypatch.setattr(engine_mod, "get_backend", lambda device: backend(emu, num_sms=4))
    gpu = LLM(model=str(model), device="cuda", dtype="float32", num_kv_blocks=8, block_size=16, kv_offloading_size=0.01)
    assert [o.outputs[0].token_ids for o in gpu.generate(prompts, greedy)] == want
    filler = SamplingParams(max_tokens=1)
    gpu.generate([{"prompt_token_ids": [int(t) for t in rng.integers(3, 200, 120)]}], filler)  # evicts the rest
    assert [o.outputs[0].token_ids for o in gpu.generate(prompts[-1:], greedy)] == want[-1:]
    stats = gpu.stats()
    assert stats["num_swapped_out"] > 0 and stats["kv_offload"]["prefix_hits"] > 0, stats
    assert stats["num_free_blocks"] == stats["num_total_blocks"]
    gpu.close()


def test_speculative_decoding_on_emulated_cuda_matches_the_cpu_engine(emu, tmp_path, monkeypatch):
    """The verifier on CUDA: k + 1 positions through the paged prefill kernels after a cached context, the
    k + 1 logits rows sampled on the device (greedy and seeded), drafts from an oracle that corrupts some;
    the tokens are the CPU engine's without speculation, every block back."""
    from rawpaged import LLM, SamplingParams
    from rawpaged.engine import llm_engine as engine_mod
    from rawpaged.testing.random_model import write_random_model
    from tests.engine.test_spec_decode import OracleProposer

    model = write_random_model(
        tmp_path / "m",
        num_layers=2,
        hidden_size=128,
        intermediate_size=96,
        num_heads=4,
        num_kv_heads=2,
        head_dim=64,
        seed=4,
    )
    rng = np.random.default_rng(5)
    prompts = [[int(t) for t in rng.integers(3, 200, 12 + 9 * i)] for i in range(4)]
    params = [
        SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
        SamplingParams(temperature=0.8, top_p=0.9, seed=3, max_tokens=24, ignore_eos=True),
    ] * 2
    cpu = LLM(model=str(model), device="cpu", num_kv_blocks=64)
    want = [list(o.outputs[0].token_ids) for o in cpu.generate([{"prompt_token_ids": p} for p in prompts], params)]
    monkeypatch.setattr(engine_mod, "get_backend", lambda device: backend(emu, num_sms=4))
    spec = {"method": "ngram", "num_speculative_tokens": 3}
    gpu = LLM(model=str(model), device="cuda", dtype="float32", num_kv_blocks=32, block_size=8, speculative_config=spec)
    vocab = gpu.engine.model_config.vocab_size
    gpu.engine.speculator.proposer = OracleProposer({tuple(p): w for p, w in zip(prompts, want)}, vocab, seed=2)
    got = [list(o.outputs[0].token_ids) for o in gpu.generate([{"prompt_token_ids": p} for p in prompts], params)]
    assert got == want
    stats = gpu.stats()
    assert 0 < stats["spec_decode"]["num_accepted_tokens"] < stats["spec_decode"]["num_draft_tokens"], stats
    assert stats["num_free_blocks"] == stats["num_total_blocks"]


@pytest.mark.parametrize("qtype,arch", [("Q4_1", "llama"), ("Q8_0", "qwen2")])
def test_gguf_engine_on_emulated_cuda_runs_on_blocks_and_matches_the_cpu_engine(
    emu, tmp_path, monkeypatch, qtype, arch
):
    """A GGUF model on the CUDA path keeps its blocks on the device (every linear and the embedding through
    cuda/quant.cu) and gives the CPU engine's greedy ids, float32 activations."""
    from rawpaged import LLM, SamplingParams
    from rawpaged.engine import llm_engine as engine_mod
    from rawpaged.kernels.cuda.weights import DeviceQuantized
    from tests.model_executor.test_gguf import _write_gguf

    path = _write_gguf(tmp_path / f"tiny-{qtype}.gguf", qtype, arch=arch, hidden=128, n_head=2)  # head_dim 64
    kw = dict(model=str(path), num_kv_blocks=64, max_model_len=256)
    prompts = [{"prompt_token_ids": [1, 3, 4, 5, 5, 6] * k} for k in (1, 3)]
    greedy = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in LLM(device="cpu", **kw).generate(prompts, greedy)]
    monkeypatch.setattr(engine_mod, "get_backend", lambda device: backend(emu, num_sms=4))
    llm = LLM(device="cuda", dtype="float32", **kw)
    assert isinstance(llm.engine.model.layers[0]["gate_up_proj"], DeviceQuantized)
    assert isinstance(llm.engine.model.embed_tokens, DeviceQuantized)
    emu.launches.clear()
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)] == want
    launched = {n.split("<")[0] for n, *_ in emu.launches}
    assert {"quant_gemv_kernel", "quant_gemm_kernel", "quant_embedding_kernel"} <= launched


def test_gpu_engine_check_script_runs_on_the_emulated_kernels(emu, tmp_path, monkeypatch):
    """rawpaged/tools/check_cuda_engine.py (run by scripts/gpu_check.sh on a GPU) end to end on a tiny shape, so
    a device session is never spent on a broken script."""
    from rawpaged.engine import llm_engine as engine_mod
    from rawpaged.tools import check_cuda_engine

    real = engine_mod.get_backend
    monkeypatch.setattr(cuda_linear, "linear_bf16", _numpy_linear_bf16)
    monkeypatch.setattr(
        engine_mod, "get_backend", lambda device: backend(emu, num_sms=4) if device == "cuda" else real(device)
    )
    shape = dict(
        num_layers=1, hidden_size=128, intermediate_size=64, num_heads=4, num_kv_heads=2, head_dim=64, vocab_size=259
    )
    r = check_cuda_engine.check_shape(
        "tiny",
        shape,
        tmp_path,
        np.random.default_rng(0),
        prompt_lens=(3, 17),
        max_tokens=3,
        timing_batches=(2,),
        timing_tokens=2,
        graphs=("float32",),
        prefill_len=20,
    )
    assert r["ok"], r
    assert r["float32"]["ids_equal"] == 2 and r["float32"]["max_abs_logit_diff"] < 1e-4
    assert r["bfloat16"]["sampled_ids_valid"] and r["bfloat16"]["batch2_tok_per_s"] > 0
    assert r["bfloat16"]["prefill20_ms"] > 0
    g = r["float32"]["graphs"]
    assert g["ok"] and g["ids_equal_cpu"] == 2 and g["ids_equal_eager"] == 2 and g["replayed_steps"] > 0, g
    assert g["batch2_tok_per_s"] > 0
    q = check_cuda_engine.check_shape(
        "tiny-q8", {**shape, "quantization": "q8_0"}, tmp_path, np.random.default_rng(0), (3, 17), 3, ()
    )
    assert q["ok"] and q["quantization"] == "q8_0", q


def test_kernel_benchmark_script_dry_run(tmp_path, capsys):
    """benchmarks/kernels_cuda.py (run by scripts/gpu_check.sh) on the emulated kernels: tables and JSON."""
    import importlib.util
    import json
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "kernels_cuda.py"
    spec = importlib.util.spec_from_file_location("kernels_cuda", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.main(["--dry-run", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "kernels_cuda.json").read_text())
    assert len(result["results"]) == 16 and len(result["sampling"]) == 4
    assert all(r["paged_us"] > 0 and r["contiguous_us"] > 0 for r in result["results"])
    assert all(r["device_us"] > 0 and r["host_us"] > 0 for r in result["sampling"])

    class Capturing:  # a backend that records graphs: capture runs fn twice, a replay runs it again
        supports_cuda_graphs = True

        def capture_graph(self, fn):
            fn(), fn()
            return fn, None

    calls = []
    per_call = mod.device_time(Capturing(), lambda replay: (replay(), 2.0)[1], lambda: calls.append(1))
    assert per_call == 2.0 / mod.CALLS_PER_GRAPH and len(calls) == 3 * mod.CALLS_PER_GRAPH
    assert "sampling bf16 logits" in capsys.readouterr().out


# ------------------------------------------------------------------------------------------ launch rules
def test_argument_checking_catches_a_wrong_scalar_type(emu):
    """The emulator rejects what CuPy would silently misread (a Python int is passed as 64-bit)."""
    out = np.zeros(64, np.float32)
    with pytest.raises(TypeError):
        emu.launch("silu_and_mul_kernel<float>", (1, 1, 1), (32, 1, 1), (out, out, np.int64(1), 32))
    with pytest.raises(TypeError):
        emu.launch("silu_and_mul_kernel<float>", (1, 1, 1), (32, 1, 1), (out, out, np.int32(1), np.int32(32)))
    with pytest.raises(TypeError):
        emu.launch(
            "silu_and_mul_kernel<float>", (1, 1, 1), (32, 1, 1), (out, out.view(np.uint16), np.int64(1), np.int32(32))
        )


def test_uninitialized_shared_memory_reads_are_nan_and_overruns_are_caught(emu):
    """Dynamic shared memory is NaN-filled before each block and fenced: a decode launch with too little
    shared memory must be refused (guard bytes overwritten), not pass by luck."""
    rng = np.random.default_rng(0)
    kc, vc, bt, *_, q = _decode_case(rng, [40], 1, 4, 64, 16, np.float32)
    out = np.full_like(q, np.nan)
    cfg = launch_config.decode_config(1, 4, 1, 64, 48, num_sms=1)
    args = (
        out,
        np.int64(4 * 64),
        np.uint64(0),
        np.uint64(0),
        q,
        np.int64(4 * 64),
        kc,
        vc,
        np.uint64(0),  # no scales: a float cache
        np.uint64(0),
        bt,
        np.int32(bt.shape[1]),
        np.array([40], np.int32),
        np.int32(4),
        np.int32(1),
        np.int32(16),
        np.float32(0.125),
        np.int32(cfg["split_len"]),
        np.int32(1),
        np.int32(0),
        np.float32(0.0),  # no soft-cap
    )
    with pytest.raises(RuntimeError, match="outside"):
        emu.launch(
            "paged_attention_kernel<float, float, 64, 4>", cfg["grid"], cfg["block"], args, cfg["smem_bytes"] - 64
        )
    emu.launch("paged_attention_kernel<float, float, 64, 4>", cfg["grid"], cfg["block"], args, cfg["smem_bytes"])
    assert np.isfinite(out).all()


# ------------------------------------------------------------------------------------------ ThreadSanitizer
def _replay_under_tsan(names, record, tmp_path):
    """Record launches with the normal emulation, replay them in a -fsanitize=thread build."""
    try:
        exe = build(names, tsan=True, replay=True)
    except RuntimeError as e:
        if "tsan" in str(e).lower() or "sanitize" in str(e).lower():
            pytest.skip(f"g++ cannot build with -fsanitize=thread here: {str(e)[-300:]}")
        raise
    rec = Recorder(Emulator(build(names)))
    record(rec)
    rec.write(tmp_path / "in.bin")
    env = dict(os.environ, TSAN_OPTIONS="halt_on_error=1 exitcode=66")
    r = subprocess.run(
        [str(exe), str(tmp_path / "in.bin"), str(tmp_path / "out.bin")],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    if "unexpected memory mapping" in r.stderr:  # TSan vs. a kernel with high mmap entropy
        pytest.skip("ThreadSanitizer cannot run on this kernel (unexpected memory mapping)")
    return rec, r


def test_kernels_have_no_data_races_under_tsan(tmp_path):
    names = [
        "paged_attention_kernel<float, __nv_bfloat16, 64, 4>",
        "paged_attention_reduce_kernel<float>",
        "prefill_attention_kernel<float, __nv_bfloat16, 64>",
        "rms_norm_kernel<float, float>",
        "reshape_and_cache_kernel<float, __nv_bfloat16>",
        "sample_kernel<__nv_bfloat16>",
        "logprobs_kernel<float>",
    ]

    def record(rec):
        be = emulated_backend(rec, num_sms=64)
        rng = np.random.default_rng(0)
        contexts = [1, 17, 300]
        kc, vc, bt, keys, values, q = _decode_case(rng, contexts, 1, 3, 64, 16, BF16)
        out = np.full_like(q, np.nan)
        be.paged_attention(out, q, dev(kc), dev(vc), bt, np.array(contexts, np.int32), 0.125)
        qsl = np.array([0, 2, 42], np.int32)  # rows 1 and 2 of the block table: 2 new of 17, 40 new of 40
        qp = rng.standard_normal((42, 3, 64)).astype(np.float32)
        be.prefill_attention(
            np.full_like(qp, np.nan), qp, dev(kc), dev(vc), bt[1:], qsl, np.array([17, 40], np.int32), 0.1
        )
        x = rng.standard_normal((2, 300)).astype(np.float32)
        be.rms_norm(x, rng.standard_normal(300).astype(np.float32), 1e-5, residual=x.copy())
        be.reshape_and_cache(qp[:5, :1], qp[:5, 1:2], dev(kc), dev(vc), np.arange(5, dtype=np.int64))
        logits = (rng.standard_normal((2, 700)) * 3).astype(BF16)
        be.sample(dev(logits), **sample_args(2, SAMPLE_CASES[:4] + SAMPLE_CASES[5:6], rng))
        be.logprob_rows(dev(np.round(rng.standard_normal((3, 700)) * 3).astype(np.float32)), np.array([0, 5, 699]), 5)

    rec, r = _replay_under_tsan(names, record, tmp_path)
    assert r.returncode == 0 and "ThreadSanitizer" not in r.stderr, r.stderr[-6000:]
    got = read_replay_output(tmp_path / "out.bin")
    assert got == rec.final(), "the TSan replay computed different results"


def test_tsan_replay_detects_a_missing_syncthreads(tmp_path):
    """The race check can fail: the same exchange kernel without its __syncthreads() is reported."""
    for sync, expect_race in (("true", False), ("false", True)):

        def record(rec, sync=sync):
            rec.launch(f"neighbour_exchange_kernel<{sync}>", (1, 1, 1), (64, 1, 1), (np.zeros(64, np.float32),))

        _, r = _replay_under_tsan(list(SELFTEST_NAMES), record, tmp_path)
        raced = "ThreadSanitizer: data race" in r.stderr
        assert raced == expect_race, r.stderr[-3000:]
        assert (r.returncode == 66) == expect_race


def test_static_decode_path_on_emulated_cuda_matches_the_eager_cpu_engine(emu, tmp_path, monkeypatch):
    """``enforce_eager=False`` on the CUDA kernels, with a stand-in capture (a replay reruns the captured
    forward into the captured output): padded rows with context 0 and slot -1, decode attention sized for
    max_model_len as a graph captures it (more flash-decoding partitions than the contexts fill), block
    tables as wide as max_model_len. Greedy and sampled ids equal the eager CPU engine's, float32."""
    from rawpaged import LLM, SamplingParams
    from rawpaged.engine import llm_engine as engine_mod
    from rawpaged.kernels.cuda.backend import CudaBackend
    from rawpaged.testing.random_model import write_random_model

    model = write_random_model(
        tmp_path / "m", num_layers=2, hidden_size=128, intermediate_size=96, num_heads=4, num_kv_heads=2, head_dim=64
    )
    kw = dict(model=str(model), num_kv_blocks=64, block_size=16, max_model_len=512, max_num_seqs=6)
    prompts = [{"prompt_token_ids": list(range(3, 3 + n))} for n in (5, 16, 33)]
    greedy = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in (3, 5, 7)]
    sampled = SamplingParams(n=2, temperature=0.9, top_p=0.9, seed=5, max_tokens=4, ignore_eos=True)

    def run(llm):
        g = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]
        s = [[c.token_ids for c in o.outputs] for o in llm.generate(prompts[1:2], sampled)]
        stats = llm.stats()
        assert stats["num_free_blocks"] == stats["num_total_blocks"]
        return g, s

    ref = run(LLM(device="cpu", **kw))
    monkeypatch.setattr(engine_mod, "get_backend", lambda device: backend(emu, num_sms=4))

    def capture_graph(self, fn):
        output = fn()

        def replay():
            output[...] = fn()

        return replay, output

    monkeypatch.setattr(CudaBackend, "supports_cuda_graphs", True)
    monkeypatch.setattr(CudaBackend, "capture_graph", capture_graph)
    gpu = LLM(device="cuda", dtype="float32", enforce_eager=False, **kw)
    assert sorted(gpu.engine.runner.cuda_graph.graphs) == [1, 2, 4, 6]
    emu.launches.clear()
    assert run(gpu) == ref
    steps = gpu.engine.runner.cuda_graph.num_steps
    # 3 greedy sequences decode 2 steps padded to 4, then 2 steps of 2, 2 of 1; n=2 sampling 3 steps of 2
    assert steps == {1: 2, 2: 5, 4: 2, 6: 0}
    grids = {tuple(g) for n, g, *_ in emu.launches if n.startswith("paged_attention_kernel")}
    assert any(g[2] > 1 for g in grids), grids  # split for max_model_len, not for the contexts
