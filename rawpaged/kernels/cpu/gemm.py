"""CPU (Numba) float32 products with few rows: ``x [M, K] @ w.T`` for a weight ``w [N, K]`` in HF's
``[out, in]`` layout, for the M of batched decode.

OpenBLAS's SGEMM packs a panel of the weight before it multiplies, so at small M it moves every weight
about three times where a matrix-vector product moves it once: on a 2-core AVX-512 host the 30 layers of
the default model cost 2.2x the M = 1 time at M = 2 and 2.4x at M = 8 (benchmarks/RESULTS.md). Decode at
those batch sizes should cost about what one pass over the weights costs.

``gemm_nt`` computes tiles of 4 x rows by 6 weight rows (3 on a host without AVX-512: ``GEMM_TILE_N``) as 24
dot products that run together along K: each
step loads 4 vectors of x and 6 of the weight (the weight rows come from L1 for every x tile after the
first) and does 24 fused multiply-adds into 24 vector accumulators, which are summed horizontally once, at
the end of K (the register tiling of llamafile's tinyBLAS, ``llamafile/sgemm.cpp``, which
llama.cpp uses for its own float matmuls). The weight is streamed from memory once per call, in order;
the rows of x stay in L1/L2. Rows of x are padded to a multiple of 4, and weight rows past the last
multiple of 6 go through a 4 x 1 tile. Threads split the weight rows.

One row (M = 1, decode at batch 1) takes dot products along K, four weight rows at a time (each x
vector loaded once for the four): in the default model's decode one row at a time ran the layers and
head 1.2-1.4x faster than OpenBLAS's SGEMV on the transposed layout (``x @ w`` with ``w [K, N]``) and
1.5x faster than its SGEMV on this one; four at a time are another 10-15% faster.

The tiles are compiled with floating-point reassociation so LLVM vectorizes the K loops: the sums are
taken in another order than BLAS's (float32 rounding differs, ~1e-6 relative).
"""

from __future__ import annotations

import llvmlite.binding as llvm
import numba as nb
import numpy as np

_JIT = dict(cache=True, nogil=True, fastmath={"nnan", "ninf", "nsz", "arcp", "contract", "afn", "reassoc"})
#: rows of x a tile takes (and x is padded to a multiple of)
TILE_M = 4
#: weight rows a tile takes (4 x 6 measured best of 4 x 4, 4 x 6, 4 x 8, 8 x 3 and 2 x 12 on a 2-core
#: AVX-512 host: 24 vector accumulators, 10 loads per 24 multiply-adds)
TILE_N = 6


def _has_avx512() -> bool:
    """Whether the host has AVX-512 (llvmlite's view of it; False where it cannot tell)."""
    try:
        return bool(llvm.get_host_cpu_features().get("avx512f"))
    except Exception:  # noqa: BLE001 - an unknown host takes the narrow tile
        return False


#: weight rows per tile of ``gemm_nt``: the 4 x 6 tile's 24 vector accumulators fit AVX-512's 32 registers;
#: with AVX2's 16 they spill, and a 4 x 3 tile (12 accumulators, 7 loads per 12 multiply-adds) is faster:
#: on a 2-core AMD EPYC (Zen 3, AVX2) the default model's 30 layers and head at M = 4 took 18.9 ms with
#: 4 x 3 tiles, 30.7 with 4 x 2 and 74.0 with 4 x 6 (at M = 8: 32.0, 47.4 and 54.9 ms)
GEMM_TILE_N = TILE_N if _has_avx512() else 3
#: ``CPUBackend.linear`` uses ``gemm_nt`` up to SMALL_M rows, BLAS above (all 30 layers of the default
#: model, 2-core AVX-512 host: 1.5-1.8x SGEMM's speed at M = 2-8, 1.3x at 32, about equal from 64 to
#: 256, 0.8x at 512)
SMALL_M = 128
#: M = 1: weight rows split into this many chunks
GEMV_CHUNKS = 16
#: M = 1: weight rows per dot-product group (4 measured 10-15% faster than 1 over the default model's
#: layers and head on a 2-core AVX-512 host, 8 no faster than 4)
GEMV_ROWS = 4
#: weight rows are split into this many chunks (or fewer) that prange deals out to the threads
CHUNKS = 64


