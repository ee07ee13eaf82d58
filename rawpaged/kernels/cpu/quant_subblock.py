"""CPU (Numba) products with the 5-bit formats and the K-quants (Q5_0, Q5_1, Q4_K, Q5_K, Q6_K), computed
on their 32-value sub-blocks (``quantization.SubBlockPlanes``) without a float32 copy of the weight.

Layout: as ``quant``'s other formats, ``R`` = 16 rows interleaved (``repack_subblock``): for group g of 16
rows and sub-block s, ``qs[g, s, j, :]`` holds nibble byte j of the 16 rows, ``qh[g, s, k, :]`` their high
bits, ``sub[g, s, :, :]`` their 6-bit (Q4_K, Q5_K) or int8 (Q6_K) sub-block scales, and ``scales``/``mins``
their fp16 d and m (per sub-block) or d and dmin (per 256-value super-block). Decoding the packed 6-bit
scales of Q4_K/Q5_K into one byte each is the only growth: 16 bytes in place of 12 per 256 values (2.8%).

Every sub-block reduces to ``a_h * q - b_h`` on its halves h (values 0-15, 16-31; ``_coeffs`` computes the
four coefficients of 16 rows at once), so the products are:

- one row (decode at batch 1): per sub-block and row, two running sums per half over the quants
  dequantized in registers, then ``out[n] += a_0 dot_0 + a_1 dot_1 + b_0 xsum_0 + b_1 xsum_1`` (the
  minimums cost one multiply per half, as in llama.cpp's K-quant dot products); the loop over the 16 rows
  is the vector.
- a few rows (batched decode): 48 weight rows at a time dequantized into a row-major float32 scratch and
  multiplied with ``gemm``'s 4 x 6 register tiles, as ``quant._gemm_rows``.
- many rows (prefill): the transposed weight dequantized a tile at a time into float32, then SGEMM
  (``quant.quant_linear`` drives the tiles).

Format codes (``quant._FMT``): 3 Q5_0, 4 Q5_1, 5 Q4_K, 6 Q5_K, 7 Q6_K.
"""

from __future__ import annotations

import numba as nb
import numpy as np

from rawpaged.kernels.cpu.gemm import TILE_M, TILE_N, _tile_4x6
from rawpaged.kernels.cpu.intrinsics import half_to_float, high_nibble, low_nibble, prefetch, quant_bits, signed_byte
from rawpaged.kernels.quantization import QK, QK_K, SUBBLOCK_BITS, SubBlockPlanes

R = 16
_FAST = {"nnan", "ninf", "nsz", "arcp", "contract", "afn"}
_JIT = dict(cache=True, nogil=True, fastmath=_FAST)
CHUNKS = 128
PREFETCH_BYTES = 4096
ROWS_PER_PASS = 3 * R
#: format name -> code; the codes continue ``quant``'s 0-2
CODES = {"Q5_0": 3, "Q5_1": 4, "Q4_K": 5, "Q5_K": 6, "Q6_K": 7}
_SUBS_PER_SUPER = QK_K // QK


def interleave(plane: np.ndarray, groups: int) -> np.ndarray:
    """``[rows, n, inner]`` -> ``[groups, n, inner, R]`` (rows padded with zeros to ``groups * R``)."""
    rows = plane.shape[0]
    p = np.pad(plane, ((0, groups * R - rows),) + ((0, 0),) * (plane.ndim - 1))
    return np.ascontiguousarray(p.reshape(groups, R, *plane.shape[1:]).transpose(0, 2, 3, 1))


