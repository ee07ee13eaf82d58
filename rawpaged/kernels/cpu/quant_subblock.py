"""CPU (Numba) products with the 5-bit formats and the K-quants (Q5_0, Q5_1, Q4_K, Q5_K, Q6_K), computed
on their 32-value sub-blocks (``quantization.SubBlockPlanes``) without a float32 copy of the weight.

Layout: as ``quant``'s other formats, ``quant_layout.R`` = 16 rows interleaved (``repack_subblock``): for
group g of 16 rows and sub-block s, ``qs[g, s, p, 2 r + e]`` holds nibble byte ``2 p + e`` of row r
(positions ``2 p + e`` and ``16 + 2 p + e``: adjacent positions of a row are adjacent bytes, for
``int_dot``'s pairwise products),
``qh[g, s]`` their high bits (``int_dot`` spells out the bit order), ``sub[g, s, :, :]`` their 6-bit
(Q4_K, Q5_K) or int8 (Q6_K) sub-block scales, and ``scales``/``mins`` their fp16 d and m (per sub-block) or
d and dmin (per 256-value super-block). Decoding the packed 6-bit scales of Q4_K/Q5_K into one byte each
is the only growth: 16 bytes in place of 12 per 256 values (2.8%).

Every sub-block reduces to ``a_h * q - b_h`` on its halves h (values 0-15, 16-31; ``_coeffs`` computes the
four coefficients of 16 rows at once), so the products are:

- up to ``INT_MAX_ROWS`` rows (decode at batch 1-8): x is quantized to int16 per 32 values (scale ``dx``,
  as llama.cpp quantizes activations to int8 for its dot products), each sub-block's integer dot products
  for 16 weight rows come from ``int_dot`` (``pmaddwd`` on x86; the quants expanded once for 4 activation
  rows), then ``out[n] += dx (a_0 idot_0 + a_1 idot_1) + b_0 xsum_0 + b_1 xsum_1`` (the offsets take x's
  float sums; they cost one multiply per half, as in llama.cpp's K-quant dot products). The rounding of x
  is the only difference from the float product: at most ``dx / 2`` per activation.
- more rows up to ``quant.ROWS_MAX_BATCH`` (larger batches, short prefills): 48 weight rows at a time
  dequantized into a row-major float32 scratch (``int_dot.sub_block_rowsN``: a sub-block of 16 rows in
  vector registers, ``group_rows``) and multiplied with ``gemm``'s register tiles in ``quant._gemm_rows``.
- many rows (prefill): the transposed weight dequantized a tile at a time into float32, then SGEMM
  (``quant.quant_linear`` drives the tiles).

Format codes (``quantization.FORMAT_CODES``): 3 Q5_0, 4 Q5_1, 5 Q4_K, 6 Q5_K, 7 Q6_K.
"""

from __future__ import annotations

import numba as nb
import numpy as np

from rawpaged.kernels.cpu.int_dot import (
    dot1,
    dot4,
    quantize_activation,
    sub_block_rows4,
    sub_block_rows5,
    sub_block_rows6,
)
from rawpaged.kernels.cpu.intrinsics import half_to_float, prefetch, quant_bits, signed_byte
from rawpaged.kernels.cpu.quant_layout import CHUNKS, JIT, PREFETCH_BYTES, R, interleave
from rawpaged.kernels.quantization import QK, QK_K, SUBBLOCK_BITS, SubBlockPlanes

_JIT = JIT
_SUBS_PER_SUPER = QK_K // QK


