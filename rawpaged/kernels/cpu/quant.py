"""CPU (Numba) products with GGUF block-quantized weights (``rawpaged.kernels.quantization``: the
formats and their planes), dequantized in registers.

Weights are ``quant_weights.RepackedQuantized`` (16 rows interleaved) or ``StackedQuantized``.

``quant_linear(x, w)`` computes ``x @ dequantize(w).T`` for x float32 ``[M, K]``:

- M = 1 (decode at batch 1, where every weight byte is read once per token): one pass over each group.
  The loop over the 16 rows is the vector (a 512-bit register on AVX-512 hosts, two 256-bit ones
  elsewhere); the loop over a block's positions is unrolled with four running sums, so no horizontal
  reduction is ever needed and the scale and minimum are applied once per block per row:
  ``out[n] += d * sum_j q_j x_j + m * sum_j x_j`` (Q4_1's minimum, and Q4_0's ``-8 d``, cost one
  multiply per block, as in llama.cpp's dot products). The bytes a few kilobytes ahead are prefetched.
- 1 < M <= ``ROWS_MAX_BATCH`` (batched decode): 48 weight rows at a time are dequantized into a
  row-major ``[48, K]`` float32 scratch (L2) and multiplied with ``gemm``'s register tiles (4 x 6 with
  AVX-512, 4 x 3 on AVX2 hosts, whose 16 vector registers the 4 x 6 tile's accumulators overflow). A
  block of 16 interleaved rows is dequantized and transposed in vector registers
  (``intrinsics.q4_block_rows``), so the scratch costs about one float32 store per weight.
- larger M (prefill, big batches): the transposed weight is dequantized ``TILE_BYTES`` at a time (on one
  thread, see ``_dequant_tile_t``) into a float32 ``[K, n]`` tile and goes through SGEMM (``x @ tile``),
  so compute-bound products run at BLAS speed.

Groups are split across threads in up to ``CHUNKS`` chunks, each with its own scratch. The vectorized
loops are compiled without floating-point reassociation, so LLVM keeps the independent running sums.
"""

from __future__ import annotations

import numba as nb
import numpy as np

from rawpaged.kernels.cpu import quant_subblock as sb
from rawpaged.kernels.cpu.gemm import pad_rows, rows_tiles
from rawpaged.kernels.cpu.intrinsics import (
    half_to_float,
    high_nibble,
    low_nibble,
    prefetch,
    q4_block_rows,
    q8_block_rows,
    signed_byte,
)
from rawpaged.kernels.cpu.quant_layout import CHUNKS, JIT, PREFETCH_BYTES, ROWS_PER_PASS, R
from rawpaged.kernels.cpu.quant_weights import RepackedQuantized, StackedQuantized, kernel_planes
from rawpaged.kernels.quantization import FORMAT_CODES, QK

_JIT = JIT
#: up to this many x rows (from 2) a product dequantizes 48 weight rows at a time into a row-major
#: scratch and multiplies them in ``gemm``'s register tiles (``_gemm_rows``); above, tiles go
#: through SGEMM (and no OpenBLAS threads are left spinning against the Numba kernels around it, as
#: ``gemm.SMALL_M``). Against the block-at-a-time kernel it replaced (default model's Q4_1 layer
#: shapes, 2-core AVX-512 host): equal at M = 2, 1.5x at 4, 1.9x at 8, 2x at 16 and 32. Against the
#: SGEMM tiles: 4x at M = 2-8, 1.7x at 32, 1.4x at 64, 1.25x at 192, equal at 256.
ROWS_MAX_BATCH = 256
#: float32 bytes of one dequantized tile: whole weights of the default model's layers fit in one, so a
#: product is one dequantization and one SGEMM (the 49152-row head takes 14).
TILE_BYTES = 8 << 20
_FMT = FORMAT_CODES


@nb.njit(inline="always")
def _prefetch_ahead(qs, offset, nbytes):
    """Prefetch ``nbytes`` (a multiple of 64) of ``qs`` from ``offset`` + ``PREFETCH_BYTES``."""
    start = offset + PREFETCH_BYTES
    if start + nbytes <= qs.size:
        for line in range(0, nbytes, 64):
            prefetch(qs, start + line)


@nb.njit(inline="always")
def block_sums(x, nblk):
    """float32 ``[nblk]``: the sums of ``x``'s 32-value blocks."""
    xsum = np.empty(nblk, np.float32)
    for b in range(nblk):
        s = np.float32(0.0)
        for j in range(QK):
            s += x[b * QK + j]
        xsum[b] = s
    return xsum


