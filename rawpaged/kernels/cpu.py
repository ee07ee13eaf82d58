"""CPU backend: the paged-KV kernels in Numba, the rest of the model math in NumPy.

Kernel names and semantics follow vLLM's (``csrc/cache_kernels.cu``, ``csrc/attention/``):

* ``reshape_and_cache``: scatter new K/V rows into their slots of the paged caches.
* ``paged_attention``: decode attention, one query token per sequence, K/V read through the block table.
* ``prefill_attention``: causal attention of a sequence's new tokens over all its cached K/V (plain
  prefill, prefill after a cached prefix, chunked prefill).
* ``copy_blocks``: copy-on-write block copies for every layer in one call.

Layouts: caches ``[num_blocks, block_size, num_kv_heads, head_dim]``; float32 or bfloat16
(``ml_dtypes.bfloat16``, handled as its uint16 bit pattern inside the kernels; stored with
round-to-nearest-even). Queries/outputs float32. Attention math in float32 with an online
(streaming) softmax (Milakov & Gimelshein 2018; FlashAttention, Dao et al. 2022), one pass over
each K/V block per GQA group: query head ``h`` reads KV head ``h // (num_heads // num_kv_heads)``.
All index arithmetic is 64-bit.
"""

from __future__ import annotations

import types

import numba as nb
import numpy as np
from numba import types as nb_types
from numba.extending import overload

from rawpaged.dtypes import BFLOAT16
from rawpaged.kernels import cpu_sampling
from rawpaged.kernels.backend import check_block_mapping, sliding_window_arg
from rawpaged.kernels.cpu_gemm import SMALL_M, gemm_nt
from rawpaged.kernels.cpu_intrinsics import pow2_int
from rawpaged.kernels.cpu_quant import RepackedQuantized, quant_embedding, quant_linear, repack
from rawpaged.kernels.quantization import QuantizedTensor

BF16 = BFLOAT16.numpy
DEFAULT_KV_CACHE_MEMORY = 1 << 30
_JIT = dict(cache=True, nogil=True, fastmath=True)


# --------------------------------------------------------------------------- helpers
@nb.njit(**_JIT)
def _f32_to_bf16_bits(u):
    """Round-to-nearest-even float32 bits -> bfloat16 bits (NaN stays NaN)."""
    if (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000):
        return np.uint16((u >> np.uint32(16)) | np.uint32(0x40))
    rounding = np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))
    return np.uint16((u + rounding) >> np.uint32(16))


def copy_function(fn, name):
    """A copy of a plain function under another name (so two jitted variants cache separately)."""
    new = types.FunctionType(fn.__code__.replace(co_name=name), fn.__globals__, name, fn.__defaults__, fn.__closure__)
    new.__qualname__ = name
    return new


def _cache_view(cache):
    """The array the kernels see for a cache, and whether it holds bf16 bits."""
    if cache.dtype == BF16:
        return cache.view(np.uint16), True
    if cache.dtype != np.float32:
        raise ValueError(f"KV cache dtype must be float32 or bfloat16, got {cache.dtype}")
    return cache, False


# ---------------------------------------------------------------- reshape_and_cache
@nb.njit(**_JIT)  # serial: a memory copy, too small per call for a parallel region
def _reshape_and_cache_f32(key, value, key_cache, value_cache, slot_mapping):
    block_size = key_cache.shape[1]
    for t in range(key.shape[0]):
        slot = np.int64(slot_mapping[t])
        if slot < 0:
            continue
        b = slot // block_size
        o = slot % block_size
        key_cache[b, o] = key[t]
        value_cache[b, o] = value[t]


@nb.njit(**_JIT)  # serial: a memory copy, too small per call for a parallel region
def _reshape_and_cache_bf16(key_bits, value_bits, key_cache, value_cache, slot_mapping):
    block_size = key_cache.shape[1]
    num_kv_heads = key_bits.shape[1]
    head_dim = key_bits.shape[2]
    for t in range(key_bits.shape[0]):
        slot = np.int64(slot_mapping[t])
        if slot < 0:
            continue
        b = slot // block_size
        o = slot % block_size
        for h in range(num_kv_heads):
            for d in range(head_dim):
                key_cache[b, o, h, d] = _f32_to_bf16_bits(key_bits[t, h, d])
                value_cache[b, o, h, d] = _f32_to_bf16_bits(value_bits[t, h, d])


