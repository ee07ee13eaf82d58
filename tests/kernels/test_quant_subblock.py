"""The 5-bit formats and the K-quants (Q5_0, Q5_1, Q4_K, Q5_K, Q6_K) on the CPU: random super-blocks
(random bytes with finite fp16 scales: the ``gguf`` package dequantizes these types but cannot quantize
them) dequantized bit for bit as the package does, and products and lookups on the repacked blocks
against float64 products with the package's dequantization, on every path (GEMV, register tiles, tiled
SGEMM). Up to 8 rows take x rounded to int16 per 32 values (llama.cpp's quantized dot products round to
int8): their reference is the float64 product with those activations, the formats' offsets with x itself."""

import pytest

pytest.importorskip("gguf")  # absent on some hosts (the GPU host has no package index)

import gguf
import numpy as np

from rawpaged.kernels.cpu import quant as cpu_quant
from rawpaged.kernels.cpu import quant_weights
from rawpaged.kernels.cpu.backend import CPUBackend
from rawpaged.kernels.cpu.int_dot import quantize_activation
from rawpaged.kernels.cpu.quant_subblock import INT_MAX_ROWS
from rawpaged.kernels.quantization import SUBBLOCK, QuantizedTensor, SubBlockPlanes, subblock_planes
from rawpaged.testing.quant_blocks import random_blocks

TYPES = tuple(SUBBLOCK)
# 1 (one int8 row), 2, 3 and 8 (int8, 4 rows at a time, padded), 9 and ROWS_MAX_BATCH (dequantized row
# tiles), ROWS_MAX_BATCH + 1 and 300 (SGEMM tiles)
BATCHES = [1, 2, 3, 8, 9, cpu_quant.ROWS_MAX_BATCH, cpu_quant.ROWS_MAX_BATCH + 1, 300]
COLS = 512


def _weight(qtype, rows=300, seed=0):
    """Random blocks; row 5 all zero bytes (d = 0: zeros), row 7's first block with extreme fp16 fields."""
    rng = np.random.default_rng(seed)
    data = random_blocks(qtype, rows, COLS, rng)
    data[5] = 0
    per, size = SUBBLOCK[qtype]
    block = data[7, :size].copy()
    fields = [(0, 2), (2, 4)] if qtype != "Q6_K" else [(208, 210)]
    for lo, hi in fields[:1]:
        block[lo:hi] = np.array([65504.0], np.float16).view(np.uint8)  # the largest finite fp16
    data[7, :size] = block
    return QuantizedTensor.from_blocks(qtype, (rows, COLS), data)


def _gguf_dequantize(q):
    return gguf.quants.dequantize(q.blocks(), gguf.GGMLQuantizationType[q.qtype]).reshape(q.shape)


def _expected(q, x):
    """float64 ``x [M, K] @ W.T`` as the kernels compute it: up to ``INT_MAX_ROWS`` rows, ``a q`` (W less
    its offsets: gguf's dequantization of the quants minus that of zero quants) against x rounded to int16
    per 32 values and the offsets against x itself; more rows with x as it is."""
    w = _gguf_dequantize(q).astype(np.float64)
    if x.shape[0] > INT_MAX_ROWS:
        return x.astype(np.float64) @ w.T
    p = subblock_planes(q)
    offsets = SubBlockPlanes(p.qtype, p.shape, 0 * p.qs, 0 * p.qh, p.scales, p.mins, p.sub).dequantize()
    nsub = x.shape[1] // 32
    rows = []
    for row in x:
        xq, dx, xs = np.empty((nsub, 32), np.int16), np.empty(nsub, np.float32), np.empty((nsub, 2), np.float32)
        quantize_activation(row, xq, dx, xs)
        rows.append((xq.astype(np.float64) * dx[:, None].astype(np.float64)).reshape(-1))
    return np.array(rows) @ (w - offsets).T + x.astype(np.float64) @ offsets.astype(np.float64).T