@nb.njit(inline="always")
def gemv_group_q8_0(x, qs, scales, g, acc):
    """``acc[r]`` = row ``g * R + r`` of a Q8_0 weight dotted with float32 ``x [K]`` (r < R): the M = 1
    product's work on one group, shared with ``moe_quant``'s grouped products."""
    nblk = qs.shape[1]
    for r in range(R):
        acc[r] = 0.0
    for b in range(nblk):
        _prefetch_ahead(qs, (g * nblk + b) * QK * R, QK * R)
        for r in range(R):
            s0 = np.float32(0.0)
            s1 = np.float32(0.0)
            s2 = np.float32(0.0)
            s3 = np.float32(0.0)
            for j in range(0, QK, 4):
                s0 += signed_byte(qs[g, b, j, r]) * x[b * QK + j]
                s1 += signed_byte(qs[g, b, j + 1, r]) * x[b * QK + j + 1]
                s2 += signed_byte(qs[g, b, j + 2, r]) * x[b * QK + j + 2]
                s3 += signed_byte(qs[g, b, j + 3, r]) * x[b * QK + j + 3]
            acc[r] += half_to_float(scales[g, b, r]) * ((s0 + s1) + (s2 + s3))


@nb.njit(inline="always")
def gemv_group_q4(x, xsum, qs, scales, mins, fmt, g, acc, dm):
    """``acc[r]`` = row ``g * R + r`` of a Q4_0 (``fmt`` 1) or Q4_1 (2) weight dotted with float32 ``x [K]``,
    ``xsum`` its per-block sums (``block_sums``); ``dm``: float32 ``[2, R]`` scratch."""
    nblk = qs.shape[1]
    for r in range(R):
        acc[r] = 0.0
    for b in range(nblk):
        _prefetch_ahead(qs, (g * nblk + b) * 16 * R, 16 * R)
        _block_scales(fmt, scales, mins, g, b, dm)  # before the row loop: it stays branch-free
        xs = xsum[b]
        for r in range(R):
            s0 = np.float32(0.0)
            s1 = np.float32(0.0)
            s2 = np.float32(0.0)
            s3 = np.float32(0.0)
            for j in range(0, 16, 2):
                q = qs[g, b, j, r]
                s0 += low_nibble(q) * x[b * QK + j]
                s1 += high_nibble(q) * x[b * QK + 16 + j]
                q = qs[g, b, j + 1, r]
                s2 += low_nibble(q) * x[b * QK + j + 1]
                s3 += high_nibble(q) * x[b * QK + 17 + j]
            acc[r] += dm[0, r] * ((s0 + s1) + (s2 + s3)) + dm[1, r] * xs