def reshape_and_cache(key, value, key_cache, value_cache, slot_mapping):
    """Write new K/V rows into the paged caches.

    Args:
        key, value: float32 ``[num_tokens, num_kv_heads, head_dim]``.
        key_cache, value_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``, float32 or bf16;
            written in place.
        slot_mapping: int64 ``[num_tokens]``; token t goes to block ``slot // block_size``, offset
            ``slot % block_size``; ``-1`` skips the token (padding).
    Raises:
        ValueError: on mismatched shapes or dtypes.
    """
    kc, is_bf16 = _cache_view(key_cache)
    vc, _ = _cache_view(value_cache)
    if key.shape != value.shape or key.shape[1:] != key_cache.shape[2:]:
        raise ValueError(f"key {key.shape} / value {value.shape} do not match cache {key_cache.shape}")
    if slot_mapping.shape[0] != key.shape[0]:
        raise ValueError(f"slot_mapping has {slot_mapping.shape[0]} entries for {key.shape[0]} tokens")
    key = np.ascontiguousarray(key, dtype=np.float32)
    value = np.ascontiguousarray(value, dtype=np.float32)
    if is_bf16:
        _reshape_and_cache_bf16(key.view(np.uint32), value.view(np.uint32), kc, vc, slot_mapping)
    else:
        _reshape_and_cache_f32(key, value, kc, vc, slot_mapping)


def rotary_embedding_and_cache(positions, query, key, value, key_cache, value_cache, slot_mapping, cos_sin_cache):
    """``rotary_embedding`` of query and key (both in place), then ``reshape_and_cache`` of the rotated
    key and the value: the CUDA backend's fused kernel, composed. Arguments as those two take them."""
    rotary_embedding(positions, query, key, cos_sin_cache)
    reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)


# ---------------------------------------------------------------- attention core
# Numba indexes with wraparound (a negative index counts from the end), so a loop whose index LLVM
# cannot prove non-negative reads element by element; the loops below run from 0 over slices, which
# keeps them in vectors.


@nb.njit(inline="always", **_JIT)
def _exp_f32(x):
    """float32 ``exp(x)`` for x in [-87, 88] (clamped to it), ~1 ulp: Cephes ``expf`` (S. Moshier):
    ``x = n ln 2 + r`` with ``|r| <= ln 2 / 2`` (ln 2 in two parts, Cody-Waite), a degree-7 polynomial
    for ``exp(r)``, times ``2^n`` from its exponent bits. Unlike ``math.exp`` it vectorizes."""
    x = min(max(x, np.float32(-87.0)), np.float32(88.0))
    n = np.floor(x * np.float32(1.44269504088896341) + np.float32(0.5))
    r = x - n * np.float32(0.693359375) + n * np.float32(2.12194440e-4)
    p = np.float32(1.9875691500e-4)
    p = p * r + np.float32(1.3981999507e-3)
    p = p * r + np.float32(8.3334519073e-3)
    p = p * r + np.float32(4.1665795894e-2)
    p = p * r + np.float32(1.6666665459e-1)
    p = p * r + np.float32(5.0000001201e-1)
    p = p * r * r + r + np.float32(1.0)
    return p * pow2_int(np.int32(n))


def _block_rows(cache, b, t0, n, kv0, nkv, buf):
    """Rows ``t0 .. n-1`` of block ``b`` as float32 ``[n - t0, num_kv_heads, head_dim]``, KV heads
    ``kv0 .. kv0+nkv-1`` valid. bf16 bits are widened (exactly) into ``buf`` (uint32 ``[block_size,
    num_kv_heads, head_dim]``) and a float32 view of it returned. A float32 block is copied into ``buf``
    when all its heads are read (one linear read of the block, which the hardware prefetcher streams:
    in the engine, where the blocks come from DRAM, 10% faster at 32 sequences than reading each
    head's rows in place); with fewer heads, the rows are read in place (a view)."""


