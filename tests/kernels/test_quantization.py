"""GGUF's Q8_0, Q4_0 and Q4_1 on the CPU: products and lookups on the (repacked) blocks against float64 products
with the ``gguf`` package's own dequantization, on every path (GEMV, register tiles, tiled SGEMM)."""

import pytest

pytest.importorskip("gguf")  # absent on some hosts (the GPU host has no package index)

import gguf
import numba as nb
import numpy as np

from rawpaged.kernels.cpu import quant as cpu_quant
from rawpaged.kernels.cpu import quant_weights
from rawpaged.kernels.cpu.backend import CPUBackend
from rawpaged.kernels.cpu.intrinsics import q4_block_rows, q8_block_rows
from rawpaged.kernels.quantization import FORMATS, QuantizedTensor

PLANAR = tuple(FORMATS)  # the 32-value formats held as planes (the sub-block ones: test_quant_subblock.py)

# M = 1 (GEMV), 2, 3, 8 and ROWS_MAX_BATCH (48 rows dequantized at a time into register tiles; 300
# weight rows: the last pass partly beyond the weight), ROWS_MAX_BATCH + 1 and 300 (tiles through SGEMM;
# 300 rows > one tile)
BATCHES = [1, 2, 3, 8, cpu_quant.ROWS_MAX_BATCH, cpu_quant.ROWS_MAX_BATCH + 1, 300]


@pytest.fixture(scope="module")
def weights():
    rng = np.random.default_rng(0)
    w = rng.standard_normal((300, 96)).astype(np.float32)
    w[5] = 0.0  # an all-zero row: zero scales
    w[7, :32] *= 1e-3  # a block with tiny values next to large ones
    return w


@pytest.mark.parametrize("qtype", PLANAR)
@pytest.mark.parametrize("M", BATCHES)
def test_quant_linear_matches_float64_of_gguf_dequantized(weights, qtype, M):
    q = QuantizedTensor.quantize(weights, qtype)
    ref_w = gguf.quants.dequantize(q.blocks(), gguf.GGMLQuantizationType[qtype]).astype(np.float64)
    assert ref_w.shape == weights.shape and np.abs(ref_w - weights).max() < (0.05 if qtype == "Q8_0" else 0.5)
    x = np.random.default_rng(M).standard_normal((M, 96)).astype(np.float32)
    got = cpu_quant.quant_linear(x, quant_weights.repack(q))
    want = x.astype(np.float64) @ ref_w.T
    assert got.dtype == np.float32 and got.shape == (M, 300)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4 * np.abs(want).max())
    np.testing.assert_array_equal(got[:, 5], 0.0)


@pytest.mark.parametrize("qtype", PLANAR)
@pytest.mark.parametrize("M", [1, 5, 22, cpu_quant.ROWS_MAX_BATCH + 5])
def test_odd_row_counts_and_partial_tiles(weights, qtype, M, monkeypatch):
    """233 rows: a last group of 9 real rows and 7 padding rows; tiles of 64 rows leave a partial last tile."""
    monkeypatch.setattr(cpu_quant, "TILE_BYTES", 64 * 96 * 4)
    q = QuantizedTensor.quantize(weights[:233], qtype)
    ref_w = q.dequantize().astype(np.float64)
    x = np.random.default_rng(M).standard_normal((M, 96)).astype(np.float32)
    got = cpu_quant.quant_linear(x, quant_weights.repack(q))
    assert got.shape == (M, 233)
    np.testing.assert_allclose(got, x.astype(np.float64) @ ref_w.T, rtol=1e-5, atol=1e-4 * np.abs(got).max())


@pytest.mark.parametrize("qtype", PLANAR)
def test_embedding_rows_are_dequantized_on_lookup(weights, qtype):
    q = QuantizedTensor.quantize(weights, qtype)
    ids = np.array([299, 0, 5, 7, 7], np.int64)
    np.testing.assert_array_equal(cpu_quant.quant_embedding(ids, quant_weights.repack(q)), q.dequantize()[ids])


