"""The CPU's paged attention in Numba (vLLM's ``csrc/attention/`` names):

* ``paged_attention``: decode attention, one query token per sequence, K/V read through the block table.
* ``prefill_attention``: causal attention of a sequence's new tokens over all its cached K/V (plain
  prefill, prefill after a cached prefix, chunked prefill); sequences with many new tokens go to the
  BLAS-tiled path of ``prefill_tiled``.

Caches ``[num_blocks, block_size, num_kv_heads, head_dim]``, float32 or bfloat16 (read as uint16 bits and
widened exactly). Queries/outputs float32. Math in float32 with an online (streaming) softmax (Milakov &
Gimelshein 2018; FlashAttention, Dao et al. 2022), one pass over each K/V block per GQA group: query head
``h`` reads KV head ``h // (num_heads // num_kv_heads)``. All index arithmetic is 64-bit.

Numba indexes with wraparound (a negative index counts from the end), so a loop whose index LLVM cannot
prove non-negative reads element by element; the loops here run from 0 over slices, which keeps them in
vectors.
"""

from __future__ import annotations

import numba as nb
import numpy as np
from numba import types as nb_types
from numba.extending import overload

from rawpaged.kernels.backend import sliding_window_arg, soft_cap_arg
from rawpaged.kernels.cpu.cache import cache_view
from rawpaged.kernels.cpu.gemm import SMALL_M, gemm_nt
from rawpaged.kernels.cpu.intrinsics import exp_f32, fp8_e4m3_to_float
from rawpaged.kernels.cpu.jit import JIT, jit_serial_and_parallel
from rawpaged.kernels.cpu.prefill_tiled import TILED_PREFILL_MIN_TOKENS, blas_nt, prefill_tiled


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
def _attend_span(qs, kc, vc, ks, vs, block_row, kv0, nkv, group, start, limit, soft_cap, acc, m, denom):
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
def _scaled_queries(q, scale):
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
def _attend(q, out, kc, vc, ks, vs, block_row, kv0, nkv, group, start, causal_limit, scale, soft_cap):
    """Attention of the query heads of KV heads ``kv0 .. kv0+nkv-1`` (``nkv * group`` rows, GQA) over
    positions ``start .. causal_limit-1`` of one sequence (``start`` > 0: a sliding window; the blocks
    before it are not read). q, out: ``[nkv * group, head_dim]``; the caches as ``_attend_span`` takes
    them."""
    qs, acc, m, denom = _scaled_queries(q, scale)
    _attend_span(qs, kc, vc, ks, vs, block_row, kv0, nkv, group, start, causal_limit, soft_cap, acc, m, denom)
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


#: positions per partition of a decode context split across tasks (vLLM's paged attention v2, whose
#: CUDA partitions hold 512): small enough that a 512-position sliding window still gives 2 threads work
PARTITION_SIZE = 128


