"""Quantized KV caches on the CPU (``--kv-cache-dtype int8`` / ``fp8_e4m3``): the cache write against the
float64 quantizer of ``tests/kv_reference.py``, the attention kernels against float64 attention over the
values the cache holds, block copies taking their scales, and the conversion to fp8 against ml_dtypes."""

import ml_dtypes
import numba as nb
import numpy as np
import pytest

from rawpaged.dtypes import FP8_E4M3, INT8, QUANTIZED_KV_TYPES, kv_row_bytes
from rawpaged.kernels.cpu import attention as cpu_attention
from rawpaged.kernels.cpu import cache as cpu_cache
from rawpaged.kernels.cpu import paged_attention_v2
from rawpaged.kernels.cpu.backend import CPUBackend
from rawpaged.kernels.cpu.intrinsics import f32_to_fp8_e4m3_bits, fp8_e4m3_to_float
from rawpaged.kernels.kv_cache import QuantizedKVCache
from tests.kv_reference import (
    assert_prefill_matches,
    assert_rows_quantized,
    attention_ref,
    dequantize_ref,
    make_paged_kv,
    quantized_paged_kv,
)

KINDS = list(QUANTIZED_KV_TYPES.values())
IDS = [k.name for k in KINDS]


@pytest.fixture(params=["serial", "parallel"])
def numba_mode(request, monkeypatch):
    monkeypatch.setattr(cpu_attention, "PARALLEL_MIN_WORK", 1 << 62 if request.param == "serial" else 0)
    return request.param


@nb.njit
def _to_fp8(x, out):
    for i in range(x.shape[0]):
        out[i] = f32_to_fp8_e4m3_bits(x[i])


def test_fp8_conversion_equals_ml_dtypes_at_every_value_and_midpoint():
    """Every finite E4M3 value, the midpoints between neighbours (ties to even) and the floats next to
    them, zeros of both signs, subnormals and random values below 448."""
    values = np.unique(np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32))
    values = values[np.isfinite(values)]
    mids = ((values[1:] + values[:-1]) / 2).astype(np.float32)
    x = np.concatenate(
        [
            values,
            mids,
            np.nextafter(mids, np.float32(np.inf)),
            np.nextafter(mids, np.float32(-np.inf)),
            np.float32([0.0, -0.0, 447.99, -447.99]),
            np.random.default_rng(0).standard_normal(100_000).astype(np.float32) * 50,
        ]
    )
    x = x[np.abs(x) < 448]
    got = np.empty(x.shape, np.uint8)
    _to_fp8(x, got)
    np.testing.assert_array_equal(got, x.astype(ml_dtypes.float8_e4m3fn).view(np.uint8))
    big = np.float32([448.0, 449.0, 1e6, -500.0])
    _to_fp8(big, got[:4])
    np.testing.assert_array_equal(got[:4], [0x7E, 0x7E, 0x7E, 0xFE])  # saturates at +-448


@nb.njit
def _from_fp8(q, out):
    for i in range(q.shape[0]):
        out[i] = fp8_e4m3_to_float(q[i])


def test_fp8_values_equal_ml_dtypes_for_every_code():
    codes = np.arange(256, dtype=np.uint8)
    want = codes.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    got = np.empty(256, np.float32)
    _from_fp8(codes, got)
    finite = np.isfinite(want)  # 0x7F and 0xFF are NaN: never written
    np.testing.assert_array_equal(got[finite].view(np.uint32), want[finite].view(np.uint32))  # -0.0 too


def test_a_quantized_row_takes_about_a_quarter_of_a_float32_row():
    assert kv_row_bytes("int8", 64) / kv_row_bytes("float32", 64) == 68 / 256 <= 0.27
    assert kv_row_bytes("fp8_e4m3", 128) / kv_row_bytes("float32", 128) < 0.27
    kc = CPUBackend.allocate_kv_cache((5, 16, 3, 64), "int8")
    assert isinstance(kc, QuantizedKVCache) and kc.data.dtype == np.int8 and kc.scales.shape == (5, 16, 3)
    assert kc.nbytes == 5 * 16 * 3 * kv_row_bytes("int8", 64)


