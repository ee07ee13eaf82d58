"""Float64 NumPy references and random paged-KV fixtures shared by the kernel tests."""

from __future__ import annotations

import ml_dtypes
import numpy as np

BF16 = np.dtype(ml_dtypes.bfloat16)


def make_paged_kv(rng, context_lens, num_kv_heads, head_dim, block_size, dtype, extra_blocks=7):
    """Random K/V for each sequence, scattered through a pool in random block order.

    Returns (key_cache, value_cache, block_tables int32, keys, values) where keys[s] is the
    float64 ``[ctx, num_kv_heads, head_dim]`` K of sequence s exactly as stored (after rounding to
    the cache dtype).
    """
    blocks_per_seq = [-(-c // block_size) for c in context_lens]
    num_blocks = sum(blocks_per_seq) + extra_blocks
    perm = rng.permutation(num_blocks)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key_cache = np.full(shape, np.nan, dtype=np.float32).astype(dtype)
    value_cache = np.full(shape, np.nan, dtype=np.float32).astype(dtype)
    max_blocks = max(blocks_per_seq)
    block_tables = np.full((len(context_lens), max_blocks), -1, dtype=np.int32)
    keys, values, nxt = [], [], 0
    for s, ctx in enumerate(context_lens):
        ids = perm[nxt : nxt + blocks_per_seq[s]]
        nxt += blocks_per_seq[s]
        block_tables[s, : len(ids)] = ids
        k = rng.standard_normal((ctx, num_kv_heads, head_dim)).astype(np.float32).astype(dtype)
        v = rng.standard_normal((ctx, num_kv_heads, head_dim)).astype(np.float32).astype(dtype)
        for p in range(ctx):
            key_cache[ids[p // block_size], p % block_size] = k[p]
            value_cache[ids[p // block_size], p % block_size] = v[p]
        keys.append(k.astype(np.float64))
        values.append(v.astype(np.float64))
    return key_cache, value_cache, block_tables, keys, values


def attention_ref(q, k, v, scale, causal_offset=None, window=None, soft_cap=None):
    """float64 softmax(scale q k^T) v for one sequence with GQA (with ``soft_cap`` c, the scores
    ``c * tanh(scale q k^T / c)``: Gemma 2's ``attn_logit_softcapping``).

    q ``[n_q, num_heads, d]``, k/v ``[ctx, num_kv_heads, d]``. With ``causal_offset`` o, query i sits at
    absolute position o + i and sees keys 0..o+i; without it every query sees all keys (a decode query
    sits at ctx - 1). With ``window`` W a query at position p sees only keys p - W + 1 .. p.
    """
    q = q.astype(np.float64)
    num_heads, num_kv = q.shape[1], k.shape[1]
    group = num_heads // num_kv
    kk = np.repeat(k, group, axis=1)  # [ctx, H, d]
    vv = np.repeat(v, group, axis=1)
    scores = np.einsum("qhd,khd->hqk", q, kk) * scale
    if soft_cap:
        scores = soft_cap * np.tanh(scores / soft_cap)
    if causal_offset is not None:
        qpos = causal_offset + np.arange(q.shape[0])[:, None]
        kpos = np.arange(k.shape[0])[None, :]
        scores = np.where(kpos <= qpos, scores, -np.inf)
    if window is not None:
        qpos = (causal_offset if causal_offset is not None else k.shape[0] - q.shape[0]) + np.arange(q.shape[0])
        scores = np.where(np.arange(k.shape[0])[None, :] > qpos[:, None] - window, scores, -np.inf)
    scores -= scores.max(axis=-1, keepdims=True)
    p = np.exp(scores)
    p /= p.sum(axis=-1, keepdims=True)
    return np.einsum("hqk,khd->qhd", p, vv)


def rope_cache(head_dim, max_position, theta):
    """float32 ``[max_position, head_dim]`` concat(cos, sin) table, as ``rotary_embedding`` takes it."""
    inv = theta ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    ang = np.arange(max_position)[:, None] * inv[None]
    return np.concatenate([np.cos(ang), np.sin(ang)], -1).astype(np.float32)


def rope_ref(x, positions, theta):
    """float64 RoPE of ``x [tokens, heads, head_dim]`` at ``positions``, HF rotate-half layout."""
    d = x.shape[-1]
    inv = theta ** (-np.arange(0, d, 2, dtype=np.float64) / d)
    ang = np.asarray(positions, np.float64)[:, None] * inv[None]
    cos = np.concatenate([np.cos(ang)] * 2, -1)[:, None]
    sin = np.concatenate([np.sin(ang)] * 2, -1)[:, None]
    x = x.astype(np.float64)
    rot = np.concatenate([-x[..., d // 2 :], x[..., : d // 2]], -1)
    return x * cos + rot * sin


def assert_prefill_matches(out, q, query_start_loc, seq_lens, keys, values, scale, window=None, soft_cap=None, **tol):
    """Each sequence's rows of ``out`` equal the float64 causal attention of its new tokens (the last
    ``query_start_loc[s+1] - query_start_loc[s]`` positions of a sequence of ``seq_lens[s]``)."""
    tol = tol or dict(rtol=2e-4, atol=2e-5)
    for s, seq_len in enumerate(seq_lens):
        rows = slice(int(query_start_loc[s]), int(query_start_loc[s + 1]))
        n = rows.stop - rows.start
        ref = attention_ref(
            np.asarray(q[rows], np.float64),
            keys[s],
            values[s],
            scale,
            causal_offset=seq_len - n,
            window=window,
            soft_cap=soft_cap,
        )
        np.testing.assert_allclose(np.asarray(out[rows], np.float64), ref, err_msg=f"seq {s}", **tol)


def assert_cache_rows_written(key_cache, value_cache, key, value, slot_mapping):
    """After reshape_and_cache into NaN-filled host caches: each token's K/V row sits in its slot, rounded
    to the cache dtype (bit-exact), and every other slot (``-1`` tokens, unused slots) is still NaN."""
    num_blocks, block_size, num_kv_heads, head_dim = key_cache.shape
    written = np.zeros(num_blocks * block_size, bool)
    for t, slot in enumerate(slot_mapping):
        if slot < 0:
            continue
        written[slot] = True
        b, o = divmod(int(slot), block_size)
        for cache, rows in ((key_cache, key), (value_cache, value)):
            want = np.asarray(rows[t]).astype(np.float32).astype(cache.dtype)
            np.testing.assert_array_equal(cache[b, o].view(np.uint8), want.view(np.uint8))
    untouched = key_cache.reshape(-1, num_kv_heads, head_dim)[~written].astype(np.float32)
    assert np.isnan(untouched).all(), "a skipped (-1) or unused slot was written"


def copy_blocks_expected(caches, block_mapping):
    """Per-layer caches after copying block ``src`` to ``dst`` for each (src, dst) row (copies made)."""
    out = []
    for cache in caches:
        exp = cache.copy()
        for src, dst in block_mapping:
            exp[dst] = cache[src]
        out.append(exp)
    return out


def rms_norm_ref(x, weight, eps, residual=None):
    """float64 RMSNorm (Zhang & Sennrich 2019) of ``x + residual``; returns (output, the summed input)."""
    s = np.asarray(x, np.float64) + (0.0 if residual is None else np.asarray(residual, np.float64))
    return s / np.sqrt((s**2).mean(-1, keepdims=True) + eps) * np.asarray(weight, np.float64), s


def poison_before(key_cache, value_cache, block_tables, firsts):
    """NaN into the cached K/V of positions ``0 .. firsts[s] - 1`` of each sequence s (positions a
    windowed kernel must never read: one read turns its output into NaN)."""
    block_size = key_cache.shape[1]
    for s, first in enumerate(firsts):
        for p in range(int(first)):
            for cache in (key_cache, value_cache):
                cache[block_tables[s, p // block_size], p % block_size] = np.nan


def quantize_ref(x, kind):
    """float64 reference of a quantized KV cache's rows (``rawpaged.dtypes.QuantizedKVType``): ``x [...,
    head_dim]`` -> (values in ``kind.storage``, float32 scales ``[...]``). ``scale = max|x| / qmax`` in
    float32 (1 for a zero row), values ``x / scale`` rounded to nearest even (int8: clipped to +-127; fp8:
    E4M3 bits, clipped to +-448). A row holding NaN gets a NaN scale (so reading it shows)."""
    x = np.asarray(x, np.float64)
    amax = np.abs(x).max(-1)
    scale = np.where(amax > 0, amax / kind.qmax, 1.0).astype(np.float32)
    y = np.nan_to_num(x / scale.astype(np.float64)[..., None])
    if kind.name == "int8":
        q = np.clip(np.rint(y), -127, 127).astype(np.int8)
    else:
        q = np.clip(y, -448, 448).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    return q, np.where(np.isnan(amax), np.float32(np.nan), scale)


def dequantize_ref(q, scales, kind):
    """float64 values of quantized rows: ``value(q) * scale``."""
    values = q.astype(np.float64) if kind.name == "int8" else q.view(ml_dtypes.float8_e4m3fn).astype(np.float64)
    return values * np.asarray(scales, np.float64)[..., None]


def quantized_paged_kv(key_cache, value_cache, block_tables, context_lens, kind):
    """``make_paged_kv``'s float32 caches quantized by ``quantize_ref`` (unused slots' scales NaN), and each
    sequence's K and V as the quantized cache holds them (float64 ``[ctx, num_kv_heads, head_dim]``)."""
    from rawpaged.kernels.kv_cache import QuantizedKVCache

    caches = [QuantizedKVCache(*quantize_ref(c, kind), kind) for c in (key_cache, value_cache)]
    block_size = key_cache.shape[1]
    seqs = []
    for cache in caches:
        full = dequantize_ref(cache.data, cache.scales, kind)
        seqs.append(
            [
                full[block_tables[s, np.arange(c) // block_size], np.arange(c) % block_size]
                for s, c in enumerate(context_lens)
            ]
        )
    return caches[0], caches[1], seqs[0], seqs[1]


def assert_rows_quantized(values, scales, x, kind):
    """Rows ``x [..., head_dim]`` were quantized to ``values``/``scales``: each scale is ``max|x| / qmax``
    (to float32 rounding) and each value a nearest representable one to ``x / scale`` (either side of a
    tie, where float32 and float64 division may disagree)."""
    x = np.asarray(x, np.float64)
    _, want = quantize_ref(x, kind)
    np.testing.assert_allclose(scales, want, rtol=1e-6)
    y = x / np.asarray(scales, np.float64)[..., None]
    got = dequantize_ref(values, np.ones(values.shape[:-1]), kind)
    if kind.name == "int8":
        lo, hi = np.floor(y), np.floor(y) + 1
    else:
        grid = np.unique(np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float64))
        grid = grid[np.isfinite(grid)]
        idx = np.clip(np.searchsorted(grid, y, side="right"), 1, len(grid) - 1)
        lo, hi = grid[idx - 1], grid[idx]
    nearest = np.where(y - lo <= hi - y, lo, hi)
    tie = np.isclose(y - lo, hi - y, rtol=1e-5, atol=0)
    ok = (got == nearest) | (tie & ((got == lo) | (got == hi)))
    assert ok.all(), f"{(~ok).sum()} of {ok.size} values not rounded to nearest, e.g. {y[~ok][:3]} -> {got[~ok][:3]}"
