"""Prefill attention for a sequence with many new tokens, in NumPy and BLAS: K/V gathered from the paged
cache tile by tile, scores by matrix products, an online softmax across tiles (FlashAttention, Dao et al.
2022, Alg. 1). ``attention.prefill_attention`` sends sequences of at least ``TILED_PREFILL_MIN_TOKENS`` new
tokens here."""

from __future__ import annotations

import numpy as np

from rawpaged.dtypes import FP8_E4M3_VALUES
from rawpaged.kernels.kv_cache import QuantizedKVCache

# Sequences with at least this many new tokens use the BLAS-tiled path.
TILED_PREFILL_MIN_TOKENS = 32
PREFILL_KV_TILE = 256  # key positions per tile (a multiple of every supported block_size)


def blas_nt(a, b):
    return a @ b.T


def tile_rows(cache, blocks, kvh: int, n: int):
    """KV head ``kvh``'s rows of ``blocks`` (in order), the first ``n`` of them, as float32 ``[n,
    head_dim]``: a float cache's rows, or a ``QuantizedKVCache``'s dequantized with their scales."""
    if not isinstance(cache, QuantizedKVCache):
        return cache[blocks, :, kvh].reshape(-1, cache.shape[3])[:n].astype(np.float32, copy=False)
    q = cache.data[blocks, :, kvh].reshape(-1, cache.shape[3])[:n]
    values = q.astype(np.float32) if q.dtype == np.int8 else FP8_E4M3_VALUES[q]
    return values * cache.scales[blocks, :, kvh].reshape(-1)[:n, None]


def prefill_tiled(
    out,
    query,
    key_cache,
    value_cache,
    block_row,
    q_start,
    q_end,
    seq_len,
    scale,
    window=0,
    matmul_nt=blas_nt,
    soft_cap=0.0,
):
    """FlashAttention-style prefill of one sequence in NumPy/BLAS (Dao et al. 2022, Alg. 1): K/V are
    gathered from the paged cache one tile of ``PREFILL_KV_TILE`` positions at a time (like a GPU
    kernel staging tiles in shared memory), scores for all new tokens x tile via SGEMM, online softmax
    across tiles, causal mask only where a tile reaches the new tokens. With a sliding ``window``, each
    tile is computed only for the rows whose window it meets (every such row sees at least one of its
    keys, so no row's running max stays at -inf), and masked where it starts inside a row's window.
    ``soft_cap`` c > 0: scores become ``c * tanh(s / c)`` before the mask and the softmax."""
    n = q_end - q_start
    num_heads, head_dim = query.shape[1:]
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    group = num_heads // num_kv_heads
    first = seq_len - n  # absolute position of the first new token
    qpos = first + np.repeat(np.arange(n), group)  # position of each (token, head-in-group) row, ascending
    tiles = []  # (k0, k1, rows r0:r1 that see the tile, bias or None), shared by the KV heads
    k_first = max(0, first + 1 - window) if window else 0  # the first new token's first visible key
    for k0 in range(k_first - k_first % block_size, seq_len, PREFILL_KV_TILE):  # no block before it read
        k1 = min(k0 + PREFILL_KV_TILE, seq_len)
        r0 = int(np.searchsorted(qpos, k0))  # rows before r0 see none of this tile's keys (causal)
        # rows from r1 on have their window start after the tile (position - window + 1 > k1 - 1)
        r1 = int(np.searchsorted(qpos, k1 + window - 1)) if window else len(qpos)
        if r0 >= r1:
            continue
        bias = None
        kpos = np.arange(k0, k1)[None, :]
        rows = qpos[r0:r1, None]
        hidden = kpos > rows if k1 - 1 > first else None  # the tile reaches new tokens: causal mask
        if window and k0 < qpos[r1 - 1] - window + 1:  # some row's window starts inside the tile
            outside = kpos < rows - window + 1
            hidden = outside if hidden is None else hidden | outside
        if hidden is not None:
            bias = np.where(hidden, np.float32(-np.inf), np.float32(0.0))
        tiles.append((k0, k1, r0, r1, bias))
    for kvh in range(num_kv_heads):
        q = query[q_start:q_end, kvh * group : (kvh + 1) * group].reshape(n * group, head_dim) * scale
        m = np.full(n * group, -np.inf, np.float32)
        denom = np.zeros(n * group, np.float32)
        acc = np.zeros((n * group, head_dim), np.float32)
        for k0, k1, r0, r1, bias in tiles:
            blocks = block_row[k0 // block_size : -(-k1 // block_size)]
            k = tile_rows(key_cache, blocks, kvh, k1 - k0)
            v = tile_rows(value_cache, blocks, kvh, k1 - k0)
            rows = slice(r0, r1)
            scores = matmul_nt(q[rows], k)
            if soft_cap > 0:
                scores = np.tanh(scores / soft_cap, out=scores)
                scores *= soft_cap
            if bias is not None:
                scores += bias
            m_new = np.maximum(m[rows], scores.max(axis=1))
            scores -= m_new[:, None]
            p = np.exp(scores, out=scores)
            corr = np.exp(m[rows] - m_new)
            denom[rows] = denom[rows] * corr + p.sum(axis=1)
            acc[rows] *= corr[:, None]
            acc[rows] += matmul_nt(p, np.ascontiguousarray(v.T))
            m[rows] = m_new
        out[q_start:q_end, kvh * group : (kvh + 1) * group] = (acc / denom[:, None]).reshape(n, group, head_dim)
