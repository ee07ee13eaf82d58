"""The CPU's paged attention in Numba (vLLM's ``csrc/attention/`` names):

* ``paged_attention``: decode attention, one query token per sequence, K/V read through the block table
  (a long context split into partitions where the batch leaves threads idle: ``paged_attention_v2``).
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

from rawpaged.kernels.backend import sliding_window_arg, soft_cap_arg
from rawpaged.kernels.cpu.attention_span import attend, kv_heads_per_task, span_start
from rawpaged.kernels.cpu.cache import cache_view
from rawpaged.kernels.cpu.gemm import SMALL_M, gemm_nt
from rawpaged.kernels.cpu.jit import jit_serial_and_parallel
from rawpaged.kernels.cpu.paged_attention_v2 import (
    decode_partition,
    paged_attention_v2_parallel,
    paged_attention_v2_serial,
)
from rawpaged.kernels.cpu.prefill_tiled import TILED_PREFILL_MIN_TOKENS, blas_nt, prefill_tiled


def _paged_attention_kernel(out, query, kc, vc, ks, vs, block_tables, context_lens, scale, nkv, window, soft_cap):
    """One task per (sequence, ``nkv`` KV heads), each over its whole context."""
    num_seqs = query.shape[0]
    num_heads = query.shape[1]
    num_kv_heads = kc.shape[2]
    group = num_heads // num_kv_heads
    chunks = num_kv_heads // nkv
    rows = nkv * group
    for task in nb.prange(num_seqs * chunks):
        s = task // chunks
        kv0 = (task % chunks) * nkv
        h0 = kv0 * group
        ctx = np.int64(context_lens[s])
        attend(
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
            span_start(ctx, window),
            ctx,
            scale,
            soft_cap,
        )


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
    window = sliding_window_arg(sliding_window)
    cap = soft_cap_arg(logits_soft_cap)
    args = (out, query, kc, vc, ks, vs, block_tables, context_lens, np.float32(scale), nkv, window, cap)
    if partition > 0:
        kernel = paged_attention_v2_parallel if work >= PARALLEL_MIN_WORK else paged_attention_v2_serial
        kernel(*args, partition)
    else:
        kernel = paged_attention_parallel if work >= PARALLEL_MIN_WORK else paged_attention_serial
        kernel(*args)


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
        attend(
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