@overload(_block_rows, jit_options=_JIT)
def _block_rows_impl(cache, b, t0, n, kv0, nkv, buf):
    if cache.dtype == nb_types.float32:

        def float32_rows(cache, b, t0, n, kv0, nkv, buf):
            src = cache[b, t0:n]
            if nkv < cache.shape[2]:
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

    def bf16_rows(cache, b, t0, n, kv0, nkv, buf):
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


@nb.njit(**_JIT)
def _attend(q, out, kc, vc, block_row, kv0, nkv, group, start, causal_limit, scale):
    """Attention of the query heads of KV heads ``kv0 .. kv0+nkv-1`` (``nkv * group`` rows, GQA) over
    positions ``start .. causal_limit-1`` of one sequence (``start`` > 0: a sliding window; the blocks
    before it are not read). q, out: ``[nkv * group, head_dim]``; kc, vc: float32 caches or bf16 bits.

    Block by block, per KV head: each K row is read once for the ``group`` query rows that share it,
    scores for the block, one rescale of the running (max, sum, acc) per block and row (online
    softmax, Milakov & Gimelshein 2018), then each V row accumulated into the ``group`` rows.
    (Prefetching the next block in software measured no faster in the engine.)
    """
    block_size = kc.shape[1]
    head_dim = kc.shape[3]
    rows = nkv * group
    acc = np.zeros((rows, head_dim), dtype=np.float32)
    m = np.full(rows, np.float32(-1e30), dtype=np.float32)  # finite: fastmath assumes no infs
    denom = np.zeros(rows, dtype=np.float32)
    kbits = np.empty((block_size, kc.shape[2], head_dim), dtype=np.uint32)
    vbits = np.empty((block_size, kc.shape[2], head_dim), dtype=np.uint32)
    s = np.empty((rows, block_size), dtype=np.float32)
    qs = np.empty((rows, head_dim), dtype=np.float32)
    for r in range(rows):
        qr = q[r]
        qsr = qs[r]
        for d in range(head_dim):
            qsr[d] = qr[d] * scale
    num_blocks = (causal_limit + block_size - 1) // block_size
    for j in range(start // block_size, num_blocks):
        b = np.int64(block_row[j])
        n = min(block_size, causal_limit - j * block_size)
        t0 = max(0, start - j * block_size)  # rows of the block before the window's first position
        nt = n - t0
        kb = _block_rows(kc, b, t0, n, kv0, nkv, kbits)
        vb = _block_rows(vc, b, t0, n, kv0, nkv, vbits)
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
                bm = np.float32(-1e30)
                for i in range(nt):
                    bm = max(bm, sr[i])
                new_m = max(m[r], bm)
                corr = _exp_f32(m[r] - new_m)
                m[r] = new_m
                total = np.float32(0.0)
                for i in range(nt):
                    p = _exp_f32(sr[i] - new_m)
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
    for r in range(rows):
        inv = np.float32(1.0) / denom[r] if denom[r] > 0 else np.float32(0.0)
        ar = acc[r]
        orow = out[r]
        for d in range(head_dim):
            orow[d] = ar[d] * inv


def _kv_heads_per_task(num_items: int, num_kv_heads: int) -> int:
    """All KV heads in one task (contiguous block reads) when there are enough items to keep every
    thread busy; one KV head per task otherwise (a batch of one still uses all threads)."""
    return num_kv_heads if num_items >= 2 * nb.get_num_threads() else 1


def _paged_attention_kernel(out, query, kc, vc, block_tables, context_lens, scale, nkv, window):
    num_seqs = query.shape[0]
    num_heads = query.shape[1]
    num_kv_heads = kc.shape[2]
    group = num_heads // num_kv_heads
    chunks = num_kv_heads // nkv
    for task in nb.prange(num_seqs * chunks):
        s = task // chunks
        kv0 = (task % chunks) * nkv
        h0 = kv0 * group
        ctx = np.int64(context_lens[s])
        _attend(
            query[s, h0 : h0 + nkv * group],
            out[s, h0 : h0 + nkv * group],
            kc,
            vc,
            block_tables[s],
            kv0,
            nkv,
            group,
            max(0, ctx - window) if window > 0 else 0,
            ctx,
            scale,
        )


def _check_attention_args(out, query, key_cache, value_cache, block_tables):
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
    out, query, key_cache, value_cache, block_tables, context_lens, scale, max_context_len=None, sliding_window=None
):
    """Decode attention: one query token per sequence over its paged K/V.

    Args:
        out: float32 ``[num_seqs, num_heads, head_dim]``, written.
        query: float32 ``[num_seqs, num_heads, head_dim]``.
        key_cache, value_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]`` float32 or bf16.
        block_tables: int32 ``[num_seqs, max_blocks_per_seq]``.
        context_lens: int32 ``[num_seqs]``, tokens of K/V to attend (including the current one).
        scale: softmax scale, usually ``head_dim ** -0.5``.
        max_context_len: an upper bound on ``context_lens`` (as the CUDA backend takes it); with the
            batch's size it picks the serial or the thread-parallel kernel.
        sliding_window: W or None; with W the query sees only the last W positions (itself and the
            W - 1 before it, as HF's Mistral), and blocks wholly before them are not read.
    Math: ``out[s, h] = softmax(scale * q K^T) V`` over positions ``0 .. context_lens[s]-1``
    (Vaswani et al. 2017, eq. 1), GQA: head h uses KV head ``h // (num_heads // num_kv_heads)``.
    """
    _check_attention_args(out, query, key_cache, value_cache, block_tables)
    kc, _ = _cache_view(key_cache)
    vc, _ = _cache_view(value_cache)
    nkv = _kv_heads_per_task(query.shape[0], key_cache.shape[2])
    work = (
        query.shape[0]
        * query.shape[1]
        * (int(max_context_len) if max_context_len else block_tables.shape[1] * key_cache.shape[1])
    )
    kernel = _paged_attention_parallel if work >= PARALLEL_MIN_WORK else _paged_attention_serial
    window = sliding_window_arg(sliding_window)
    kernel(out, query, kc, vc, block_tables, context_lens, np.float32(scale), nkv, window)