def repack_subblock(planes: SubBlockPlanes) -> dict:
    """The interleaved planes of a sub-block weight: ``qs`` uint8 ``[groups, nsub, 16, R]``, ``qh`` uint8
    ``[groups, nsub, hb, R]``, ``scales``/``mins`` uint16 ``[groups, nscale, R]`` and ``sub`` uint8
    ``[groups, nsub, 2, R]`` (``mins``/``sub`` are empty ``[groups, 0, ...]`` planes where the format has
    none). Zero padding rows dequantize to zero in every format (d = 0)."""
    rows = planes.shape[0]
    groups = -(-rows // R)
    nsub = planes.qs.shape[1]
    scales = interleave(planes.scales[:, :, None], groups)[:, :, 0, :].copy()
    mins = (
        interleave(planes.mins[:, :, None], groups)[:, :, 0, :].copy()
        if planes.mins is not None
        else np.zeros((groups, 0, R), np.uint16)
    )
    sub = interleave(planes.sub, groups) if planes.sub is not None else np.zeros((groups, 0, 2, R), np.uint8)
    qh = interleave(planes.qh, groups) if planes.qh.shape[2] else np.zeros((groups, nsub, 0, R), np.uint8)
    return dict(qs=interleave(planes.qs, groups), qh=qh, scales=scales, mins=mins, sub=sub)


def bits_of(code: int) -> int:
    """Bits per quant of a format code."""
    return SUBBLOCK_BITS[{v: k for k, v in CODES.items()}[code]]


@nb.njit(inline="always")
def _coeffs(fmt, scales, mins, sub, g, s, cf):
    """``cf [4, R]`` = (a_0, a_1, b_0, b_1) of sub-block s of group g's rows: half h's values are
    ``a_h * q + b_h`` (also Q4_0 and Q4_1, codes 1 and 2)."""
    nr = cf.shape[1]
    if fmt == 1 or fmt == 2:
        for r in range(nr):
            d = half_to_float(scales[g, s, r])
            b = half_to_float(mins[g, s, r]) if fmt == 2 else np.float32(-8.0) * d
            cf[0, r] = d
            cf[1, r] = d
            cf[2, r] = b
            cf[3, r] = b
    elif fmt == 3 or fmt == 4:
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
    if bits == 4:
        return low_nibble(qs[g, s, j, r]) if j < 16 else high_nibble(qs[g, s, j - 16, r])
    nib_shift = 0 if j < 16 else 4
    jj = j if j < 16 else j - 16
    if bits == 5:
        return quant_bits(qs[g, s, jj, r], nib_shift, qh[g, s, j >> 3, r], j & 7, 1)
    return quant_bits(qs[g, s, jj, r], nib_shift, qh[g, s, j >> 2, r], 2 * (j & 3), 3)


@nb.njit(parallel=True, **_JIT)
def gemv(fmt, x, qs, qh, scales, mins, sub, out):
    """``out [N] = dequantize(W) @ x [K]`` for one row x (float32). Also Q4_0 and Q4_1 (codes 1 and 2:
    ``quant``'s planes have this ``qs`` layout, with no ``qh``)."""
    groups, nsub = qs.shape[0], qs.shape[1]
    bits = 4 if fmt <= 2 or fmt == 5 else (6 if fmt == 7 else 5)
    N = out.shape[0]
    xs = np.empty((nsub, 2), np.float32)
    for s in range(nsub):
        a = np.float32(0.0)
        b = np.float32(0.0)
        for j in range(16):
            a += x[s * QK + j]
            b += x[s * QK + 16 + j]
        xs[s, 0] = a
        xs[s, 1] = b
    nchunks = min(groups, CHUNKS)
    scratch = np.empty((nchunks, 9, R), np.float32)
    for c in nb.prange(nchunks):
        cf = scratch[c, 0:4]
        acc = scratch[c, 4]
        sums = scratch[c, 5:9]
        for g in range(c * groups // nchunks, (c + 1) * groups // nchunks):
            for r in range(R):
                acc[r] = 0.0
            for s in range(nsub):
                start = (g * nsub + s) * 16 * R + PREFETCH_BYTES
                if start + 256 <= qs.size:
                    for line in range(0, 256, 64):
                        prefetch(qs, start + line)
                _coeffs(fmt, scales, mins, sub, g, s, cf)
                _sub_dot(bits, x, qs, qh, g, s, sums)
                for r in range(R):
                    acc[r] += (
                        cf[0, r] * (sums[0, r] + sums[1, r])
                        + cf[1, r] * (sums[2, r] + sums[3, r])
                        + cf[2, r] * xs[s, 0]
                        + cf[3, r] * xs[s, 1]
                    )
            for r in range(R):
                n = g * R + r
                if n < N:
                    out[n] = acc[r]


@nb.njit(inline="always")
def _sub_dot(bits, x, qs, qh, g, s, sums):
    """``sums [4, R]`` = the dot products of sub-block s's quants (rows of group g) with x's 32 values:
    rows 0-1 the first half (even, odd positions), rows 2-3 the second. The loop over the 16 rows is
    innermost, so it is the vector; four running sums keep the FMAs independent."""
    base = s * QK
    for r in range(R):
        sums[0, r] = 0.0
        sums[1, r] = 0.0
        sums[2, r] = 0.0
        sums[3, r] = 0.0
    for j in range(0, 16, 2):
        xa = x[base + j]
        xb = x[base + j + 1]
        ya = x[base + 16 + j]
        yb = x[base + 17 + j]
        if bits == 4:
            for r in range(R):
                q = qs[g, s, j, r]
                p = qs[g, s, j + 1, r]
                sums[0, r] += low_nibble(q) * xa
                sums[1, r] += low_nibble(p) * xb
                sums[2, r] += high_nibble(q) * ya
                sums[3, r] += high_nibble(p) * yb
        elif bits == 5:
            k = j >> 3
            sh = j & 7
            for r in range(R):
                q = qs[g, s, j, r]
                p = qs[g, s, j + 1, r]
                hl = qh[g, s, k, r]
                hh = qh[g, s, 2 + k, r]
                sums[0, r] += quant_bits(q, 0, hl, sh, 1) * xa
                sums[1, r] += quant_bits(p, 0, hl, sh + 1, 1) * xb
                sums[2, r] += quant_bits(q, 4, hh, sh, 1) * ya
                sums[3, r] += quant_bits(p, 4, hh, sh + 1, 1) * yb
        else:
            k = j >> 2
            sh = 2 * (j & 3)
            for r in range(R):
                q = qs[g, s, j, r]
                p = qs[g, s, j + 1, r]
                hl = qh[g, s, k, r]
                hh = qh[g, s, 4 + k, r]
                sums[0, r] += quant_bits(q, 0, hl, sh, 3) * xa
                sums[1, r] += quant_bits(p, 0, hl, sh + 2, 3) * xb
                sums[2, r] += quant_bits(q, 4, hh, sh, 3) * ya
                sums[3, r] += quant_bits(p, 4, hh, sh + 2, 3) * yb


@nb.njit(inline="always")
def _dequant_sub_t(bits, fmt, qs, qh, scales, mins, sub, g, s, cf, w, col):
    """``w[0:32, col + r]`` = sub-block s of row r of group g (float32), rows innermost (vectorized)."""
    _coeffs(fmt, scales, mins, sub, g, s, cf)
    nr = qs.shape[3]
    for j in range(16):
        for r in range(nr):
            w[j, col + r] = cf[0, r] * _value(bits, qs, qh, g, s, j, r) + cf[2, r]
    for j in range(16, 32):
        for r in range(nr):
            w[j, col + r] = cf[1, r] * _value(bits, qs, qh, g, s, j, r) + cf[3, r]


@nb.njit(parallel=True, **_JIT)
def gemm_rows(fmt, x, qs, qh, scales, mins, sub, out, max_chunks):
    """``out [Mp, P]`` = ``x [Mp, K]`` (Mp a multiple of TILE_M) times the weight's rows, P = the groups
    rounded up to ROWS_PER_PASS, as ``quant._gemm_rows``: 48 rows at a time dequantized (a sub-block of
    16 rows into a ``[32, 16]`` tile, then transposed into the row-major scratch) and multiplied by
    ``gemm``'s 4 x 6 tiles."""
    bits = 4 if fmt == 5 else (6 if fmt == 7 else 5)
    Mp = x.shape[0]
    groups, nsub = qs.shape[0], qs.shape[1]
    K = nsub * QK
    gpp = ROWS_PER_PASS // R
    passes = -(-groups // gpp)
    nchunks = min(passes, max_chunks)
    rows = np.empty((nchunks, ROWS_PER_PASS, K), np.float32)
    tiles = np.empty((nchunks, QK, R), np.float32)
    cfs = np.empty((nchunks, 4, R), np.float32)
    for c in nb.prange(nchunks):
        w = rows[c]
        t = tiles[c]
        cf = cfs[c]
        for p in range(c * passes // nchunks, (c + 1) * passes // nchunks):
            for gi in range(gpp):
                g = p * gpp + gi
                if g >= groups:
                    w[gi * R : (gi + 1) * R, :] = 0.0
                    continue
                for s in range(nsub):
                    _dequant_sub_t(bits, fmt, qs, qh, scales, mins, sub, g, s, cf, t, 0)
                    for r in range(R):
                        for j in range(QK):
                            w[gi * R + r, s * QK + j] = t[j, r]
            for m in range(0, Mp, TILE_M):
                for tt in range(ROWS_PER_PASS // TILE_N):
                    _tile_4x6(x, w, out, m, tt * TILE_N, p * ROWS_PER_PASS + tt * TILE_N)


@nb.njit(**_JIT)
def dequant_tile_t(fmt, qs, qh, scales, mins, sub, g0, out):
    """``out [K, n]`` = rows ``g0 * R ..`` of the weight dequantized and transposed (n a multiple of R)."""
    bits = 4 if fmt == 5 else (6 if fmt == 7 else 5)
    nsub = qs.shape[1]
    cf = np.empty((4, R), np.float32)
    for gi in range(out.shape[1] // R):
        for s in range(nsub):
            _dequant_sub_t(bits, fmt, qs, qh, scales, mins, sub, g0 + gi, s, cf, out[s * QK : (s + 1) * QK], gi * R)


@nb.njit(**_JIT)
def dequant_rows(fmt, qs, qh, scales, mins, sub, rows, out):
    """``out[i]`` = row ``rows[i]``, dequantized (float32)."""
    bits = 4 if fmt == 5 else (6 if fmt == 7 else 5)
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