def test_backend_keeps_blocks_fuses_one_format_and_stacks_mixed(weights):
    be = CPUBackend()
    a, b = QuantizedTensor.quantize(weights, "Q4_1"), QuantizedTensor.quantize(weights[:64], "Q4_1")
    fused = be.load_linear([a, b])
    assert isinstance(fused, quant_weights.RepackedQuantized) and fused.shape == (364, 96)
    assert fused.nbytes == (a.nbytes + b.nbytes) * 368 // 364  # 364 rows padded to 23 groups of 16
    x = np.random.default_rng(1).standard_normal((2, 96)).astype(np.float32)
    bias = np.arange(364, dtype=np.float32)
    np.testing.assert_allclose(
        be.linear(x, fused, bias),
        np.concatenate([x @ a.dequantize().T, x @ b.dequantize().T], 1) + bias,
        rtol=1e-5,
        atol=1e-4,
    )
    c = QuantizedTensor.quantize(weights[:64], "Q8_0")
    mixed = be.load_linear([a, b, c])  # a and b concatenated, c beside them
    assert isinstance(mixed, quant_weights.StackedQuantized) and mixed.shape == (428, 96) and mixed.qtype == "Q4_1+Q8_0"
    want = np.concatenate([x @ a.dequantize().T, x @ b.dequantize().T, x @ c.dequantize().T], 1)
    np.testing.assert_allclose(be.linear(x, mixed), want, rtol=1e-5, atol=1e-4)
    dense = be.load_linear([a, weights[:64]])  # quantized beside float: dequantized
    assert isinstance(dense, np.ndarray) and dense.shape == (364, 96)
    table = be.load_weight(a)
    assert be.load_linear([a]) is table  # a tied embedding and LM head: one repacked copy
    np.testing.assert_array_equal(be.embedding(np.array([3]), table), a.dequantize()[[3]])
    be.finish_loading()
    assert be.load_weight(a) is not table


def test_invalid_quantized_tensors_raise():
    with pytest.raises(ValueError, match="not a native format"):
        QuantizedTensor.from_blocks("IQ2_XS", (1, 256), np.zeros((1, 66), np.uint8))
    with pytest.raises(ValueError, match="multiple of 256"):
        QuantizedTensor.from_blocks("Q5_K", (1, 32), np.zeros((1, 22), np.uint8))
    with pytest.raises(ValueError, match="multiple of 32"):
        QuantizedTensor.from_blocks("Q8_0", (1, 33), np.zeros((1, 34), np.uint8))
    with pytest.raises(ValueError, match="expected uint8"):
        QuantizedTensor.from_blocks("Q4_0", (2, 64), np.zeros((2, 35), np.uint8))
    q = QuantizedTensor.quantize(np.ones((4, 64), np.float32), "Q8_0")
    with pytest.raises(ValueError, match="columns"):
        cpu_quant.quant_linear(np.ones((1, 32), np.float32), quant_weights.repack(q))
    with pytest.raises(ValueError, match="RepackedQuantized"):
        cpu_quant.quant_linear(np.ones((1, 64), np.float32), q)
    with pytest.raises(ValueError, match="share format"):
        QuantizedTensor.concat([q, QuantizedTensor.quantize(np.ones((4, 64), np.float32), "Q4_0")])


@pytest.mark.parametrize("qtype", PLANAR)
def test_repacking_round_trips_the_gguf_bytes(weights, qtype):
    q = QuantizedTensor.quantize(weights[:233], qtype)
    packed = quant_weights.repack(q)
    assert packed.qs.shape[0] == 15 and packed.qs.shape[3] == cpu_quant.R
    assert quant_weights.repack(packed) is packed
    np.testing.assert_array_equal(packed.to_quantized().blocks(), q.blocks())


def test_half_to_float_equals_numpys_float16_for_every_bit_pattern():
    """Finite values bit for bit, signed zeros, both infinities and every NaN as a NaN."""
    import numba as nb

    from rawpaged.kernels.cpu.intrinsics import half_to_float

    @nb.njit
    def convert(bits, out):
        for i in range(bits.shape[0]):
            out[i] = half_to_float(bits[i])

    bits = np.arange(65536, dtype=np.uint32).astype(np.uint16)
    want = bits.view(np.float16).astype(np.float32)
    out = np.zeros(65536, np.float32)
    convert(bits, out)
    nan = np.isnan(want)
    assert nan.sum() == 2 * 1023 and np.array_equal(np.isnan(out), nan)
    np.testing.assert_array_equal(out[~nan].view(np.uint32), want[~nan].view(np.uint32))
    assert out[0x7C00] == np.inf and out[0xFC00] == -np.inf