@nb.njit(parallel=True, **_JIT)
def _gemv_q8_0(x, qs, scales, out):
    groups = qs.shape[0]
    N = out.shape[0]
    nchunks = min(groups, CHUNKS)
    scratch = np.empty((nchunks, R), np.float32)
    for c in nb.prange(nchunks):
        acc = scratch[c]
        for g in range(c * groups // nchunks, (c + 1) * groups // nchunks):
            gemv_group_q8_0(x, qs, scales, g, acc)
            for r in range(R):
                n = g * R + r
                if n < N:
                    out[n] = acc[r]


@nb.njit(parallel=True, **_JIT)
def _gemv_q4(x, qs, scales, mins, has_min, out):
    groups, nblk = qs.shape[0], qs.shape[1]
    N = out.shape[0]
    xsum = block_sums(x, nblk)
    fmt = 2 if has_min else 1
    nchunks = min(groups, CHUNKS)
    scratch = np.empty((nchunks, 3, R), np.float32)
    for c in nb.prange(nchunks):
        acc = scratch[c, 2]
        dm = scratch[c, :2]
        for g in range(c * groups // nchunks, (c + 1) * groups // nchunks):
            gemv_group_q4(x, xsum, qs, scales, mins, fmt, g, acc, dm)
            for r in range(R):
                n = g * R + r
                if n < N:
                    out[n] = acc[r]


@nb.njit(inline="always")
def _block_scales(fmt, scales, mins, g, b, dm):
    """``dm [2, R]`` = the scales and minimums (Q4_0: ``-8 d``) of block b of group g's rows."""
    for r in range(dm.shape[1]):
        d = half_to_float(scales[g, b, r])
        dm[0, r] = d
        dm[1, r] = half_to_float(mins[g, b, r]) if fmt == 2 else np.float32(-8.0) * d


@nb.njit(inline="always")
def _dequant_block(fmt, qs, scales, mins, g, b, dm, w, col):
    """``w[0:32, col + r]`` = position 0-31 of block b of row r of group g, as float32 (``dm [2, R]``:
    scratch for the rows' scales and minimums). The rows are the innermost loop, with few streams in
    and out, so LLVM vectorizes it (with rows outermost it gives up on its alias checks)."""
    nr = qs.shape[3]  # R, as a run-time count: LLVM then vectorizes these loops instead of unrolling them
    _block_scales(fmt, scales, mins, g, b, dm)
    if fmt == 0:
        for j in range(QK):
            for r in range(nr):
                w[j, col + r] = dm[0, r] * signed_byte(qs[g, b, j, r])
    else:
        for j in range(16):
            for r in range(nr):
                q = qs[g, b, j, r]
                w[j, col + r] = dm[0, r] * low_nibble(q) + dm[1, r]
                w[16 + j, col + r] = dm[0, r] * high_nibble(q) + dm[1, r]


@nb.njit(inline="always")
def group_rows(fmt, qs, scales, mins, g, dm, w, row0):
    """``w[row0 + r, :]`` = row r of group g (Q8_0, Q4_0, Q4_1), a block of 16 rows at a time in vector
    registers (``intrinsics.q4_block_rows``); ``dm``: C-contiguous float32 ``[2 or more, R]`` scratch."""
    nblk, L = qs.shape[1], qs.shape[2]
    for b in range(nblk):
        _block_scales(fmt, scales, mins, g, b, dm)
        if fmt == 0:
            q8_block_rows(qs, (g * nblk + b) * L * R, dm, w, row0, b * QK)
        else:
            q4_block_rows(qs, (g * nblk + b) * L * R, dm, w, row0, b * QK)


@nb.njit(parallel=True, **_JIT)
def _gemm_rows(fmt, x, qs, qh, scales, mins, sub, out, max_chunks):
    """``out [Mp, P]`` = ``x [Mp, K]`` (Mp a multiple of TILE_M) times the weight's rows, P = the groups
    rounded up to ROWS_PER_PASS, in every format: 48 rows at a time are dequantized into an ``[48, K]``
    row-major float32 scratch (``group_rows``; the sub-block formats' ``quant_subblock.group_rows``),
    then multiplied by ``gemm.rows_tiles`` (rows past the weight's groups are zero). ``max_chunks``:
    passes are split into at most this many chunks, each with its own 110 KB scratch (at K = 576), so it
    is sized to the threads, not to CHUNKS."""
    groups, nblk = qs.shape[0], qs.shape[1]
    gpp = ROWS_PER_PASS // R
    passes = -(-groups // gpp)
    nchunks = min(passes, max_chunks)
    rows = np.empty((nchunks, ROWS_PER_PASS, nblk * QK), np.float32)
    cfs = np.empty((nchunks, 4, R), np.float32)
    for c in nb.prange(nchunks):
        w = rows[c]
        cf = cfs[c]
        for p in range(c * passes // nchunks, (c + 1) * passes // nchunks):
            for gi in range(gpp):
                g = p * gpp + gi
                if g >= groups:
                    w[gi * R : (gi + 1) * R, :] = 0.0
                elif fmt >= 3:
                    sb.group_rows(fmt, qs, qh, scales, mins, sub, g, cf, w, gi * R)
                else:
                    group_rows(fmt, qs, scales, mins, g, cf, w, gi * R)
            rows_tiles(x, w, out, p * ROWS_PER_PASS)


@nb.njit(**_JIT)  # serial: a parallel region right after SGEMM fights OpenBLAS's spinning threads (~7 ms)
def _dequant_tile_t(fmt, qs, scales, mins, g0, out):
    """``out [K, n]`` = rows ``g0 * R ..`` of the weight dequantized and transposed (n a multiple of R):
    each block's 16 rows land in one contiguous run of ``out``'s row, a vector store."""
    nblk = qs.shape[1]
    dm = np.empty((2, R), np.float32)
    for gi in range(out.shape[1] // R):
        for b in range(nblk):
            _dequant_block(fmt, qs, scales, mins, g0 + gi, b, dm, out[b * QK : (b + 1) * QK], gi * R)


@nb.njit(**_JIT)
def _dequant_rows(fmt, qs, scales, mins, rows, out):
    """out[i] = row ``rows[i]``, dequantized (float32)."""
    nblk = qs.shape[1]
    for i in range(rows.shape[0]):
        g = rows[i] // R
        r = rows[i] % R
        for b in range(nblk):
            d = half_to_float(scales[g, b, r])
            if fmt == 0:
                for j in range(QK):
                    out[i, b * QK + j] = d * signed_byte(qs[g, b, j, r])
            else:
                m = half_to_float(mins[g, b, r]) if fmt == 2 else np.float32(-8.0) * d
                for j in range(16):
                    q = qs[g, b, j, r]
                    out[i, b * QK + j] = d * low_nibble(q) + m
                    out[i, b * QK + 16 + j] = d * high_nibble(q) + m


def quant_linear(x: np.ndarray, w: RepackedQuantized | StackedQuantized) -> np.ndarray:
    """float32 ``x [M, K] @ dequantize(w).T`` -> ``[M, N]`` (see the module docstring for the paths; a
    ``StackedQuantized`` weight part by part).

    Raises ValueError when K differs from the weight's columns, or for a weight not repacked."""
    if isinstance(w, StackedQuantized):
        outs = [quant_linear(x, p) for p in w.parts]
        return np.concatenate(outs, axis=1)
    if not isinstance(w, RepackedQuantized):
        kind = type(w).__name__
        raise ValueError(f"quant_linear takes a RepackedQuantized weight (quant_weights.repack), not {kind}")
    x = np.ascontiguousarray(x, dtype=np.float32)
    M, K = x.shape
    N, cols = w.shape
    if K != cols:
        raise ValueError(f"x has {K} columns, the {w.qtype} weight {cols}")
    fmt = _FMT[w.qtype]
    qs, qh, scales, mins, sub = kernel_planes(w)
    if M <= ROWS_MAX_BATCH:
        xp = x if M == 1 else pad_rows(x)
        out = np.empty((xp.shape[0], N), np.float32)
        rows_into(fmt, xp, qs, qh, scales, mins, sub, out, 4 * nb.get_num_threads())
        return out[:M]
    out = np.empty((M, N), np.float32)
    groups = qs.shape[0]
    tile_groups = max(1, min(groups, TILE_BYTES // (4 * K * R)))
    buf = np.empty(K * tile_groups * R, np.float32)
    for g0 in range(0, groups, tile_groups):
        g1 = min(groups, g0 + tile_groups)
        tile = buf[: K * (g1 - g0) * R].reshape(K, (g1 - g0) * R)
        if fmt >= 3:
            sb.dequant_tile_t(fmt, qs, qh, scales, mins, sub, g0, tile)
        else:
            _dequant_tile_t(fmt, qs, scales, mins, g0, tile)
        n0, n1 = g0 * R, min(N, g1 * R)
        if n0 == 0 and n1 == N and tile.shape[1] == N:
            np.matmul(x, tile, out=out)
        else:
            out[:, n0:n1] = (x @ tile)[:, : n1 - n0]
    return out


@nb.njit(**_JIT)
def rows_into(fmt, x, qs, qh, scales, mins, sub, out, max_chunks):
    """``out [Mp, N] = x [Mp, K] @ dequantize(W).T`` for one row (the GEMVs) or Mp a multiple of TILE_M up
    to ROWS_MAX_BATCH (``_gemm_rows``), W given as its format code (``_FMT``) and planes
    (``quant_weights.kernel_planes``): what ``quant_linear`` runs for those rows, callable from compiled
    code (``fused_decode``).
    ``max_chunks``: as ``_gemm_rows`` takes it (Numba's thread count is read by the caller: reading it
    in compiled code keeps that code from being cached). Up to ``quant_subblock.INT_MAX_ROWS`` rows the
    sub-block formats (``fmt`` >= 3) go through ``quant_subblock.gemv``; only they read ``qh`` and ``sub``."""
    if fmt >= 3 and x.shape[0] <= sb.INT_MAX_ROWS:
        sb.gemv(fmt, x, qs, qh, scales, mins, sub, out)
        return
    if fmt < 3 and x.shape[0] == 1:
        if fmt == 0:
            _gemv_q8_0(x[0], qs, scales, out[0])
        else:
            _gemv_q4(x[0], qs, scales, mins, fmt == 2, out[0])
        return
    passes = -(-qs.shape[0] * R // ROWS_PER_PASS)
    res = np.empty((x.shape[0], passes * ROWS_PER_PASS), np.float32)
    _gemm_rows(fmt, x, qs, qh, scales, mins, sub, res, max_chunks)
    n = out.shape[1]
    for r in range(x.shape[0]):
        out[r, :] = res[r, :n]


def quant_embedding(token_ids: np.ndarray, w: RepackedQuantized) -> np.ndarray:
    """float32 rows ``token_ids`` of a quantized ``[vocab, hidden]`` table, dequantized on lookup."""
    ids = np.asarray(token_ids, dtype=np.int64)
    out = np.empty((ids.shape[0], w.shape[1]), np.float32)
    qs, qh, scales, mins, sub = kernel_planes(w)
    fmt = _FMT[w.qtype]
    if fmt >= 3:
        sb.dequant_rows(fmt, qs, qh, scales, mins, sub, ids, out)
    else:
        _dequant_rows(fmt, qs, scales, mins, ids, out)
    return out