def decode_partition(num_seqs: int, num_kv_heads: int) -> int:
    """The decode kernels' ``partition`` for a batch: ``PARTITION_SIZE`` when its (sequence, KV heads)
    tasks (``kv_heads_per_task``) leave threads idle, as Gemma 3's one KV head at batch 1 does, else 0
    (each task attends its whole context)."""
    tasks = num_seqs * (num_kv_heads // kv_heads_per_task(num_seqs, num_kv_heads))
    return PARTITION_SIZE if tasks < 2 * nb.get_num_threads() else 0


@nb.njit(**JIT)
def _span_start(ctx, window):
    return max(0, ctx - window) if window > 0 else 0


def _paged_attention_kernel(
    out, query, kc, vc, ks, vs, block_tables, context_lens, scale, nkv, window, soft_cap, partition
):
    num_seqs = query.shape[0]
    num_heads = query.shape[1]
    head_dim = query.shape[2]
    num_kv_heads = kc.shape[2]
    group = num_heads // num_kv_heads
    chunks = num_kv_heads // nkv
    rows = nkv * group
    if partition <= 0:
        for task in nb.prange(num_seqs * chunks):
            s = task // chunks
            kv0 = (task % chunks) * nkv
            h0 = kv0 * group
            ctx = np.int64(context_lens[s])
            _attend(
                query[s, h0 : h0 + rows],
                out[s, h0 : h0 + rows],
                kc,
                vc,
                ks,
                vs,
                block_tables[s],
                kv0,
                nkv,
                group,
                _span_start(ctx, window),
                ctx,
                scale,
                soft_cap,
            )
        return
    # Split (vLLM's paged attention v2): partition p of a sequence holds its attended positions in the
    # p-th run of ``partition`` absolute positions from its first one's; each task folds one partition
    # into its own softmax state, then one pass per (sequence, head) merges the partitions' states.
    parts = 1
    for s in range(num_seqs):
        ctx = np.int64(context_lens[s])
        if ctx > 0:
            parts = max(parts, (ctx - 1) // partition - _span_start(ctx, window) // partition + 1)
    part_acc = np.empty((num_seqs, num_heads, parts, head_dim), dtype=np.float32)
    part_m = np.empty((num_seqs, num_heads, parts), dtype=np.float32)
    part_denom = np.empty((num_seqs, num_heads, parts), dtype=np.float32)
    for task in nb.prange(num_seqs * chunks * parts):
        p = task % parts
        s = task // parts // chunks
        kv0 = (task // parts % chunks) * nkv
        h0 = kv0 * group
        ctx = np.int64(context_lens[s])
        start = _span_start(ctx, window)
        first = (start // partition + p) * partition
        lo, hi = max(start, first), min(ctx, first + partition)
        qs, acc, m, denom = _scaled_queries(query[s, h0 : h0 + rows], scale)
        if lo < hi:
            _attend_span(qs, kc, vc, ks, vs, block_tables[s], kv0, nkv, group, lo, hi, soft_cap, acc, m, denom)
        for r in range(rows):
            part_m[s, h0 + r, p] = m[r]
            part_denom[s, h0 + r, p] = denom[r]
            dst = part_acc[s, h0 + r, p]
            ar = acc[r]
            for d in range(head_dim):
                dst[d] = ar[d]
    for task in nb.prange(num_seqs * num_heads):
        s = task // num_heads
        h = task % num_heads
        ms = part_m[s, h]
        top = np.float32(-1e30)
        for p in range(parts):
            top = max(top, ms[p])
        total = np.float32(0.0)
        o = np.zeros(head_dim, dtype=np.float32)
        for p in range(parts):
            c = exp_f32(ms[p] - top)  # 1 for the top partition; an empty one (m = -1e30) adds 0
            total += part_denom[s, h, p] * c
            pa = part_acc[s, h, p]
            for d in range(head_dim):
                o[d] += pa[d] * c
        inv = np.float32(1.0) / total if total > 0 else np.float32(0.0)
        orow = out[s, h]
        for d in range(head_dim):
            orow[d] = o[d] * inv


def _check_attention_args(out, query, key_cache, value_cache, block_tables):
    """``key_cache``/``value_cache``: the values of ``cache.cache_view``."""
    if out.shape != query.shape or out.dtype != np.float32 or query.dtype != np.float32:
        raise ValueError(f"out {out.shape}/{out.dtype} must match query {query.shape}/{query.dtype}, float32")
    if key_cache.shape != value_cache.shape or key_cache.dtype != value_cache.dtype:
        raise ValueError("key_cache and value_cache must have the same shape and dtype")
    num_heads, head_dim = query.shape[-2:]
    num_kv_heads = key_cache.shape[2]
    if head_dim != key_cache.shape[3] or num_heads % num_kv_heads:
        raise ValueError(f"query heads/head_dim {query.shape[-2:]} incompatible with cache {key_cache.shape}")
    if block_tables.dtype != np.int32 or block_tables.ndim != 2:
        raise ValueError("block_tables must be int32 [num_seqs, max_blocks_per_seq]")


def paged_attention(
    out,
    query,
    key_cache,
    value_cache,
    block_tables,
    context_lens,
    scale,
    max_context_len=None,
    sliding_window=None,
    logits_soft_cap=None,
):
    """Decode attention: one query token per sequence over its paged K/V.

    Args:
        out: float32 ``[num_seqs, num_heads, head_dim]``, written.
        query: float32 ``[num_seqs, num_heads, head_dim]``.
        key_cache, value_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]`` float32 or bf16, or
            ``QuantizedKVCache``s (dequantized as each block is read).
        block_tables: int32 ``[num_seqs, max_blocks_per_seq]``.
        context_lens: int32 ``[num_seqs]``, tokens of K/V to attend (including the current one).
        scale: softmax scale, usually ``head_dim ** -0.5``.
        max_context_len: an upper bound on ``context_lens`` (as the CUDA backend takes it); with the
            batch's size it picks the serial or the thread-parallel kernel.
        sliding_window: W or None; with W the query sees only the last W positions (itself and the
            W - 1 before it, as HF's Mistral), and blocks wholly before them are not read.
        logits_soft_cap: c > 0 or None/0 (off); with c each score ``s = scale * q.k`` becomes ``c *
            tanh(s / c)`` before the softmax (Gemma 2's ``attn_logit_softcapping``, vLLM's name).
    Math: ``out[s, h] = softmax(scale * q K^T) V`` over positions ``0 .. context_lens[s]-1``
    (Vaswani et al. 2017, eq. 1), GQA: head h uses KV head ``h // (num_heads // num_kv_heads)``.
    """
    kc, ks = cache_view(key_cache)
    vc, vs = cache_view(value_cache)
    _check_attention_args(out, query, kc, vc, block_tables)
    nkv = kv_heads_per_task(query.shape[0], kc.shape[2])
    partition = decode_partition(query.shape[0], kc.shape[2])
    work = (
        query.shape[0]
        * query.shape[1]
        * (int(max_context_len) if max_context_len else block_tables.shape[1] * key_cache.shape[1])
    )
    kernel = paged_attention_parallel if work >= PARALLEL_MIN_WORK else paged_attention_serial
    window = sliding_window_arg(sliding_window)
    cap = soft_cap_arg(logits_soft_cap)
    kernel(out, query, kc, vc, ks, vs, block_tables, context_lens, np.float32(scale), nkv, window, cap, partition)


def _prefill_attention_kernel(
    out,
    query,
    kc,
    vc,
    ks,
    vs,
    block_tables,
    query_start_loc,
    seq_lens,
    scale,
    token_rows,
    token_seq,
    nkv,
    window,
    soft_cap,
):
    """Causal attention for the query rows ``token_rows`` (sequence ``token_seq`` of each)."""
    num_heads = query.shape[1]
    num_kv_heads = kc.shape[2]
    group = num_heads // num_kv_heads
    chunks = num_kv_heads // nkv
    for task in nb.prange(token_rows.shape[0] * chunks):
        t = token_rows[task // chunks]
        s = token_seq[task // chunks]
        kv0 = (task % chunks) * nkv
        q_start = np.int64(query_start_loc[s])
        n_new = np.int64(query_start_loc[s + 1]) - q_start
        seq_len = np.int64(seq_lens[s])
        pos = seq_len - n_new + (t - q_start)  # absolute position of this query token
        h0 = kv0 * group
        _attend(
            query[t, h0 : h0 + nkv * group],
            out[t, h0 : h0 + nkv * group],
            kc,
            vc,
            ks,
            vs,
            block_tables[s],
            kv0,
            nkv,
            group,
            max(0, pos + 1 - window) if window > 0 else 0,
            pos + 1,
            scale,
            soft_cap,
        )


paged_attention_serial, paged_attention_parallel = jit_serial_and_parallel(_paged_attention_kernel)
prefill_attention_serial, prefill_attention_parallel = jit_serial_and_parallel(_prefill_attention_kernel)
# Below this many (query row x cached position) pairs a kernel runs on the calling thread: in the
# engine, waking Numba's pool right after an OpenBLAS call (whose threads still spin) cost ~0.8 ms per
# call on a quiet 2-core machine, more than serial attention below ~1.6 ms of work.
PARALLEL_MIN_WORK = 1 << 17


def prefill_attention(
    out,
    query,
    key_cache,
    value_cache,
    block_tables,
    query_start_loc,
    seq_lens,
    scale,
    max_query_len=None,
    sliding_window=None,
    logits_soft_cap=None,
):
    """Causal attention of each sequence's new tokens over all of its cached K/V.

    Args:
        out: float32 ``[num_tokens, num_heads, head_dim]``, written.
        query: float32 ``[num_tokens, num_heads, head_dim]``; sequence s owns rows
            ``query_start_loc[s] : query_start_loc[s+1]``.
        key_cache, value_cache: paged caches holding the K/V of every position (old and new).
        block_tables: int32 ``[num_seqs, max_blocks_per_seq]``.
        query_start_loc: int32 ``[num_seqs + 1]``, cumulative new-token counts starting at 0.
        seq_lens: int32 ``[num_seqs]``, total length of each sequence; the new tokens are its last
            ``query_start_loc[s+1] - query_start_loc[s]`` positions.
        scale: softmax scale.
        max_query_len: accepted for interface parity with the CUDA backend (launch sizing); unused.
        sliding_window: W or None (see ``paged_attention``).
        logits_soft_cap: c > 0 or None/0 (see ``paged_attention``).
    New token at absolute position p attends positions ``0 .. p`` (causal mask), or ``p - W + 1 .. p``
    with a window.
    """
    kc, ks = cache_view(key_cache)
    vc, vs = cache_view(value_cache)
    _check_attention_args(out, query, kc, vc, block_tables)
    window = sliding_window_arg(sliding_window)
    cap = soft_cap_arg(logits_soft_cap)
    qsl = np.asarray(query_start_loc, dtype=np.int64)
    counts = np.diff(qsl)
    if qsl[0] != 0 or qsl[-1] != query.shape[0] or (counts < 0).any():
        raise ValueError("query_start_loc must start at 0, be non-decreasing and end at num_tokens")
    if (np.asarray(seq_lens) < counts).any():
        raise ValueError("seq_lens must be >= the number of new tokens of each sequence")
    tiled = counts >= TILED_PREFILL_MIN_TOKENS
    # A step whose linears run in Numba (few tokens) keeps its tile products in Numba too: an OpenBLAS
    # call leaves its threads spinning, and the next Numba parallel region fights them (a 64-token
    # prefill took 3.5x as long with BLAS here).
    matmul_nt = gemm_nt if query.shape[0] <= SMALL_M else blas_nt
    for s in np.flatnonzero(tiled):
        prefill_tiled(
            out,
            query,
            key_cache,
            value_cache,
            block_tables[s],
            int(qsl[s]),
            int(qsl[s + 1]),
            int(seq_lens[s]),
            np.float32(scale),
            window,
            matmul_nt,
            cap,
        )
    if tiled.all():
        return
    # The rest: the Numba kernel, one task per (token, KV heads).
    token_seq = np.repeat(np.arange(len(counts), dtype=np.int64), counts)
    keep = ~tiled[token_seq]
    token_rows = np.flatnonzero(keep).astype(np.int64)
    token_seq = token_seq[keep]
    nkv = kv_heads_per_task(len(token_rows), kc.shape[2])
    work = len(token_rows) * query.shape[1] * int(np.max(seq_lens, initial=0))
    kernel = prefill_attention_parallel if work >= PARALLEL_MIN_WORK else prefill_attention_serial
    kernel(
        out,
        query,
        kc,
        vc,
        ks,
        vs,
        block_tables,
        qsl,
        seq_lens,
        np.float32(scale),
        token_rows,
        token_seq,
        nkv,
        window,
        cap,
    )