@nb.njit
def _dequantize_with_block_rows(fmt, qs, scales, mins, out):
    dm = np.empty((2, cpu_quant.R), np.float32)
    groups, nblk, L = qs.shape[0], qs.shape[1], qs.shape[2]
    for g in range(groups):
        for b in range(nblk):
            cpu_quant._block_scales(fmt, scales, mins, g, b, dm)
            off = (g * nblk + b) * L * cpu_quant.R
            if fmt == 0:
                q8_block_rows(qs, off, dm, out, g * cpu_quant.R, 1 + b * 32)
            else:
                q4_block_rows(qs, off, dm, out, g * cpu_quant.R, 1 + b * 32)


@pytest.mark.parametrize("qtype", PLANAR)
def test_block_rows_intrinsics_equal_gguf_dequantization(weights, qtype):
    """The vector-IR block dequantizers write exactly gguf's values, each row's 32 positions in order, at
    the given row and column of a poisoned matrix, and nothing else."""
    q = QuantizedTensor.quantize(weights, qtype)
    packed = quant_weights.repack(q)
    out = np.full((packed.qs.shape[0] * cpu_quant.R, 96 + 2), np.nan, np.float32)
    qs, _, scales, mins, _ = quant_weights.kernel_planes(packed)
    _dequantize_with_block_rows(cpu_quant._FMT[qtype], qs, scales, mins, out)
    ref = gguf.quants.dequantize(q.blocks(), gguf.GGMLQuantizationType[qtype])
    np.testing.assert_array_equal(out[:300, 1:97], ref)
    np.testing.assert_array_equal(out[300:, 1:97], 0.0)  # the zero-block padding rows
    assert np.isnan(out[:, 0]).all() and np.isnan(out[:, 97]).all()


@pytest.mark.parametrize("qtype", PLANAR)
def test_own_dequantize_and_q8_0_quantize_are_ggufs_bit_for_bit(weights, qtype):
    """The engine dequantizes all three formats and quantizes Q8_0 itself (no ``gguf`` at run time): the
    same bytes and float32 bits as the package's reference, with rounding ties and zero blocks present."""
    w = weights.copy()
    w[9, :32] = np.arange(32, dtype=np.float32) - 15.5  # x / d lands on .5 for many values: ties
    w[10, :32] = -w[9, :32]
    qt = gguf.GGMLQuantizationType[qtype]
    ref = gguf.quants.quantize(w, qt).reshape(w.shape[0], -1)
    q = QuantizedTensor.quantize(w, qtype)
    np.testing.assert_array_equal(q.blocks(), ref)
    bits = gguf.quants.dequantize(ref, qt).astype(np.float32).reshape(w.shape).view(np.uint32)
    np.testing.assert_array_equal(q.dequantize().view(np.uint32), bits)
    rng = np.random.default_rng(1)  # any bytes with finite fp16 scales, not only what a quantizer writes
    block_bytes = FORMATS[qtype][0]
    raw = QuantizedTensor.from_blocks(qtype, (4, 64), rng.integers(0, 256, (4, 2 * block_bytes), dtype=np.uint8))
    scales = rng.uniform(-2, 2, raw.scales.shape).astype(np.float16).view(np.uint16)
    mins = rng.uniform(-2, 2, raw.scales.shape).astype(np.float16).view(np.uint16) if raw.mins is not None else None
    raw = QuantizedTensor(qtype, raw.shape, raw.qs, scales, mins)
    bits = gguf.quants.dequantize(raw.blocks(), qt).astype(np.float32).reshape(raw.shape).view(np.uint32)
    np.testing.assert_array_equal(raw.dequantize().view(np.uint32), bits)
