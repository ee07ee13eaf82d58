"""The CUDA backend's paged attention (``cuda/attention.cu``; vLLM's ``csrc/attention/`` names):
``paged_attention`` (decode, flash-decoding split-K when the grid is small) and ``prefill_attention``
(causal; plain, chunked and prefix-cached prefill). Semantics as the CPU's
(``rawpaged.kernels.cpu.attention``); activations and caches float32, float16 or bfloat16 (uint16 bits) in
the pairs of ``program.DTYPE_PAIRS``; math in float32.

Both kernels take the same leading operands (checked and packed once, by ``_operands``): out and its row
stride, the query and its row stride, the two caches and their scales (a ``QuantizedKVCache``'s; null for
float caches), the block tables and their width, then the head counts, the block size and the softmax
scale.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from rawpaged.kernels.backend import sliding_window_arg, soft_cap_arg
from rawpaged.kernels.cuda import launch_config, program
from rawpaged.kernels.cuda.launch import ctype, i32, i64, kv_cache_operands, row_stride


class _Operands(NamedTuple):
    act: str  # C++ type of query/out
    cache: str  # C++ type of the caches
    out: tuple  # (out, out row stride)
    kv: tuple  # (query, its row stride, key and value caches, their scales or NULL, block_tables, its width)
    heads: tuple  # (num_heads, num_kv_heads, block_size, scale)
    window: np.int32  # sliding window, 0 for none
    soft_cap: np.float32  # logit soft-cap, 0 for none


def _check(out, query, key_cache, value_cache, block_tables) -> None:
    if out.shape != query.shape or out.dtype != query.dtype:
        raise ValueError(f"out {out.shape}/{out.dtype} must match query {query.shape}/{query.dtype}")
    if key_cache.shape != value_cache.shape or key_cache.dtype != value_cache.dtype:
        raise ValueError("key_cache and value_cache must have the same shape and dtype")
    if not (key_cache.flags.c_contiguous and value_cache.flags.c_contiguous):
        raise ValueError("KV caches must be C-contiguous")
    num_heads, head_dim = query.shape[-2:]
    num_kv_heads = key_cache.shape[2]
    if head_dim != key_cache.shape[3] or num_heads % num_kv_heads:
        raise ValueError(f"query heads/head_dim {query.shape[-2:]} incompatible with cache {key_cache.shape}")
    if head_dim not in program.HEAD_DIMS:
        raise ValueError(
            f"head_dim {head_dim} not compiled; supported: {program.HEAD_DIMS} "
            f"(rawpaged/kernels/cuda/program.py: HEAD_DIMS)"
        )
    if block_tables.ndim != 2:
        raise ValueError("block_tables must be int32 [num_seqs, max_blocks_per_seq]")
    block_size = key_cache.shape[1]
    if block_size < 1 or block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two for the attention kernels, got {block_size}")


def _operands(ctx, out, query, key_cache, value_cache, block_tables, scale, sliding_window, soft_cap) -> _Operands:
    """Check the arguments both kernels share (ValueError) and pack them in the kernels' order."""
    cache, kc, ks = kv_cache_operands(key_cache, "key_cache")
    _, vc, vs = kv_cache_operands(value_cache, "value_cache")
    _check(out, query, kc, vc, block_tables)
    bt = ctx.to_device(block_tables, np.int32)
    _, block_size, num_kv_heads, _ = kc.shape
    return _Operands(
        act=ctype(query, "query"),
        cache=cache,
        out=(out, i64(row_stride(out, "out", 2))),
        kv=(query, i64(row_stride(query, "query", 2)), kc, vc, ks, vs, bt, i32(bt.shape[1])),
        heads=(i32(query.shape[1]), i32(num_kv_heads), i32(block_size), np.float32(scale)),
        window=i32(sliding_window_arg(sliding_window)),
        soft_cap=soft_cap_arg(soft_cap),
    )