@pytest.mark.parametrize("kind", KINDS, ids=IDS)
def test_reshape_and_cache_quantizes_each_row_with_its_scale(kind):
    """Values and scales against the float64 quantizer; slots of -1 tokens and unused slots untouched
    (their poison stays); the largest magnitude of a row maps to qmax; a zero row has scale 1."""
    rng = np.random.default_rng(1)
    num_blocks, block_size, H, D = 7, 16, 3, 64
    kc = QuantizedKVCache(
        np.full((num_blocks, block_size, H, D), 99, kind.storage), np.full((7, 16, 3), -1.0, np.float32), kind
    )
    vc = QuantizedKVCache(kc.data.copy(), kc.scales.copy(), kind)
    slots = rng.permutation(num_blocks * block_size)[:30].astype(np.int64)
    slots[[4, 11]] = -1
    key = (rng.standard_normal((30, H, D)) * rng.uniform(0.01, 30, (30, H, 1))).astype(np.float32)
    value = rng.standard_normal((30, H, D)).astype(np.float32)
    key[0, 1] = 0.0
    cpu_cache.reshape_and_cache(key, value, kc, vc, slots)
    written = slots >= 0
    b, o = slots[written] // block_size, slots[written] % block_size
    for cache, rows in ((kc, key), (vc, value)):
        assert_rows_quantized(cache.data[b, o], cache.scales[b, o], rows[written], kind)
        got = cache.data[b, o]
        err = np.abs(dequantize_ref(got, cache.scales[b, o], kind) - rows[written])
        bound = np.abs(rows[written]).max(-1, keepdims=True) * (0.5 / 127 if kind is INT8 else 2.0**-4) * 1.001
        assert (err <= bound).all()
        untouched = np.ones((num_blocks, block_size), bool)
        untouched[b, o] = False
        assert (cache.data[untouched] == 99).all() and (cache.scales[untouched] == -1.0).all()
    assert kc.scales[slots[0] // block_size, slots[0] % block_size, 1] == 1.0
    assert (kc.data[slots[0] // block_size, slots[0] % block_size, 1] == 0).all()


@pytest.mark.parametrize("kind", KINDS, ids=IDS)
@pytest.mark.parametrize("group", [1, 3, 8])
def test_paged_attention_reads_quantized_blocks(kind, group, numba_mode):
    """float64 attention over the values the cache holds (dequantized by the reference): only float32
    arithmetic separates the kernel from it. Unused slots hold NaN scales, so a stray read shows."""
    rng = np.random.default_rng(group)
    contexts = [1, 15, 16, 17, 33, 300]
    num_kv_heads, head_dim = 2, 64
    kf, vf, bt, _, _ = make_paged_kv(rng, contexts, num_kv_heads, head_dim, 16, np.float32)
    kc, vc, keys, values = quantized_paged_kv(kf, vf, bt, contexts, kind)
    q = rng.standard_normal((len(contexts), num_kv_heads * group, head_dim)).astype(np.float32)
    out = np.full_like(q, np.nan)
    cpu_attention.paged_attention(out, q, kc, vc, bt, np.array(contexts, np.int32), head_dim**-0.5)
    for s, ctx in enumerate(contexts):
        ref = attention_ref(q[s : s + 1], keys[s], values[s], head_dim**-0.5)[0]
        np.testing.assert_allclose(out[s], ref, rtol=2e-4, atol=2e-5, err_msg=f"ctx={ctx}")


@pytest.mark.parametrize("kind", KINDS, ids=IDS)
def test_split_decode_attention_reads_quantized_blocks(kind, numba_mode):
    """Batch 1 with one KV head (Gemma 3's shape): the context split into partitions
    (``paged_attention_v2.PARTITION_SIZE``) reads quantized blocks as the whole-context kernel does."""
    rng = np.random.default_rng(11)
    contexts = [1000]
    kf, vf, bt, _, _ = make_paged_kv(rng, contexts, 1, 256, 16, np.float32)
    kc, vc, keys, values = quantized_paged_kv(kf, vf, bt, contexts, kind)
    q = rng.standard_normal((1, 4, 256)).astype(np.float32)
    out = np.full_like(q, np.nan)
    assert paged_attention_v2.decode_partition(1, 1) > 0
    cpu_attention.paged_attention(out, q, kc, vc, bt, np.array(contexts, np.int32), 256**-0.5)
    ref = attention_ref(q, keys[0], values[0], 256**-0.5)[0]
    np.testing.assert_allclose(out[0], ref, rtol=2e-4, atol=2e-5)


@pytest.mark.parametrize("kind", KINDS, ids=IDS)
@pytest.mark.parametrize("window", [None, 20])
def test_prefill_attention_reads_quantized_blocks(kind, window, numba_mode):
    """Both prefill paths (the Numba kernel for short chunks, the BLAS tiles from 32 new tokens), after a
    cached prefix and chunked, with and without a sliding window."""
    rng = np.random.default_rng(7)
    seq_lens = [17, 33, 300, 1, 70]
    new_tokens = [17, 1, 260, 1, 40]
    kf, vf, bt, _, _ = make_paged_kv(rng, seq_lens, 3, 64, 16, np.float32)
    kc, vc, keys, values = quantized_paged_kv(kf, vf, bt, seq_lens, kind)
    qsl = np.concatenate([[0], np.cumsum(new_tokens)]).astype(np.int32)
    q = rng.standard_normal((qsl[-1], 6, 64)).astype(np.float32)
    out = np.full_like(q, np.nan)
    cpu_attention.prefill_attention(out, q, kc, vc, bt, qsl, np.array(seq_lens, np.int32), 0.125, sliding_window=window)
    assert_prefill_matches(out, q, qsl, seq_lens, keys, values, 0.125, window=window)


@pytest.mark.parametrize("kind", KINDS, ids=IDS)
def test_copy_blocks_moves_scales_with_values(kind):
    rng = np.random.default_rng(3)
    layers = []
    for _ in range(3):
        data = rng.integers(0, 120, (6, 4, 2, 8)).astype(kind.storage)
        layers.append(QuantizedKVCache(data, rng.uniform(0.1, 2, (6, 4, 2)).astype(np.float32), kind))
    before = [(c.data.copy(), c.scales.copy()) for c in layers]
    mapping = np.array([[1, 4], [2, 5]], np.int64)
    cpu_cache.copy_blocks(layers[:1], layers[1:2], mapping)  # layer 0 as K, layer 1 as V; layer 2 untouched
    for c, (data, scales) in zip(layers[:2], before[:2]):
        want_d, want_s = data.copy(), scales.copy()
        want_d[[4, 5]], want_s[[4, 5]] = data[[1, 2]], scales[[1, 2]]
        np.testing.assert_array_equal(c.data, want_d)
        np.testing.assert_array_equal(c.scales, want_s)
    np.testing.assert_array_equal(layers[2].data, before[2][0])


def test_key_and_value_caches_of_two_types_are_refused():
    kc = CPUBackend.allocate_kv_cache((2, 4, 1, 8), "int8")
    vc = CPUBackend.allocate_kv_cache((2, 4, 1, 8), "fp8_e4m3")
    x = np.zeros((1, 1, 8), np.float32)
    with pytest.raises(ValueError, match="one type"):
        cpu_cache.reshape_and_cache(x, x, kc, vc, np.zeros(1, np.int64))
    assert FP8_E4M3.qmax == 448.0 and INT8.qmax == 127.0