def _prefill_attention_kernel(
    out, query, kc, vc, block_tables, query_start_loc, seq_lens, scale, token_rows, token_seq, nkv, window
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
            block_tables[s],
            kv0,
            nkv,
            group,
            max(0, pos + 1 - window) if window > 0 else 0,
            pos + 1,
            scale,
        )


def _jit_serial_and_parallel(fn):
    """Two compiled versions of a prange kernel: parallel, and serial for small work, where waking
    the thread pool (next to BLAS's own threads) costs more than the work itself."""
    serial = nb.njit(**_JIT)(fn)
    parallel = nb.njit(parallel=True, **_JIT)(copy_function(fn, fn.__name__ + "_parallel"))
    return serial, parallel


_paged_attention_serial, _paged_attention_parallel = _jit_serial_and_parallel(_paged_attention_kernel)
_prefill_attention_serial, _prefill_attention_parallel = _jit_serial_and_parallel(_prefill_attention_kernel)
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
    New token at absolute position p attends positions ``0 .. p`` (causal mask), or ``p - W + 1 .. p``
    with a window.
    """
    _check_attention_args(out, query, key_cache, value_cache, block_tables)
    window = sliding_window_arg(sliding_window)
    kc, _ = _cache_view(key_cache)
    vc, _ = _cache_view(value_cache)
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
    matmul_nt = gemm_nt if query.shape[0] <= SMALL_M else _blas_nt
    for s in np.flatnonzero(tiled):
        _prefill_tiled(
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
        )
    if tiled.all():
        return
    # The rest: the Numba kernel, one task per (token, KV heads).
    token_seq = np.repeat(np.arange(len(counts), dtype=np.int64), counts)
    keep = ~tiled[token_seq]
    token_rows = np.flatnonzero(keep).astype(np.int64)
    token_seq = token_seq[keep]
    nkv = _kv_heads_per_task(len(token_rows), key_cache.shape[2])
    work = len(token_rows) * query.shape[1] * int(np.max(seq_lens, initial=0))
    kernel = _prefill_attention_parallel if work >= PARALLEL_MIN_WORK else _prefill_attention_serial
    kernel(out, query, kc, vc, block_tables, qsl, seq_lens, np.float32(scale), token_rows, token_seq, nkv, window)


# Sequences with at least this many new tokens use the BLAS-tiled path.
TILED_PREFILL_MIN_TOKENS = 32
PREFILL_KV_TILE = 256  # key positions per tile (a multiple of every supported block_size)


def _blas_nt(a, b):
    return a @ b.T


def _prefill_tiled(
    out, query, key_cache, value_cache, block_row, q_start, q_end, seq_len, scale, window=0, matmul_nt=_blas_nt
):
    """FlashAttention-style prefill of one sequence in NumPy/BLAS (Dao et al. 2022, Alg. 1): K/V are
    gathered from the paged cache one tile of ``PREFILL_KV_TILE`` positions at a time (like a GPU
    kernel staging tiles in shared memory), scores for all new tokens x tile via SGEMM, online softmax
    across tiles, causal mask only where a tile reaches the new tokens. With a sliding ``window``, each
    tile is computed only for the rows whose window it meets (every such row sees at least one of its
    keys, so no row's running max stays at -inf), and masked where it starts inside a row's window."""
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
            k = key_cache[blocks, :, kvh].reshape(-1, head_dim)[: k1 - k0].astype(np.float32, copy=False)
            v = value_cache[blocks, :, kvh].reshape(-1, head_dim)[: k1 - k0].astype(np.float32, copy=False)
            rows = slice(r0, r1)
            scores = matmul_nt(q[rows], k)
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


# ---------------------------------------------------------------- copy_blocks
@nb.njit(**_JIT)  # serial: a memory copy, too small per call for a parallel region
def _copy_blocks_layer(kc, vc, block_mapping):
    for i in range(block_mapping.shape[0]):
        src = np.int64(block_mapping[i, 0])
        dst = np.int64(block_mapping[i, 1])
        kc[dst] = kc[src]
        vc[dst] = vc[src]


def copy_blocks(key_caches, value_caches, block_mapping):
    """Copy whole blocks ``src -> dst`` in every layer's K and V cache.

    Args:
        key_caches, value_caches: lists (one per layer) of ``[num_blocks, block_size, num_kv_heads,
            head_dim]`` arrays, modified in place.
        block_mapping: int64 ``[n, 2]`` of ``(src, dst)`` pairs; every dst is distinct and no dst is
            a src of the same call (copy-on-write targets are fresh blocks).

    Raises:
        ValueError: a mapping breaking those rules (``backend.check_block_mapping``).
    """
    if not key_caches:
        return
    block_mapping = check_block_mapping(block_mapping, key_caches[0].shape[0])
    if block_mapping.shape[0] == 0:
        return
    for kc, vc in zip(key_caches, value_caches):
        kcv, _ = _cache_view(kc)
        vcv, _ = _cache_view(vc)
        _copy_blocks_layer(kcv, vcv, block_mapping)


# ---------------------------------------------------------------- dense model ops
@nb.njit(**_JIT)  # serial: one row is 0.5-4k values; a parallel region costs more than it saves
def _rms_norm_rows(x, weight, eps, out):
    T, H = x.shape
    for t in range(T):
        row = x[t]
        ss = np.float32(0.0)
        for i in range(H):
            ss += row[i] * row[i]
        r = np.float32(1.0) / np.sqrt(ss / np.float32(H) + eps)
        for i in range(H):
            out[t, i] = row[i] * r * weight[i]


@nb.njit(**_JIT)
def _add_rms_norm_rows(x, residual, weight, eps, out):
    T, H = x.shape
    for t in range(T):
        res = residual[t]
        ss = np.float32(0.0)
        for i in range(H):
            v = res[i] + x[t, i]
            res[i] = v
            ss += v * v
        r = np.float32(1.0) / np.sqrt(ss / np.float32(H) + eps)
        for i in range(H):
            out[t, i] = res[i] * r * weight[i]


def rms_norm(x, weight, eps, residual=None):
    """RMSNorm (Zhang & Sennrich 2019): ``x / sqrt(mean(x^2) + eps) * weight``.

    With ``residual`` (vLLM's fused_add_rms_norm): ``residual += x`` in place first, and the norm of
    the sum is returned. x, residual: float32 ``[num_tokens, hidden]``; weight ``[hidden]``. Returns a
    new float32 ``[num_tokens, hidden]``. One Numba pass per row (sum of squares in float32).
    """
    out = np.empty(x.shape, np.float32)
    if residual is None:
        _rms_norm_rows(x, weight, np.float32(eps), out)
    else:
        _add_rms_norm_rows(x, residual, weight, np.float32(eps), out)
    return out


@nb.njit(**_JIT)
def _rotate_half(positions, x, cos_sin_cache):
    T, H, D = x.shape
    half = D // 2
    for t in range(T):
        cs = cos_sin_cache[positions[t]]
        for h in range(H):
            v = x[t, h]
            for i in range(half):
                x1 = v[i]
                x2 = v[half + i]
                v[i] = x1 * cs[i] - x2 * cs[half + i]
                v[half + i] = x2 * cs[i] + x1 * cs[half + i]


def rotary_embedding(positions, query, key, cos_sin_cache):
    """Apply RoPE (Su et al. 2021) in place, HF/NeoX "rotate_half" layout.

    positions: int64 ``[num_tokens]``; query ``[num_tokens, num_heads, head_dim]``,
    key ``[num_tokens, num_kv_heads, head_dim]`` float32; cos_sin_cache float32
    ``[max_position, head_dim]`` = concat(cos, sin) of ``pos * theta^(-2i/head_dim)``, i < head_dim/2.
    """
    positions = np.asarray(positions, dtype=np.int64)
    _rotate_half(positions, query, cos_sin_cache)
    _rotate_half(positions, key, cos_sin_cache)


# serial: with the vector exp, a 32-token decode step's rows take ~20 us; NumPy's division semantics
# (no ZeroDivisionError check, whose branch keeps the loop scalar)
@nb.njit(error_model="numpy", **_JIT)
def _silu_and_mul_rows(x, out):
    inter = out.shape[1]
    for t in range(x.shape[0]):
        gate = x[t, :inter]
        up = x[t, inter:]
        o = out[t]
        for i in range(inter):
            o[i] = gate[i] / (np.float32(1.0) + _exp_f32(-gate[i])) * up[i]


def silu_and_mul(x):
    """SwiGLU (Shazeer 2020): x float32 ``[num_tokens, 2 * inter]`` -> a new float32 ``[num_tokens,
    inter]`` = ``silu(x[:, :inter]) * x[:, inter:]``, ``silu(g) = g / (1 + exp(-g))``, in one Numba pass
    with the vectorized ``_exp_f32`` (~1 ulp; ``exp`` clamped to [-87, 88], where silu is g or 0 to
    float32 precision)."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    out = np.empty((x.shape[0], x.shape[1] // 2), np.float32)
    _silu_and_mul_rows(x, out)
    return out


@nb.njit(cache=True, nogil=True)  # no fastmath: it writes -inf
def _apply_token_bitmask(logits, bitmask, rows):
    vocab = logits.shape[1]
    covered = min(vocab, bitmask.shape[1] * 32)
    for i in range(rows.shape[0]):
        row = logits[rows[i]]
        words = bitmask[i]
        for v in range(covered):
            if (words[v >> 5] >> (v & 31)) & 1 == 0:
                row[v] = -np.inf
        for v in range(covered, vocab):
            row[v] = -np.inf


def apply_token_bitmask(logits, bitmask, rows):
    """Structured outputs: set the logits of the tokens a bitmask forbids to ``-inf``, in place.

    Args:
        logits: float32 ``[num_rows, vocab]``, modified.
        bitmask: int32 ``[n, words]``; token ``t`` is allowed in mask ``i`` when bit ``t % 32`` of word
            ``t // 32`` is set (the packed layout of vLLM, xgrammar and llguidance); tokens past
            ``32 * words`` are forbidden.
        rows: int ``[n]``, the logits row each mask applies to (rows without a mask are untouched).
    Raises:
        ValueError on shapes or dtypes that do not fit.
    """
    rows = np.asarray(rows, dtype=np.int64)
    if logits.dtype != np.float32 or logits.ndim != 2:
        raise ValueError(f"logits must be float32 [rows, vocab], got {logits.dtype} {logits.shape}")
    if bitmask.dtype != np.int32 or bitmask.ndim != 2 or bitmask.shape[0] != rows.shape[0]:
        raise ValueError(f"bitmask must be int32 [{rows.shape[0]}, words], got {bitmask.dtype} {bitmask.shape}")
    if rows.size and (rows.min() < 0 or rows.max() >= logits.shape[0]):
        raise ValueError(f"rows must index the {logits.shape[0]} logits rows")
    _apply_token_bitmask(logits, bitmask, rows)


def _check_cpu_dtype(dtype: str) -> None:
    if dtype != "float32":
        raise ValueError(f"dtype {dtype!r} is not supported on the CPU backend (float32 only)")


class CPUBackend:
    """The CPU kernels behind the backend interface the model calls (same names as ``CudaBackend``).

    Arrays are NumPy; activations float32; linear weights ``[out, in]`` as checkpoints store them;
    matmuls through NumPy's BLAS, or Numba kernels for few rows (``cpu_gemm``) and for quantized weights
    (``cpu_quant``).
    """

    name = "cpu"
    xp = np
    dtype_pairs = (("float32", "float32"), ("float32", "bfloat16"))
    #: no graphs to capture: a decode step on static buffers runs kernel by kernel (``cuda_graph``)
    supports_cuda_graphs = False

    @staticmethod
    def auto_dtype(checkpoint_dtype: str | None) -> str:
        """float32, the CPU's only activation dtype."""
        return "float32"

    @staticmethod
    def default_kv_cache_memory(gpu_memory_utilization: float) -> int:
        """1 GiB, whatever the GPU setting."""
        return DEFAULT_KV_CACHE_MEMORY

    reshape_and_cache = staticmethod(reshape_and_cache)
    rotary_embedding_and_cache = staticmethod(rotary_embedding_and_cache)
    paged_attention = staticmethod(paged_attention)
    prefill_attention = staticmethod(prefill_attention)
    copy_blocks = staticmethod(copy_blocks)
    rms_norm = staticmethod(rms_norm)
    rotary_embedding = staticmethod(rotary_embedding)
    silu_and_mul = staticmethod(silu_and_mul)
    sample = staticmethod(cpu_sampling.sample)  # compiled; ``sample`` above is its reference
    apply_token_bitmask = staticmethod(apply_token_bitmask)

    @staticmethod
    def zeros(shape, dtype):
        """A zero-filled array (KV caches); ``dtype`` may be ``ml_dtypes.bfloat16``. Every page is written
        now (``np.zeros`` maps pages lazily), so the pool's memory is committed at start-up and the first
        request to touch a block pays no page faults (3 ms per layer for a 512-token prefill otherwise)."""
        a = np.empty(shape, dtype=dtype)
        a.fill(0)
        return a

    @staticmethod
    def asarray(x, dtype=None):
        """Host array -> backend array (a no-op view where possible)."""
        return np.asarray(x, dtype=dtype)

    @staticmethod
    def to_numpy(x):
        return np.asarray(x)

    @staticmethod
    def split_qkv(qkv, num_heads: int, num_kv_heads: int, head_dim: int) -> tuple:
        """A fused QKV projection ``[num_tokens, (num_heads + 2 num_kv_heads) head_dim]`` as contiguous
        ``q [T, num_heads, D]``, ``k``, ``v [T, num_kv_heads, D]`` copies (the Numba kernels are compiled
        for contiguous arrays)."""
        T, hq, hk = qkv.shape[0], num_heads * head_dim, num_kv_heads * head_dim
        return (
            np.ascontiguousarray(qkv[:, :hq]).reshape(T, num_heads, head_dim),
            np.ascontiguousarray(qkv[:, hq : hq + hk]).reshape(T, num_kv_heads, head_dim),
            np.ascontiguousarray(qkv[:, hq + hk :]).reshape(T, num_kv_heads, head_dim),
        )

    @staticmethod
    def upload(dst, host) -> None:
        """Copy ``host``'s bytes into C-contiguous ``dst`` (same nbytes): the CUDA backend's one
        host-to-device copy, here a memory copy."""
        dst.reshape(-1).view(np.uint8)[...] = np.ascontiguousarray(host).reshape(-1).view(np.uint8)

    def __init__(self):
        # id(host tensor) -> (it, what it became) while a model loads: a tied embedding and LM head
        # share one array (float32) or one repacked copy (quantized)
        self._loaded = {}

    def _once(self, host, convert):
        if id(host) not in self._loaded:
            self._loaded[id(host)] = (host, convert(host))
        return self._loaded[id(host)][1]

    def load_weight(self, host, dtype: str = "float32"):
        """A host tensor (any float dtype, e.g. a memory-mapped safetensors view) -> a C-contiguous
        float32 copy in NumPy's own memory, which NumPy backs with transparent huge pages where the
        kernel allows (a memory-mapped file's 4 KiB pages made batch-1 decode up to 20% slower, from TLB
        misses); a ``QuantizedTensor`` (an embedding table) stays in its blocks, repacked
        (``cpu_quant``)."""
        _check_cpu_dtype(dtype)
        if isinstance(host, QuantizedTensor):
            return self._once(host, repack)
        return self._once(host, lambda h: np.array(h, dtype=np.float32, order="C"))

    def load_linear(self, parts: list, dtype: str = "float32"):
        """HF ``[out_i, in]`` weights fused along ``out`` -> one C-contiguous float32 ``[sum out_i, in]``
        (the layout ``linear`` takes); ``QuantizedTensor`` parts of one format stay in their blocks (rows
        concatenated, then repacked: ``cpu_quant.RepackedQuantized``), mixed formats are dequantized. A
        single part already loaded (a tied LM head) is the same array."""
        _check_cpu_dtype(dtype)
        if len(parts) == 1:
            return self.load_weight(parts[0], dtype)
        if all(isinstance(p, QuantizedTensor) for p in parts) and len({p.qtype for p in parts}) == 1:
            return repack(QuantizedTensor.concat(parts))
        parts = [p.dequantize() if isinstance(p, QuantizedTensor) else p for p in parts]
        return np.concatenate([np.asarray(p, dtype=np.float32) for p in parts])

    def finish_loading(self):
        """Forget the host tensors seen while loading (their memory can be freed)."""
        self._loaded.clear()

    @staticmethod
    def linear(x, weight, bias=None, float32_out=False):
        """``x [M, in] @ weight.T (+ bias)`` -> float32 ``[M, out]`` for a weight ``[out, in]`` from
        ``load_linear``: float32 through ``cpu_gemm.gemm_nt`` for M <= ``cpu_gemm.SMALL_M`` (decode
        batches), through BLAS's SGEMM above; a ``RepackedQuantized`` weight through
        ``cpu_quant.quant_linear``. Always float32 (the CPU's only activation dtype), so ``float32_out``
        changes nothing."""
        if isinstance(weight, RepackedQuantized):
            y = quant_linear(x, weight)
        elif x.shape[0] <= SMALL_M:
            y = gemm_nt(x, weight)
        else:
            y = x @ weight.T
        if bias is not None:
            y += bias
        return y

    @staticmethod
    def embedding(token_ids, table):
        """Rows of ``table [vocab, hidden]`` for ``token_ids [n]``, as float32 (a quantized table's rows
        are dequantized on lookup)."""
        if isinstance(table, RepackedQuantized):
            return quant_embedding(token_ids, table)
        return table[token_ids].astype(np.float32, copy=False)
