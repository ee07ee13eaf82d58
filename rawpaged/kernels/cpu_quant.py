"""CPU (Numba) products with GGUF block-quantized weights (``rawpaged.kernels.quantization``: the
formats and their planes), dequantized in registers.

``quant_linear(x, w)`` computes ``x @ dequantize(w).T`` for x float32 ``[M, K]`` and a
``QuantizedTensor`` ``[N, K]``:

- M = 1 (decode at batch 1, memory-bound): two weight rows per pass, each one long loop over its quant
  bytes with the block's scale picked as ``d[k >> 4]`` (``k >> 5`` for Q8_0), so the loop vectorizes and
  every x element loaded serves both rows. A nibble byte ``q`` is split in float32 (``hi = floor(q / 16)``,
  ``lo = q - 16 hi``, both exact): Numba widens integer ``&``/``>>`` to 64 bits, which halves the vector
  width. x is split once per call into its low-nibble and high-nibble halves (elements 0-15 and 16-31 of
  each block, in the order the nibble bytes hold them) and its per-block sums, so Q4_1's minimum (Q4_0's
  -8 d) costs one multiply per block, as in llama.cpp's dot products.
- 1 < M <= ``SMALL_BATCH``: each row is dequantized once into a scratch row and applied to every x row.
- larger M (prefill, big batches): up to ``TILE_BYTES`` of rows at a time are dequantized (on one
  thread, see ``_dequant_tile``) into float32 scratch tiles that go through SGEMM as ``tile @ x.T`` (two,
  against x's halves, for the 4-bit formats), so compute-bound products run at BLAS speed.

Rows are split across threads in up to ``CHUNKS`` chunks, each with its own scratch (fp16 scales are
converted through a 65536-entry float32 table, exact for every fp16 value). On AVX-512 hosts these loops
get 512-bit vectors (``rawpaged.kernels.numba_target``).
"""

from __future__ import annotations

import numba as nb
import numpy as np

from rawpaged.kernels.quantization import QK, QuantizedTensor

_JIT = dict(cache=True, nogil=True, fastmath=True)
F16_TO_F32 = np.arange(65536, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)
SMALL_BATCH = 8
#: the products' rows are split into this many chunks (or fewer), each with its own scratch, which
#: numba's prange deals out to the threads: enough to balance dozens of threads.
CHUNKS = 128
#: float32 bytes of one dequantized tile: whole weights of the default model's layers fit in one, so a
#: product is one dequantization and one SGEMM (the 49152-row head takes 12).
TILE_BYTES = 8 << 20
_FMT = {"Q8_0": 0, "Q4_0": 1, "Q4_1": 2}