@nb.njit(**_JIT)
def _tile_4x6(x, w, out, m, n, col):
    """``out[m : m + 4, col : col + 6] = x[m : m + 4] @ w[n : n + 6].T``."""
    K = x.shape[1]
    a00 = a01 = a02 = a03 = a04 = a05 = np.float32(0.0)
    a10 = a11 = a12 = a13 = a14 = a15 = np.float32(0.0)
    a20 = a21 = a22 = a23 = a24 = a25 = np.float32(0.0)
    a30 = a31 = a32 = a33 = a34 = a35 = np.float32(0.0)
    for k in range(K):
        w0 = w[n, k]
        w1 = w[n + 1, k]
        w2 = w[n + 2, k]
        w3 = w[n + 3, k]
        w4 = w[n + 4, k]
        w5 = w[n + 5, k]
        x0 = x[m, k]
        x1 = x[m + 1, k]
        x2 = x[m + 2, k]
        x3 = x[m + 3, k]
        a00 += x0 * w0
        a01 += x0 * w1
        a02 += x0 * w2
        a03 += x0 * w3
        a04 += x0 * w4
        a05 += x0 * w5
        a10 += x1 * w0
        a11 += x1 * w1
        a12 += x1 * w2
        a13 += x1 * w3
        a14 += x1 * w4
        a15 += x1 * w5
        a20 += x2 * w0
        a21 += x2 * w1
        a22 += x2 * w2
        a23 += x2 * w3
        a24 += x2 * w4
        a25 += x2 * w5
        a30 += x3 * w0
        a31 += x3 * w1
        a32 += x3 * w2
        a33 += x3 * w3
        a34 += x3 * w4
        a35 += x3 * w5
    out[m, col] = a00
    out[m, col + 1] = a01
    out[m, col + 2] = a02
    out[m, col + 3] = a03
    out[m, col + 4] = a04
    out[m, col + 5] = a05
    out[m + 1, col] = a10
    out[m + 1, col + 1] = a11
    out[m + 1, col + 2] = a12
    out[m + 1, col + 3] = a13
    out[m + 1, col + 4] = a14
    out[m + 1, col + 5] = a15
    out[m + 2, col] = a20
    out[m + 2, col + 1] = a21
    out[m + 2, col + 2] = a22
    out[m + 2, col + 3] = a23
    out[m + 2, col + 4] = a24
    out[m + 2, col + 5] = a25
    out[m + 3, col] = a30
    out[m + 3, col + 1] = a31
    out[m + 3, col + 2] = a32
    out[m + 3, col + 3] = a33
    out[m + 3, col + 4] = a34
    out[m + 3, col + 5] = a35


@nb.njit(**_JIT)
def _tile_4x3(x, w, out, m, n, col):
    """``out[m : m + 4, col : col + 3] = x[m : m + 4] @ w[n : n + 3].T``."""
    K = x.shape[1]
    a00 = a01 = a02 = a10 = a11 = a12 = np.float32(0.0)
    a20 = a21 = a22 = a30 = a31 = a32 = np.float32(0.0)
    for k in range(K):
        w0 = w[n, k]
        w1 = w[n + 1, k]
        w2 = w[n + 2, k]
        x0 = x[m, k]
        x1 = x[m + 1, k]
        x2 = x[m + 2, k]
        x3 = x[m + 3, k]
        a00 += x0 * w0
        a01 += x0 * w1
        a02 += x0 * w2
        a10 += x1 * w0
        a11 += x1 * w1
        a12 += x1 * w2
        a20 += x2 * w0
        a21 += x2 * w1
        a22 += x2 * w2
        a30 += x3 * w0
        a31 += x3 * w1
        a32 += x3 * w2
    out[m, col] = a00
    out[m, col + 1] = a01
    out[m, col + 2] = a02
    out[m + 1, col] = a10
    out[m + 1, col + 1] = a11
    out[m + 1, col + 2] = a12
    out[m + 2, col] = a20
    out[m + 2, col + 1] = a21
    out[m + 2, col + 2] = a22
    out[m + 3, col] = a30
    out[m + 3, col + 1] = a31
    out[m + 3, col + 2] = a32


@nb.njit(**_JIT)
def _tile_4x1(x, w, out, m, n):
    K = x.shape[1]
    a0 = a1 = a2 = a3 = np.float32(0.0)
    for k in range(K):
        wk = w[n, k]
        a0 += x[m, k] * wk
        a1 += x[m + 1, k] * wk
        a2 += x[m + 2, k] * wk
        a3 += x[m + 3, k] * wk
    out[m, n] = a0
    out[m + 1, n] = a1
    out[m + 2, n] = a2
    out[m + 3, n] = a3