def test_int16_activations_round_to_nearest_per_block():
    """``quantize_activation`` against a float64 reference: scale max|x| / 32767, every value within half a
    step of x, the half sums exact to float32 rounding."""
    x = np.random.default_rng(5).standard_normal(128).astype(np.float32)
    x[32:64] = 0.0  # a zero block: zero scale and quants
    xq, dx, xs = np.empty((4, 32), np.int16), np.full(4, np.nan, np.float32), np.full((4, 2), np.nan, np.float32)
    quantize_activation(x, xq, dx, xs)
    blocks = x.reshape(4, 32).astype(np.float64)
    np.testing.assert_allclose(dx, np.abs(blocks).max(axis=1) / 32767, rtol=1e-6)
    assert dx[1] == 0 and (xq[1] == 0).all()
    err = np.abs(xq * dx[:, None].astype(np.float64) - blocks)
    assert (err <= 0.5 * dx[:, None] * (1 + 1e-3)).all()
    assert np.abs(xq).max() == 32767
    np.testing.assert_allclose(xs, blocks.reshape(4, 2, 16).sum(axis=2), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("qtype", TYPES)
def test_own_dequantize_is_ggufs_bit_for_bit(qtype):
    q = _weight(qtype)
    ref = _gguf_dequantize(q).astype(np.float32)
    np.testing.assert_array_equal(q.dequantize().view(np.uint32), ref.view(np.uint32))
    packed = quant_weights.repack(q)
    np.testing.assert_array_equal(packed.dequantize().view(np.uint32), ref.view(np.uint32))
    planes, back = subblock_planes(q), packed.to_planes()
    for name in ("qs", "qh", "scales", "mins", "sub"):
        a, b = getattr(planes, name), getattr(back, name)
        assert (a is None) == (b is None), name
        if a is not None:
            np.testing.assert_array_equal(a, b, err_msg=name)
    np.testing.assert_array_equal(q.dequantize()[5], 0.0)


@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("M", BATCHES)
def test_quant_linear_matches_float64_of_gguf_dequantized(qtype, M):
    q = _weight(qtype)
    data = q.qs.copy()
    data[7] = data[8]  # keep the product's scale sane (row 7's extreme field is for the dequantize test)
    q = QuantizedTensor.from_blocks(qtype, q.shape, data)
    x = np.random.default_rng(M).standard_normal((M, COLS)).astype(np.float32)
    got = cpu_quant.quant_linear(x, quant_weights.repack(q))
    want = _expected(q, x)
    assert got.dtype == np.float32 and got.shape == (M, 300)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    np.testing.assert_array_equal(got[:, 5], 0.0)


@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("M", [1, 9, 300])
def test_an_infinite_or_nan_scale_gives_a_non_finite_output(qtype, M):
    """fp16 d = +Inf in row 7 and NaN in row 9 (as the gguf package dequantizes them): those columns of the
    product are not finite on each path (int16 vector scales up to 8 rows, dequantized tiles, SGEMM), the
    others are."""
    data = random_blocks(qtype, 16, COLS, np.random.default_rng(4))
    d = 208 if qtype == "Q6_K" else 0
    data[7, d : d + 2] = np.array([np.inf], np.float16).view(np.uint8)
    data[9, d : d + 2] = np.array([np.nan], np.float16).view(np.uint8)
    q = QuantizedTensor.from_blocks(qtype, (16, COLS), data)
    assert not np.isfinite(_gguf_dequantize(q)[[7, 9]]).all(axis=1).any()
    x = np.random.default_rng(M).standard_normal((M, COLS)).astype(np.float32)
    finite = np.isfinite(cpu_quant.quant_linear(x, quant_weights.repack(q)))
    assert not finite[:, [7, 9]].any() and finite[:, [c for c in range(16) if c not in (7, 9)]].all()


@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("M", [1, 5, 22, cpu_quant.ROWS_MAX_BATCH + 5])
def test_odd_row_counts_and_partial_tiles(qtype, M, monkeypatch):
    """233 rows: a last group of 9 real rows and 7 padding rows; tiles of 64 rows leave a partial last tile."""
    monkeypatch.setattr(cpu_quant, "TILE_BYTES", 64 * COLS * 4)
    q = QuantizedTensor.from_blocks(qtype, (233, COLS), random_blocks(qtype, 233, COLS, np.random.default_rng(3)))
    x = np.random.default_rng(M).standard_normal((M, COLS)).astype(np.float32)
    got = cpu_quant.quant_linear(x, quant_weights.repack(q))
    assert got.shape == (M, 233)
    np.testing.assert_allclose(got, _expected(q, x), rtol=1e-5, atol=1e-5 * np.abs(got).max())


@pytest.mark.parametrize("qtype", TYPES)
def test_embedding_rows_are_dequantized_on_lookup(qtype):
    q = _weight(qtype)
    ids = np.array([299, 0, 5, 7, 7, 16], np.int64)
    got = cpu_quant.quant_embedding(ids, quant_weights.repack(q))
    np.testing.assert_allclose(got, _gguf_dequantize(q)[ids], rtol=1e-6, atol=0)


def test_fused_parts_of_mixed_formats_compute_part_by_part():
    """A QKV of Q4_K, Q4_K and Q6_K: the two Q4_K parts concatenated, Q6_K beside them; products equal
    each part's float64 product in its columns, and no part is expanded to float32."""
    rng = np.random.default_rng(4)
    parts = [
        QuantizedTensor.from_blocks(t, (n, COLS), random_blocks(t, n, COLS, rng))
        for t, n in (("Q4_K", 64), ("Q4_K", 40), ("Q6_K", 40))
    ]
    w = CPUBackend().load_linear(parts)
    assert isinstance(w, quant_weights.StackedQuantized) and w.qtype == "Q4_K+Q6_K" and w.shape == (144, COLS)
    assert w.nbytes <= 1.03 * sum(p.nbytes for p in parts) + 16 * 2 * COLS  # padding rows of the 104-row part
    for M in (1, 3, 40):
        x = rng.standard_normal((M, COLS)).astype(np.float32)
        want = np.concatenate([_expected(p, x) for p in parts], axis=1)
        np.testing.assert_allclose(CPUBackend.linear(x, w), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def test_sub_block_formats_refuse_bad_shapes():
    with pytest.raises(ValueError, match="multiple of 256"):
        QuantizedTensor.from_blocks("Q4_K", (1, 288), np.zeros((1, 162), np.uint8))
    with pytest.raises(ValueError, match="expected uint8"):
        QuantizedTensor.from_blocks("Q6_K", (2, 256), np.zeros((2, 209), np.uint8))
    with pytest.raises(ValueError, match="not a multiple of 32"):
        random_blocks("Q5_0", 2, 48, np.random.default_rng(0))
    q = _weight("Q5_1", rows=16)
    with pytest.raises(ValueError, match="to_planes"):
        quant_weights.repack(q).to_quantized()