def paged_attention(
    ctx,
    out,
    query,
    key_cache,
    value_cache,
    block_tables,
    context_lens,
    scale,
    max_context_len: int | None = None,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
):
    """Decode attention, one query token per sequence (see ``rawpaged.kernels.cpu.attention``).

    out/query ``[num_seqs, num_heads, head_dim]`` (same dtype; token stride free), caches
    ``[num_blocks, block_size, num_kv_heads, head_dim]``, block_tables int32 ``[num_seqs, max_blocks]``,
    context_lens int32 ``[num_seqs]``. Flash-decoding split-K when the (sequence, KV head) grid is too
    small for the GPU: partitions from :func:`launch_config.decode_config`, merged by a second kernel.
    With ``sliding_window`` W, each query sees its last W positions; partitions cover only those. With
    ``logits_soft_cap`` c > 0, scores become ``c * tanh(s / c)`` before the softmax.
    ``max_context_len``: an upper bound on ``context_lens`` known on the host (sizes the partitions);
    default ``block_tables.shape[1] * block_size``.

    Raises:
        ValueError: shapes, dtypes or a head size the kernels were not compiled for.
    """
    ops = _operands(ctx, out, query, key_cache, value_cache, block_tables, scale, sliding_window, logits_soft_cap)
    num_seqs, num_heads, head_dim = query.shape
    if num_seqs == 0:
        return
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    lens = ctx.to_device(context_lens, np.int32)
    max_ctx = max_context_len if max_context_len is not None else block_tables.shape[1] * block_size
    if ops.window:
        max_ctx = min(max_ctx, int(ops.window))
    cfg = launch_config.decode_config(num_seqs, num_heads, num_kv_heads, head_dim, max_ctx, ctx.num_sms)
    splits = cfg["num_splits"]
    part_out = part_ml = np.uint64(0)
    if splits > 1:
        part_out = ctx.xp.empty((num_seqs, num_heads, splits, head_dim), dtype=np.float32)
        part_ml = ctx.xp.empty((num_seqs, num_heads, splits, 2), dtype=np.float32)
    split_len = i32(cfg["split_len"])
    ctx.kernel(
        ops.act,
        ops.cache,
        f"paged_attention_kernel<{ops.act}, {ops.cache}, {head_dim}, {cfg['gmax']}>",
        cfg["grid"],
        cfg["block"],
        (*ops.out, part_out, part_ml, *ops.kv, lens, *ops.heads, split_len, i32(splits), ops.window, ops.soft_cap),
        cfg["smem_bytes"],
    )
    if splits > 1:
        ctx.kernel(
            ops.act,
            ops.cache,
            f"paged_attention_reduce_kernel<{ops.act}>",
            (num_heads, num_seqs, 1),
            cfg["reduce_block"],
            (*ops.out, part_out, part_ml, lens, i32(num_heads), i32(head_dim), i32(splits), split_len, ops.window),
        )


def _max_query_len(query_start_loc, seq_lens, num_seqs: int, num_tokens: int) -> int:
    """The longest run of new tokens, from host arrays (validated as on the CPU), else ``num_tokens``."""
    if not isinstance(query_start_loc, np.ndarray):
        return num_tokens
    qsl = query_start_loc.astype(np.int64)
    counts = np.diff(qsl)
    if len(qsl) != num_seqs + 1 or qsl[0] != 0 or qsl[-1] != num_tokens or (counts < 0).any():
        raise ValueError("query_start_loc must start at 0, be non-decreasing and end at num_tokens")
    if isinstance(seq_lens, np.ndarray) and (seq_lens < counts).any():
        raise ValueError("seq_lens must be >= the number of new tokens of each sequence")
    return int(counts.max(initial=0))


def prefill_attention(
    ctx,
    out,
    query,
    key_cache,
    value_cache,
    block_tables,
    query_start_loc,
    seq_lens,
    scale,
    max_query_len: int | None = None,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
):
    """Causal attention of each sequence's new tokens over all its cached K/V (see
    ``rawpaged.kernels.cpu.attention``): plain prefill, prefill after a cached prefix, chunked prefill.

    out/query ``[num_tokens, num_heads, head_dim]``; query_start_loc int32 ``[num_seqs + 1]``;
    seq_lens int32 ``[num_seqs]``; the new tokens are each sequence's last positions. Host arrays for
    query_start_loc/seq_lens are validated like on the CPU; device arrays are trusted.
    ``max_query_len``: an upper bound on new tokens per sequence (sizes the grid); default from
    ``query_start_loc`` when it is a host array, else ``num_tokens``. ``logits_soft_cap``: as
    :func:`paged_attention`.

    Raises:
        ValueError: shapes, dtypes, a head size the kernels were not compiled for, or host
            ``query_start_loc``/``seq_lens`` that do not describe the batch.
    """
    ops = _operands(ctx, out, query, key_cache, value_cache, block_tables, scale, sliding_window, logits_soft_cap)
    num_tokens, num_heads, head_dim = query.shape
    num_seqs = block_tables.shape[0]
    computed = _max_query_len(query_start_loc, seq_lens, num_seqs, num_tokens)
    if max_query_len is None:
        max_query_len = computed
    if num_tokens == 0 or num_seqs == 0 or max_query_len == 0:
        return
    cfg = launch_config.prefill_config(num_seqs, num_heads, key_cache.shape[2], head_dim, max_query_len)
    ctx.kernel(
        ops.act,
        ops.cache,
        f"prefill_attention_kernel<{ops.act}, {ops.cache}, {head_dim}>",
        cfg["grid"],
        cfg["block"],
        (
            *ops.out,
            *ops.kv,
            ctx.to_device(query_start_loc, np.int32),
            ctx.to_device(seq_lens, np.int32),
            *ops.heads,
            i32(cfg["heads_per_block"]),
            ops.window,
            ops.soft_cap,
        ),
        cfg["smem_bytes"],
    )