def repack_subblock(planes: SubBlockPlanes) -> dict:
    """The interleaved planes of a sub-block weight: ``qs`` uint8 ``[groups, nsub, 8, 32]`` (pairs of
    positions, module docstring), ``qh`` uint8 ``[groups, nsub, 0 | 2 | 4, 32]``, ``scales``/``mins``
    uint16 ``[groups, nscale, R]`` and ``sub`` uint8 ``[groups, nsub, 2, R]`` (``mins``/``sub`` are empty
    ``[groups, 0, ...]`` planes where the format has none). Zero padding rows dequantize to zero in every
    format (d = 0)."""
    rows = planes.shape[0]
    groups = -(-rows // R)
    nsub = planes.qs.shape[1]

    def pairs(plane):  # [rows, nsub, n, 2] -> [groups, nsub, n, 32]: byte 2 r + e
        p = np.pad(plane, ((0, groups * R - rows), (0, 0), (0, 0), (0, 0)))
        n = plane.shape[2]
        return np.ascontiguousarray(
            p.reshape(groups, R, nsub, n, 2).transpose(0, 2, 3, 1, 4).reshape(groups, nsub, n, 2 * R)
        )

    qs = pairs(planes.qs.reshape(rows, nsub, 8, 2))
    bits = SUBBLOCK_BITS[planes.qtype]
    if bits == 4:
        qh = np.zeros((groups, nsub, 0, 2 * R), np.uint8)
    else:
        high = (planes.values() >> 4).reshape(rows, nsub, 2, 8, 2)  # [.., h, p, e]
        if bits == 5:
            packed = sum((high[:, :, :, p, :] & 1) << p for p in range(8)).astype(np.uint8)  # [rows, nsub, h, e]
        else:
            c = high.reshape(rows, nsub, 4, 4, 2)  # combo 8 h + p = 4 t + k
            packed = sum((c[:, :, :, k, :] & 3) << (2 * k) for k in range(4)).astype(np.uint8)  # [rows, nsub, t, e]
        qh = pairs(packed)
    scales = interleave(planes.scales[:, :, None], groups)[:, :, 0, :].copy()
    mins = (
        interleave(planes.mins[:, :, None], groups)[:, :, 0, :].copy()
        if planes.mins is not None
        else np.zeros((groups, 0, R), np.uint16)
    )
    sub = interleave(planes.sub, groups) if planes.sub is not None else np.zeros((groups, 0, 2, R), np.uint8)
    return dict(qs=qs, qh=qh, scales=scales, mins=mins, sub=sub)


def unpack_values(qs: np.ndarray, qh: np.ndarray, rows: int) -> np.ndarray:
    """The unsigned quants uint8 ``[rows, nsub, 32]`` of repacked ``qs``/``qh`` (``repack_subblock``'s
    inverse on the quants)."""
    groups, nsub = qs.shape[0], qs.shape[1]

    def rowmajor(p):  # [groups, nsub, n, 32] -> [rows, nsub, n, 2]
        n = p.shape[2]
        return p.reshape(groups, nsub, n, R, 2).transpose(0, 3, 1, 2, 4).reshape(groups * R, nsub, n, 2)[:rows]

    nib = rowmajor(qs)  # [rows, nsub, p, e]: positions 2 p + e (low) and 16 + 2 p + e (high)
    v = np.stack([nib & 15, nib >> 4], axis=2).reshape(rows, nsub, 2, 8, 2)  # [.., h, p, e]
    if qh.shape[2] == 2:
        hb = rowmajor(qh)  # [rows, nsub, h, e]
        v = v | np.stack([((hb >> p) & 1) << 4 for p in range(8)], axis=3)
    elif qh.shape[2] == 4:
        hb = rowmajor(qh)  # [rows, nsub, t, e]
        c = np.stack([(hb >> (2 * k)) & 3 for k in range(4)], axis=3)  # [rows, nsub, t, k, e]: combo 4 t + k
        v = v | (c.reshape(rows, nsub, 2, 8, 2) << 4)
    return np.ascontiguousarray(v.reshape(rows, nsub, QK), dtype=np.uint8)


@nb.njit(inline="always")
def _bits(fmt):
    """Bits per quant of a format code (``int_dot.BITS``, as compiled code reads it)."""
    return 4 if fmt == 5 else (6 if fmt == 7 else 5)


@nb.njit(inline="always")
def _coeffs(fmt, scales, mins, sub, g, s, cf):
    """``cf [4, R]`` = (a_0, a_1, b_0, b_1) of sub-block s of group g's rows: half h's values are
    ``a_h * q + b_h``."""
    nr = cf.shape[1]
    if fmt == 3 or fmt == 4:
        for r in range(nr):
            d = half_to_float(scales[g, s, r])
            b = half_to_float(mins[g, s, r]) if fmt == 4 else np.float32(-16.0) * d
            cf[0, r] = d
            cf[1, r] = d
            cf[2, r] = b
            cf[3, r] = b
    elif fmt == 7:
        S = s // _SUBS_PER_SUPER
        for r in range(nr):
            d = half_to_float(scales[g, S, r])
            a0 = d * signed_byte(sub[g, s, 0, r])
            a1 = d * signed_byte(sub[g, s, 1, r])
            cf[0, r] = a0
            cf[1, r] = a1
            cf[2, r] = np.float32(-32.0) * a0
            cf[3, r] = np.float32(-32.0) * a1
    else:
        S = s // _SUBS_PER_SUPER
        for r in range(nr):
            a = half_to_float(scales[g, S, r]) * np.float32(sub[g, s, 0, r])
            b = -(half_to_float(mins[g, S, r]) * np.float32(sub[g, s, 1, r]))
            cf[0, r] = a
            cf[1, r] = a
            cf[2, r] = b
            cf[3, r] = b


@nb.njit(inline="always")
def _value(bits, qs, qh, g, s, j, r):
    """Quant j (0-31) of row r of sub-block s of group g, as float32."""
    h = j >> 4
    p = (j & 15) >> 1
    col = 2 * r + (j & 1)
    q = qs[g, s, p, col]
    if bits == 4:
        return quant_bits(q, 4 * h, q, 0, 0)
    if bits == 5:
        return quant_bits(q, 4 * h, qh[g, s, h, col], p, 1)
    c = 8 * h + p
    return quant_bits(q, 4 * h, qh[g, s, c >> 2, col], 2 * (c & 3), 3)


#: up to this many x rows (a multiple of 4 from 4) the sub-block formats' products take int16 activations
#: (``gemv``: the quants expanded once per sub-block for 4 rows at a time); above, dequantized tiles
INT_MAX_ROWS = 8


@nb.njit(**_JIT)
def quantize_rows(x, rows):
    """The int16 activations of float32 ``x [M, K]``'s rows ``rows`` (``int_dot.quantize_activation``):
    ``(xq16, dx, xs)``, flat as ``int_group`` reads them, with 3 zero rows past ``M`` (a group of 4
    rows may start at any row); other rows are zero."""
    M, K = x.shape
    nsub = K // QK
    xq = np.zeros((M + 3, nsub, QK), np.int16)
    dx = np.zeros((M + 3, nsub), np.float32)
    xs = np.zeros((M + 3, nsub, 2), np.float32)
    for i in range(rows.shape[0]):
        m = rows[i]
        quantize_activation(x[m], xq[m], dx[m], xs[m])
    return xq.reshape((M + 3) * nsub * QK).view(np.int32), dx.reshape((M + 3) * nsub), xs.reshape((M + 3) * nsub * 2)


@nb.njit(inline="always")
def int_group(fmt, qs, qh, scales, mins, sub, g, xq16, dxf, xsf, row0, Mp, acc):
    """``acc[m * R + r]`` = weight row ``g * R + r`` dotted with activation row ``row0 + m`` for m < Mp
    (Mp = 1, or a multiple of 4: groups of 4 activation rows), the activations as ``quantize_rows``
    gives them: the integer products' work on one group of 16 weight rows, shared by ``gemv`` and
    ``moe_quant``'s grouped products."""
    nsub = qs.shape[1]
    nscale = scales.shape[1]
    hstep = qh.shape[2] * qh.shape[3]
    xrow = nsub * 16
    for i in range(Mp * R):
        acc[i] = 0.0
    for s in range(nsub):
        off = (g * nsub + s) * 16 * R
        if off + PREFETCH_BYTES + 256 <= qs.size:
            for line in range(0, 256, 64):
                prefetch(qs, off + PREFETCH_BYTES + line)
        hoff = (g * nsub + s) * hstep
        if fmt == 3 or fmt == 4:
            so = (g * nsub + s) * R
        else:
            so = (g * nscale + s // _SUBS_PER_SUPER) * R
        bo = (g * nsub + s) * 2 * R
        if Mp == 1:
            xo, do = row0 * xrow + s * 16, row0 * nsub + s
            dot1(
                fmt, qs, off, qh, hoff, xq16, xo, xrow, scales, mins, so, sub, bo, dxf, do, nsub, xsf, do * 2, 0,
                acc, 0,
            )  # fmt: skip
        else:
            for m0 in range(0, Mp, 4):
                xo, do = (row0 + m0) * xrow + s * 16, (row0 + m0) * nsub + s
                dot4(
                    fmt, qs, off, qh, hoff, xq16, xo, xrow, scales, mins, so, sub, bo, dxf, do, nsub, xsf, do * 2,
                    nsub * 2, acc, m0 * R,
                )  # fmt: skip


@nb.njit(parallel=True, **_JIT)
def gemv(fmt, x, qs, qh, scales, mins, sub, out):
    """``out [M, N] = x [M, K] @ dequantize(W).T`` for M = 1 or M a multiple of 4 (float32), with x rounded
    to int16 per 32 values (module docstring): one row through the one-row dot products, more in groups of 4
    rows, each sub-block's quants expanded once per group (``int_group``)."""
    M = x.shape[0]
    groups = qs.shape[0]
    N = out.shape[1]
    xq16, dxf, xsf = quantize_rows(x, np.arange(M))
    nchunks = min(groups, CHUNKS)
    accs = np.empty((nchunks, M * R), np.float32)
    for c in nb.prange(nchunks):
        acc = accs[c]
        for g in range(c * groups // nchunks, (c + 1) * groups // nchunks):
            int_group(fmt, qs, qh, scales, mins, sub, g, xq16, dxf, xsf, 0, M, acc)
            for m in range(M):
                for r in range(R):
                    n = g * R + r
                    if n < N:
                        out[m, n] = acc[m * R + r]


@nb.njit(inline="always")
def _dequant_sub_t(bits, fmt, qs, qh, scales, mins, sub, g, s, cf, w, col):
    """``w[0:32, col + r]`` = sub-block s of row r of group g (float32), rows innermost (vectorized)."""
    _coeffs(fmt, scales, mins, sub, g, s, cf)
    for j in range(16):
        for r in range(R):
            w[j, col + r] = cf[0, r] * _value(bits, qs, qh, g, s, j, r) + cf[2, r]
    for j in range(16, 32):
        for r in range(R):
            w[j, col + r] = cf[1, r] * _value(bits, qs, qh, g, s, j, r) + cf[3, r]


@nb.njit(inline="always")
def group_rows(fmt, qs, qh, scales, mins, sub, g, cf, w, row0):
    """``w[row0 + r, :]`` = row r of group g, a sub-block of 16 rows at a time in vector registers
    (``int_dot.sub_block_rowsN``), for ``quant._gemm_rows``'s passes; ``cf``: C-contiguous float32
    ``[4, R]`` scratch."""
    bits = _bits(fmt)
    nsub = qs.shape[1]
    hstep = qh.shape[2] * qh.shape[3]
    for s in range(nsub):
        _coeffs(fmt, scales, mins, sub, g, s, cf)
        off = (g * nsub + s) * 16 * R
        hoff = (g * nsub + s) * hstep
        if bits == 4:
            sub_block_rows4(qs, off, qh, hoff, cf, w, row0, s * QK)
        elif bits == 5:
            sub_block_rows5(qs, off, qh, hoff, cf, w, row0, s * QK)
        else:
            sub_block_rows6(qs, off, qh, hoff, cf, w, row0, s * QK)


@nb.njit(**_JIT)
def dequant_tile_t(fmt, qs, qh, scales, mins, sub, g0, out):
    """``out [K, n]`` = rows ``g0 * R ..`` of the weight dequantized and transposed (n a multiple of R)."""
    bits = _bits(fmt)
    nsub = qs.shape[1]
    cf = np.empty((4, R), np.float32)
    for gi in range(out.shape[1] // R):
        for s in range(nsub):
            _dequant_sub_t(bits, fmt, qs, qh, scales, mins, sub, g0 + gi, s, cf, out[s * QK : (s + 1) * QK], gi * R)


@nb.njit(**_JIT)
def dequant_rows(fmt, qs, qh, scales, mins, sub, rows, out):
    """``out[i]`` = row ``rows[i]``, dequantized (float32)."""
    bits = _bits(fmt)
    nsub = qs.shape[1]
    cf = np.empty((4, R), np.float32)
    for i in range(rows.shape[0]):
        g = rows[i] // R
        r = rows[i] % R
        for s in range(nsub):
            _coeffs(fmt, scales, mins, sub, g, s, cf)
            for j in range(16):
                out[i, s * QK + j] = cf[0, r] * _value(bits, qs, qh, g, s, j, r) + cf[2, r]
            for j in range(16, 32):
                out[i, s * QK + j] = cf[1, r] * _value(bits, qs, qh, g, s, j, r) + cf[3, r]
