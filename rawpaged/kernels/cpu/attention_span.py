"""The pieces the CPU's attention kernels are built from (``attention`` and ``paged_attention_v2``): a
span of one sequence's paged K/V folded into a running (online) softmax state (Milakov & Gimelshein
2018; FlashAttention, Dao et al. 2022), read block by block whatever the cache's dtype, and how a decode
batch's work is cut into tasks. Conventions as in ``attention``'s docstring.
"""

from __future__ import annotations

import numba as nb
import numpy as np
from numba import types as nb_types
from numba.extending import overload

from rawpaged.kernels.cpu.intrinsics import exp_f32, fp8_e4m3_to_float
from rawpaged.kernels.cpu.jit import JIT


def _block_rows(cache, scales, b, t0, n, kv0, nkv, buf):
    """Rows ``t0 .. n-1`` of block ``b`` as float32 ``[n - t0, num_kv_heads, head_dim]``, KV heads
    ``kv0 .. kv0+nkv-1`` valid. bf16 bits are widened (exactly) into ``buf`` (uint32 ``[block_size,
    num_kv_heads, head_dim]``) and a float32 view of it returned; int8 values and fp8 E4M3 bits are
    dequantized into it the same way, times their row's scale (``scales[b, t, h]``; unread for floats).
    A float32 block of several KV heads is copied into ``buf`` when all its heads are read (one linear
    read of the block, which the hardware prefetcher streams: in the engine, where the blocks come from
    DRAM, 10% faster at 32 sequences than reading each head's rows in place); with fewer heads, or one
    KV head (its rows are one linear run already), the rows are read in place (a view)."""


@overload(_block_rows, jit_options=JIT)
def _block_rows_impl(cache, scales, b, t0, n, kv0, nkv, buf):
    if cache.dtype == nb_types.float32:

        def float32_rows(cache, scales, b, t0, n, kv0, nkv, buf):
            src = cache[b, t0:n]
            if nkv < cache.shape[2] or cache.shape[2] == 1:
                return src
            dst = buf.view(np.float32)[: n - t0]
            for t in range(n - t0):
                srow = src[t]
                drow = dst[t]
                for h in range(srow.shape[0]):
                    for d in range(srow.shape[1]):
                        drow[h, d] = srow[h, d]
            return dst

        return float32_rows

    if cache.dtype == nb_types.int8:

        def int8_rows(cache, scales, b, t0, n, kv0, nkv, buf):
            src = cache[b, t0:n]
            dst = buf.view(np.float32)[: n - t0]
            for t in range(n - t0):
                for h in range(kv0, kv0 + nkv):
                    srow = src[t, h]
                    drow = dst[t, h]
                    sc = scales[b, t0 + t, h]
                    for d in range(srow.shape[0]):
                        drow[d] = np.float32(srow[d]) * sc
            return dst

        return int8_rows

    if cache.dtype == nb_types.uint8:

        def fp8_rows(cache, scales, b, t0, n, kv0, nkv, buf):
            src = cache[b, t0:n]
            dst = buf.view(np.float32)[: n - t0]
            for t in range(n - t0):
                for h in range(kv0, kv0 + nkv):
                    srow = src[t, h]
                    drow = dst[t, h]
                    sc = scales[b, t0 + t, h]
                    for d in range(srow.shape[0]):
                        drow[d] = fp8_e4m3_to_float(srow[d]) * sc
            return dst

        return fp8_rows

    def bf16_rows(cache, scales, b, t0, n, kv0, nkv, buf):
        src = cache[b, t0:n]
        dst = buf[: n - t0]
        for t in range(n - t0):
            for h in range(kv0, kv0 + nkv):
                srow = src[t, h]
                drow = dst[t, h]
                for d in range(srow.shape[0]):
                    drow[d] = np.uint32(srow[d]) << np.uint32(16)
        return dst.view(np.float32)

    return bf16_rows