@nb.njit(inline="always")
def rows_tiles(x, w, out, col0):
    """``out[:, col0 : col0 + n] = x [Mp, K] @ w [n, K].T`` (Mp a multiple of TILE_M, n of 6) in this host's
    register tiles (``GEMM_TILE_N``): the quantized row products' step after dequantizing rows into ``w``."""
    for m in range(0, x.shape[0], TILE_M):
        for t in range(w.shape[0] // GEMM_TILE_N):
            if GEMM_TILE_N == 6:
                _tile_4x6(x, w, out, m, t * 6, col0 + t * 6)
            else:
                _tile_4x3(x, w, out, m, t * 3, col0 + t * 3)


@nb.njit(parallel=True, **_JIT)
def _gemm_nt(x, w, out):
    """out [Mp, N] = x [Mp, K] @ w [N, K].T, Mp a multiple of TILE_M; all C-contiguous float32."""
    Mp = x.shape[0]
    N = w.shape[0]
    tiles = N // GEMM_TILE_N
    nchunks = max(1, min(tiles, CHUNKS))
    for c in nb.prange(nchunks):
        for t in range(c * tiles // nchunks, (c + 1) * tiles // nchunks):
            for m in range(0, Mp, TILE_M):
                if GEMM_TILE_N == 6:
                    _tile_4x6(x, w, out, m, t * 6, t * 6)
                else:
                    _tile_4x3(x, w, out, m, t * 3, t * 3)
        if c == nchunks - 1:
            for n in range(tiles * GEMM_TILE_N, N):
                for m in range(0, Mp, TILE_M):
                    _tile_4x1(x, w, out, m, n)


@nb.njit(**_JIT)
def gemv_rows(x, w, out, n0, n1):
    """``out[n0:n1] = w[n0:n1] @ x`` for ``x [K]``: dot products of ``GEMV_ROWS`` weight rows at a time,
    vectorized along K (each x vector loaded once for the four rows; four accumulator chains in flight),
    the last rows one by one."""
    K = x.shape[0]
    n = n0
    while n + GEMV_ROWS <= n1:
        a0 = a1 = a2 = a3 = np.float32(0.0)
        for k in range(K):
            xk = x[k]
            a0 += xk * w[n, k]
            a1 += xk * w[n + 1, k]
            a2 += xk * w[n + 2, k]
            a3 += xk * w[n + 3, k]
        out[n] = a0
        out[n + 1] = a1
        out[n + 2] = a2
        out[n + 3] = a3
        n += GEMV_ROWS
    for m in range(n, n1):
        acc = np.float32(0.0)
        for k in range(K):
            acc += x[k] * w[m, k]
        out[m] = acc


@nb.njit(parallel=True, **_JIT)
def _gemv_nt(x, w, out):
    """out [N] = w [N, K] @ x [K] (``gemv_rows``), whole groups of ``GEMV_ROWS`` rows split across threads."""
    N = w.shape[0]
    quads = N // GEMV_ROWS
    nchunks = max(1, min(quads, GEMV_CHUNKS))
    for c in nb.prange(nchunks):
        n1 = N if c == nchunks - 1 else (c + 1) * quads // nchunks * GEMV_ROWS
        gemv_rows(x, w, out, c * quads // nchunks * GEMV_ROWS, n1)


def gemm_nt(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """float32 ``x [M, K] @ w.T`` -> ``[M, N]`` for ``w [N, K]`` (C-contiguous float32), computed in
    4 x 6 register tiles, or dot products for M = 1 (module docstring). Meant for small M (decode
    batches); any M is correct.

    Raises ValueError when ``x`` is not 2-D or its K differs from ``w``'s, or ``w`` is not a
    C-contiguous float32 matrix."""
    if x.ndim != 2 or w.ndim != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"gemm_nt: x {x.shape} and w {w.shape} do not share K")
    if w.dtype != np.float32 or not w.flags.c_contiguous:
        raise ValueError("gemm_nt: w must be a C-contiguous float32 [N, K] array")
    M, K = x.shape
    xp = np.ascontiguousarray(x, dtype=np.float32) if M == 1 else pad_rows(x)
    out = np.empty((xp.shape[0], w.shape[0]), np.float32)
    gemm_nt_into(xp, w, out)
    return out[:M] if xp.shape[0] != M else out


@nb.njit(**_JIT)
def gemm_nt_into(x, w, out):
    """``out [Mp, N] = x [Mp, K] @ w.T`` for one row (the GEMV) or Mp a multiple of TILE_M (the tiles), all
    C-contiguous float32: what ``gemm_nt`` runs, callable from compiled code (``fused_decode``)."""
    if x.shape[0] == 1:
        _gemv_nt(x[0], w, out[0])
    else:
        _gemm_nt(x, w, out)


def pad_rows(x: np.ndarray) -> np.ndarray:
    """``x [M, K]`` as C-contiguous float32 with its rows zero-padded to a multiple of TILE_M (``x``
    itself when it already is one)."""
    M, K = x.shape
    Mp = -(-M // TILE_M) * TILE_M
    if Mp == M and x.dtype == np.float32 and x.flags.c_contiguous:
        return x
    xp = np.zeros((Mp, K), np.float32)
    xp[:M] = x
    return xp
