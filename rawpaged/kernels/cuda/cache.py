"""The CUDA backend's paged KV-cache writes (``cuda/cache.cu``; vLLM's ``csrc/cache_kernels.cu`` names):
``reshape_and_cache``, the fused ``rotary_embedding_and_cache`` and ``copy_blocks``. Semantics as the CPU's
(``rawpaged.kernels.cpu.cache``); caches float32, float16 or bfloat16 (uint16 bits)."""

from __future__ import annotations

import numpy as np

from rawpaged.kernels.backend import check_block_mapping
from rawpaged.kernels.cuda import launch_config, program
from rawpaged.kernels.cuda.elementwise import check_rope
from rawpaged.kernels.cuda.launch import ctype, i32, i64, row_stride


def check_cache_write(key, value, key_cache, value_cache, slot_mapping) -> None:
    """Raises ValueError unless K/V rows ``[num_tokens, num_kv_heads, head_dim]`` of one dtype fit C-contiguous
    caches of one shape and dtype, with one ``slot_mapping`` entry per token."""
    if key.shape != value.shape or key.dtype != value.dtype or key.shape[1:] != key_cache.shape[2:]:
        raise ValueError(f"key {key.shape} / value {value.shape} do not match cache {key_cache.shape}")
    if key_cache.shape != value_cache.shape or key_cache.dtype != value_cache.dtype:
        raise ValueError("key_cache and value_cache must have the same shape and dtype")
    if not (key_cache.flags.c_contiguous and value_cache.flags.c_contiguous):
        raise ValueError("KV caches must be C-contiguous")
    if slot_mapping.shape[0] != key.shape[0]:
        raise ValueError(f"slot_mapping has {slot_mapping.shape[0]} entries for {key.shape[0]} tokens")


def reshape_and_cache(ctx, key, value, key_cache, value_cache, slot_mapping):
    """Write new K/V rows into the paged caches (see ``rawpaged.kernels.cpu.cache.reshape_and_cache``).

    key, value: ``[num_tokens, num_kv_heads, head_dim]`` (activation dtype; token stride free, e.g. a
    view into a fused QKV output); caches ``[num_blocks, block_size, num_kv_heads, head_dim]``,
    C-contiguous, written in place (float32 -> bf16/fp16 rounds to nearest even); slot_mapping int64
    ``[num_tokens]``, ``-1`` skips a token.
    """
    act, cache = ctype(key, "key"), ctype(key_cache, "key_cache")
    check_cache_write(key, value, key_cache, value_cache, slot_mapping)
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    slots = ctx.to_device(slot_mapping, np.int64)
    threads = launch_config.round_threads(num_kv_heads * head_dim, 512)
    ctx.kernel(
        act,
        cache,
        f"reshape_and_cache_kernel<{act}, {cache}>",
        (num_tokens, 1, 1),
        (threads, 1, 1),
        (
            key,
            value,
            key_cache,
            value_cache,
            slots,
            i64(row_stride(key, "key", 2)),
            i64(row_stride(value, "value", 2)),
            i32(num_kv_heads),
            i32(head_dim),
            i32(key_cache.shape[1]),
        ),
    )


def rotary_embedding_and_cache(
    ctx, positions, query, key, value, key_cache, value_cache, slot_mapping, cos_sin_cache
) -> None:
    """``rotary_embedding`` of query and key, then ``reshape_and_cache`` of the rotated key and the
    value, in one kernel (``cuda/cache.cu``; same results bit for bit): query is rotated in place, key
    and value are only read (key is not rotated in place, unlike the CPU's composition). Arguments as
    those two methods take them; ``-1`` slots rotate the query only."""
    act, cache = ctype(key, "key"), ctype(key_cache, "key_cache")
    check_cache_write(key, value, key_cache, value_cache, slot_mapping)
    check_rope(query, key, cos_sin_cache)
    num_tokens, num_heads, head_dim = query.shape
    if num_tokens == 0:
        return
    num_kv_heads = key.shape[1]
    work = max((num_heads + num_kv_heads) * head_dim // 2, num_kv_heads * head_dim)
    ctx.kernel(
        act,
        cache,
        f"rotary_embedding_and_cache_kernel<{act}, {cache}>",
        (num_tokens, 1, 1),
        (launch_config.round_threads(work, 512), 1, 1),
        (
            ctx.to_device(positions, np.int64),
            query,
            i64(row_stride(query, "query", 2)),
            key,
            i64(row_stride(key, "key", 2)),
            value,
            i64(row_stride(value, "value", 2)),
            key_cache,
            value_cache,
            ctx.to_device(slot_mapping, np.int64),
            ctx.xp.ascontiguousarray(cos_sin_cache),
            i32(num_heads),
            i32(num_kv_heads),
            i32(head_dim),
        ),
    )


def copy_blocks(ctx, key_caches, value_caches, block_mapping):
    """Copy whole blocks ``src -> dst`` in every layer's K and V cache with one launch.

    key_caches/value_caches: lists (one per layer) of C-contiguous caches of one shape and dtype;
    block_mapping int64 ``[n, 2]`` (src, dst) pairs, dst distinct and never a src of the same call: the
    pairs run concurrently, so the mapping is checked on the host first (``check_block_mapping``,
    ValueError).
    """
    if not key_caches:
        return
    host = block_mapping.get() if hasattr(block_mapping, "get") else block_mapping
    m = ctx.to_device(check_block_mapping(host, key_caches[0].shape[0]), np.int64)
    if m.shape[0] == 0:
        return
    caches = list(key_caches) + list(value_caches)
    ref = caches[0]
    cache = ctype(ref, "cache")
    for c in caches:
        if c.shape != ref.shape or c.dtype != ref.dtype or not c.flags.c_contiguous:
            raise ValueError("all KV caches must be C-contiguous with one shape and dtype")
    if len(key_caches) != len(value_caches):
        raise ValueError("key_caches and value_caches must have one entry per layer")
    block_bytes = int(np.prod(ref.shape[1:])) * ref.dtype.itemsize
    word = launch_config.copy_word_bytes(block_bytes)
    kptr = ctx.xp.asarray(np.array([ctx.address(c) for c in key_caches], dtype=np.uint64))
    vptr = ctx.xp.asarray(np.array([ctx.address(c) for c in value_caches], dtype=np.uint64))
    # copy_blocks is dtype-free and in every module: use one that is already compiled if possible.
    compiled = getattr(ctx.launch, "modules", {})
    act, cache = next((p for p in program.DTYPE_PAIRS if p[1] == cache and p in compiled), (cache, cache))
    ctx.kernel(
        act,
        cache,
        f"copy_blocks_kernel<{word}>",
        (m.shape[0], len(key_caches), 1),
        (256, 1, 1),
        (kptr, vptr, m, i64(block_bytes // word)),
    )