@nb.njit(**JIT)
def attend_span(qs, kc, vc, ks, vs, block_row, kv0, nkv, group, start, limit, soft_cap, acc, m, denom):
    """Positions ``start .. limit-1`` of one sequence folded into the running softmax state of the query
    rows of KV heads ``kv0 .. kv0+nkv-1`` (``nkv * group`` rows, GQA): qs ``[rows, head_dim]``, the
    queries times the softmax scale; acc ``[rows, head_dim]`` (the unnormalized output), m ``[rows]``
    (the running maxima, -1e30 before any position) and denom ``[rows]`` (the running sums), updated in
    place. kc, vc: float32 caches, bf16 bits, int8 values or fp8 bits, with their scales ks, vs
    (``cache.cache_view``); blocks wholly outside the span are not read. ``soft_cap`` c > 0: each scaled
    score s becomes ``c * tanh(s / c)`` (Gemma 2) before the softmax.

    Block by block, per KV head: each K row is read once for the ``group`` query rows that share it,
    scores for the block, one rescale of the running (max, sum, acc) per block and row (online
    softmax, Milakov & Gimelshein 2018), then each V row accumulated into the ``group`` rows.
    (Prefetching the next block in software measured no faster in the engine.)
    """
    block_size = kc.shape[1]
    head_dim = kc.shape[3]
    rows = nkv * group
    kbits = np.empty((block_size, kc.shape[2], head_dim), dtype=np.uint32)
    vbits = np.empty((block_size, kc.shape[2], head_dim), dtype=np.uint32)
    s = np.empty((rows, block_size), dtype=np.float32)
    num_blocks = (limit + block_size - 1) // block_size
    for j in range(start // block_size, num_blocks):
        b = np.int64(block_row[j])
        n = min(block_size, limit - j * block_size)
        t0 = max(0, start - j * block_size)  # rows of the block before the span's first position
        nt = n - t0
        kb = _block_rows(kc, ks, b, t0, n, kv0, nkv, kbits)
        vb = _block_rows(vc, vs, b, t0, n, kv0, nkv, vbits)
        for hh in range(nkv):
            h = kv0 + hh
            r0 = hh * group
            for i in range(nt):
                krow = kb[i, h]
                for g in range(group):
                    qsr = qs[r0 + g]
                    dot = np.float32(0.0)
                    for d in range(head_dim):
                        dot += qsr[d] * krow[d]
                    s[r0 + g, i] = dot
            for r in range(r0, r0 + group):
                sr = s[r, :nt]
                if soft_cap > 0:
                    for i in range(nt):
                        sr[i] = soft_cap * np.tanh(sr[i] / soft_cap)
                bm = np.float32(-1e30)
                for i in range(nt):
                    bm = max(bm, sr[i])
                new_m = max(m[r], bm)
                corr = exp_f32(m[r] - new_m)
                m[r] = new_m
                total = np.float32(0.0)
                for i in range(nt):
                    p = exp_f32(sr[i] - new_m)
                    sr[i] = p
                    total += p
                denom[r] = denom[r] * corr + total
                ar = acc[r]
                for d in range(head_dim):
                    ar[d] *= corr
            for i in range(nt):
                vrow = vb[i, h]
                for g in range(group):
                    p = s[r0 + g, i]
                    ar = acc[r0 + g]
                    for d in range(head_dim):
                        ar[d] += p * vrow[d]


@nb.njit(**JIT)
def scaled_queries(q, scale):
    """float32 ``q * scale`` (``[rows, head_dim]``), and the empty softmax state of its rows: acc (zeros),
    m (-1e30: finite, as fastmath assumes no infs) and denom (zeros)."""
    rows, head_dim = q.shape
    qs = np.empty((rows, head_dim), dtype=np.float32)
    for r in range(rows):
        qr = q[r]
        qsr = qs[r]
        for d in range(head_dim):
            qsr[d] = qr[d] * scale
    acc = np.zeros((rows, head_dim), dtype=np.float32)
    m = np.full(rows, np.float32(-1e30), dtype=np.float32)
    denom = np.zeros(rows, dtype=np.float32)
    return qs, acc, m, denom


@nb.njit(**JIT)
def attend(q, out, kc, vc, ks, vs, block_row, kv0, nkv, group, start, causal_limit, scale, soft_cap):
    """Attention of the query heads of KV heads ``kv0 .. kv0+nkv-1`` (``nkv * group`` rows, GQA) over
    positions ``start .. causal_limit-1`` of one sequence (``start`` > 0: a sliding window; the blocks
    before it are not read). q, out: ``[nkv * group, head_dim]``; the caches as ``attend_span`` takes
    them."""
    qs, acc, m, denom = scaled_queries(q, scale)
    attend_span(qs, kc, vc, ks, vs, block_row, kv0, nkv, group, start, causal_limit, soft_cap, acc, m, denom)
    for r in range(acc.shape[0]):
        inv = np.float32(1.0) / denom[r] if denom[r] > 0 else np.float32(0.0)
        ar = acc[r]
        orow = out[r]
        for d in range(ar.shape[0]):
            orow[d] = ar[d] * inv


def kv_heads_per_task(num_items: int, num_kv_heads: int) -> int:
    """All KV heads in one task (contiguous block reads) when there are enough items to keep every
    thread busy; one KV head per task otherwise (a batch of one still uses all threads)."""
    return num_kv_heads if num_items >= 2 * nb.get_num_threads() else 1


@nb.njit(**JIT)
def span_start(ctx, window):
    """The first position a context of ``ctx`` positions attends with sliding window ``window`` (0: none)."""
    return max(0, ctx - window) if window > 0 else 0