@nb.njit(parallel=True, **_JIT)
def _gemv_q8_0(x, qs, scales, lut, out):
    N, K = qs.shape
    nblk = scales.shape[1]
    npairs = (N + 1) // 2
    nchunks = min(npairs, CHUNKS)
    scratch = np.empty((nchunks, 2, nblk), np.float32)
    for c in nb.prange(nchunks):
        d0 = scratch[c, 0]
        d1 = scratch[c, 1]
        for p in range(c * npairs // nchunks, (c + 1) * npairs // nchunks):
            n0 = 2 * p
            n1 = min(n0 + 1, N - 1)  # an odd last row is computed twice
            for b in range(nblk):
                d0[b] = lut[scales[n0, b]]
                d1[b] = lut[scales[n1, b]]
            r0 = qs[n0]
            r1 = qs[n1]
            a0 = np.float32(0.0)
            a1 = np.float32(0.0)
            for k in range(K):
                xk = x[k]
                a0 += d0[k >> 5] * (np.float32(r0[k]) * xk)
                a1 += d1[k >> 5] * (np.float32(r1[k]) * xk)
            out[n0] = a0
            out[n1] = a1


@nb.njit(parallel=True, **_JIT)
def _gemv_q4(x, qs, scales, mins, has_min, lut, out):
    N, K2 = qs.shape
    nblk = scales.shape[1]
    xlo = np.empty(K2, np.float32)
    xhi = np.empty(K2, np.float32)
    xsum = np.empty(nblk, np.float32)
    for b in range(nblk):
        s = np.float32(0.0)
        for j in range(16):
            xlo[b * 16 + j] = x[b * QK + j]
            xhi[b * 16 + j] = x[b * QK + 16 + j]
            s += x[b * QK + j] + x[b * QK + 16 + j]
        xsum[b] = s
    npairs = (N + 1) // 2
    nchunks = min(npairs, CHUNKS)
    scratch = np.empty((nchunks, 4, nblk), np.float32)
    sixteenth = np.float32(0.0625)
    sixteen = np.float32(16.0)
    for c in nb.prange(nchunks):
        d0 = scratch[c, 0]
        d1 = scratch[c, 1]
        m0 = scratch[c, 2]
        m1 = scratch[c, 3]
        for p in range(c * npairs // nchunks, (c + 1) * npairs // nchunks):
            n0 = 2 * p
            n1 = min(n0 + 1, N - 1)  # an odd last row is computed twice
            for b in range(nblk):
                d0[b] = lut[scales[n0, b]]
                d1[b] = lut[scales[n1, b]]
                m0[b] = lut[mins[n0, b]] if has_min else np.float32(-8.0) * d0[b]
                m1[b] = lut[mins[n1, b]] if has_min else np.float32(-8.0) * d1[b]
            r0 = qs[n0]
            r1 = qs[n1]
            a0 = np.float32(0.0)
            a1 = np.float32(0.0)
            for k in range(K2):
                xl = xlo[k]
                xh = xhi[k]
                q = np.float32(r0[k])
                hi = np.floor(q * sixteenth)
                a0 += d0[k >> 4] * ((q - sixteen * hi) * xl + hi * xh)
                q = np.float32(r1[k])
                hi = np.floor(q * sixteenth)
                a1 += d1[k >> 4] * ((q - sixteen * hi) * xl + hi * xh)
            for b in range(nblk):
                a0 += m0[b] * xsum[b]
                a1 += m1[b] * xsum[b]
            out[n0] = a0
            out[n1] = a1


@nb.njit(inline="always")
def _dequant_row(fmt, qs, scales, mins, n, lut, dst):
    """dst[0:K] = row n, dequantized."""
    nblk = scales.shape[1]
    for b in range(nblk):
        d = lut[scales[n, b]]
        base = b * QK
        if fmt == 0:
            for j in range(QK):
                dst[base + j] = d * np.float32(qs[n, base + j])
        else:
            m = lut[mins[n, b]] if fmt == 2 else np.float32(-8.0) * d
            for j in range(16):
                qi = np.int32(qs[n, b * 16 + j])
                dst[base + j] = d * np.float32(qi & 15) + m
                dst[base + 16 + j] = d * np.float32(qi >> 4) + m


@nb.njit(parallel=True, **_JIT)
def _gemm_small(fmt, x, qs, scales, mins, lut, out):
    M, K = x.shape
    N = qs.shape[0]
    nchunks = min(N, CHUNKS)
    scratch = np.empty((nchunks, K), np.float32)
    for c in nb.prange(nchunks):
        w = scratch[c]
        for n in range(c * N // nchunks, (c + 1) * N // nchunks):
            _dequant_row(fmt, qs, scales, mins, n, lut, w)
            for mi in range(M):
                s = np.float32(0.0)
                for k in range(K):
                    s += w[k] * x[mi, k]
                out[mi, n] = s


@nb.njit(**_JIT)  # serial: a parallel region right after SGEMM fights OpenBLAS's spinning threads (4x slower)
def _dequant_tile(fmt, qs, scales, mins, r0, lut, out_lo, out_hi):
    """Rows ``r0 ..`` of the weight, dequantized: Q8_0 into ``out_lo [rows, K]``; a 4-bit format into
    ``out_lo``/``out_hi [rows, K / 2]`` (the low and high nibbles: elements 0-15 and 16-31 of each block,
    in the order of x's ``xlo``/``xhi`` halves). One block's scale is a scalar in its loop (a scale
    gathered per element, ``d[k >> 4]``, keeps LLVM from vectorizing the stores)."""
    nblk = scales.shape[1]
    sixteenth = np.float32(0.0625)
    sixteen = np.float32(16.0)
    for i in range(out_lo.shape[0]):
        n = r0 + i
        row = qs[n]
        lo = out_lo[i]
        hi = out_hi[i]
        for b in range(nblk):
            d = lut[scales[n, b]]
            if fmt == 0:
                for k in range(b * QK, (b + 1) * QK):
                    lo[k] = d * np.float32(row[k])
            else:
                m = lut[mins[n, b]] if fmt == 2 else np.float32(-8.0) * d
                for k in range(b * 16, (b + 1) * 16):
                    q = np.float32(row[k])
                    h = np.floor(q * sixteenth)
                    lo[k] = d * (q - sixteen * h) + m
                    hi[k] = d * h + m


@nb.njit(**_JIT)
def _dequant_rows(fmt, qs, scales, mins, rows, lut, out):
    """out[i] = row ``rows[i]``, dequantized (float32)."""
    for i in range(rows.shape[0]):
        _dequant_row(fmt, qs, scales, mins, rows[i], lut, out[i])


def _planes(w: QuantizedTensor):
    qs = w.qs.view(np.int8) if w.qtype == "Q8_0" else w.qs
    mins = w.mins if w.mins is not None else w.scales  # unread for Q8_0/Q4_0
    return qs, w.scales, mins


def quant_linear(x: np.ndarray, w: QuantizedTensor) -> np.ndarray:
    """float32 ``x [M, K] @ dequantize(w).T`` -> ``[M, N]`` (see the module docstring for the paths).

    Raises ValueError when K differs from the weight's columns."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    M, K = x.shape
    N, cols = w.shape
    if K != cols:
        raise ValueError(f"x has {K} columns, the {w.qtype} weight {cols}")
    fmt = _FMT[w.qtype]
    qs, scales, mins = _planes(w)
    out = np.empty((M, N), np.float32)
    if M == 1:
        if fmt == 0:
            _gemv_q8_0(x[0], qs, scales, F16_TO_F32, out[0])
        else:
            _gemv_q4(x[0], qs, scales, mins, fmt == 2, F16_TO_F32, out[0])
        return out
    if M <= SMALL_BATCH:
        _gemm_small(fmt, x, qs, scales, mins, F16_TO_F32, out)
    else:  # out.T [N, M] tile by tile = tile [n, K] @ x.T: SGEMM's fastest form here (1.6x x @ tile.T)
        if fmt == 0:
            xt_lo = np.ascontiguousarray(x.T)
        else:  # x's halves in the nibbles' order: elements 0-15 / 16-31 of each block
            blocks = x.reshape(M, -1, QK)
            xt_lo = np.ascontiguousarray(blocks[:, :, :16].reshape(M, -1).T)
            xt_hi = np.ascontiguousarray(blocks[:, :, 16:].reshape(M, -1).T)
        width = K if fmt == 0 else K // 2
        tile_rows = min(N, max(1, TILE_BYTES // (4 * K)))
        lo = np.empty((tile_rows, width), np.float32)
        hi = np.empty_like(lo) if fmt != 0 else lo
        part = np.empty((tile_rows, M), np.float32) if fmt != 0 else None
        out_t = np.empty((N, M), np.float32)
        for r0 in range(0, N, tile_rows):
            n = min(tile_rows, N - r0)
            _dequant_tile(fmt, qs, scales, mins, r0, F16_TO_F32, lo[:n], hi[:n])
            np.matmul(lo[:n], xt_lo, out=out_t[r0 : r0 + n])
            if fmt != 0:
                np.matmul(hi[:n], xt_hi, out=part[:n])
                out_t[r0 : r0 + n] += part[:n]
        out[:] = out_t.T
    return out


def quant_embedding(token_ids: np.ndarray, w: QuantizedTensor) -> np.ndarray:
    """float32 rows ``token_ids`` of a quantized ``[vocab, hidden]`` table, dequantized on lookup."""
    ids = np.asarray(token_ids, dtype=np.int64)
    out = np.empty((ids.shape[0], w.shape[1]), np.float32)
    qs, scales, mins = _planes(w)
    _dequant_rows(_FMT[w.qtype], qs, scales, mins, ids, F16_TO_F32, out)
    return out
