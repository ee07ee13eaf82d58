"""The CUDA backend's paged KV-cache writes (``cuda/cache.cu``; vLLM's ``csrc/cache_kernels.cu`` names):
``reshape_and_cache``, the fused ``rotary_embedding_and_cache`` and ``copy_blocks``. Semantics as the CPU's
(``rawpaged.kernels.cpu.cache``); caches float32, float16 or bfloat16 (uint16 bits), or ``QuantizedKVCache``s
(int8 or fp8 E4M3 values, each (slot, KV head) row quantized with its float32 scale as it is written)."""

from __future__ import annotations

import numpy as np

from rawpaged.kernels.backend import check_block_mapping
from rawpaged.kernels.cuda import launch_config, program
from rawpaged.kernels.cuda.elementwise import check_rope
from rawpaged.kernels.cuda.launch import ctype, i32, i64, kv_cache_operands, row_stride
from rawpaged.kernels.kv_cache import QuantizedKVCache


def check_cache_write(key, value, key_cache, value_cache, slot_mapping) -> None:
    """Raises ValueError unless K/V rows ``[num_tokens, num_kv_heads, head_dim]`` of one dtype fit C-contiguous
    caches (their value arrays) of one shape and dtype, with one ``slot_mapping`` entry per token."""
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
    act = ctype(key, "key")
    cache, kc, ks = kv_cache_operands(key_cache, "key_cache")
    _, vc, vs = kv_cache_operands(value_cache, "value_cache")
    check_cache_write(key, value, kc, vc, slot_mapping)
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    slots = ctx.to_device(slot_mapping, np.int64)
    if isinstance(key_cache, QuantizedKVCache):
        threads = min(512, 64 * num_kv_heads)  # a warp per K or V row
    else:
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
            kc,
            vc,
            ks,
            vs,
            slots,
            i64(row_stride(key, "key", 2)),
            i64(row_stride(value, "value", 2)),
            i32(num_kv_heads),
            i32(head_dim),
            i32(kc.shape[1]),
        ),
    )


def rotary_embedding_and_cache(
    ctx, positions, query, key, value, key_cache, value_cache, slot_mapping, cos_sin_cache
) -> None:
    """``rotary_embedding`` of query and key, then ``reshape_and_cache`` of the rotated key and the
    value, in one kernel (``cuda/cache.cu``; same results bit for bit): query is rotated in place, key
    and value are only read (key is not rotated in place, unlike the CPU's composition). Arguments as
    those two methods take them; ``-1`` slots rotate the query only."""
    act = ctype(key, "key")
    cache, kc, ks = kv_cache_operands(key_cache, "key_cache")
    _, vc, vs = kv_cache_operands(value_cache, "value_cache")
    check_cache_write(key, value, kc, vc, slot_mapping)
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
            kc,
            vc,
            ks,
            vs,
            ctx.to_device(slot_mapping, np.int64),
            ctx.xp.ascontiguousarray(cos_sin_cache),
            i32(num_heads),
            i32(num_kv_heads),
            i32(head_dim),
        ),
    )


def copy_blocks(ctx, key_caches, value_caches, block_mapping):
    """Copy whole blocks ``src -> dst`` in every layer's K and V cache with one launch (two for
    ``QuantizedKVCache``s: the values, then the scales).

    key_caches/value_caches: lists (one per layer) of C-contiguous caches of one shape and dtype;
    block_mapping int64 ``[n, 2]`` (src, dst) pairs, dst distinct and never a src of the same call: the
    pairs run concurrently, so the mapping is checked on the host first (``check_block_mapping``,
    ValueError).
    """
    if not key_caches:
        return
    if len(key_caches) != len(value_caches):
        raise ValueError("key_caches and value_caches must have one entry per layer")
    host = block_mapping.get() if hasattr(block_mapping, "get") else block_mapping
    m = ctx.to_device(check_block_mapping(host, key_caches[0].shape[0]), np.int64)
    if m.shape[0] == 0:
        return
    keys = [kv_cache_operands(c, "key_caches") for c in key_caches]
    values = [kv_cache_operands(c, "value_caches") for c in value_caches]
    cache = keys[0][0]
    # copy_blocks is dtype-free and in every module: use one that is already compiled if possible.
    compiled = getattr(ctx.launch, "modules", {})
    pairs = [p for p in program.DTYPE_PAIRS if p[1] == cache]
    module = next((p for p in pairs if p in compiled), pairs[0])
    _copy_block_arrays(ctx, module, [k for _, k, _ in keys], [v for _, v, _ in values], m)
    if isinstance(key_caches[0], QuantizedKVCache):
        _copy_block_arrays(ctx, module, [s for _, _, s in keys], [s for _, _, s in values], m)


def _copy_block_arrays(ctx, module: tuple, key_arrays: list, value_arrays: list, mapping) -> None:
    """One ``copy_blocks_kernel`` launch over every layer's arrays (blocks along axis 0)."""
    ref = key_arrays[0]
    for a in key_arrays + value_arrays:
        if a.shape != ref.shape or a.dtype != ref.dtype or not a.flags.c_contiguous:
            raise ValueError("all KV caches must be C-contiguous with one shape and dtype")
    block_bytes = int(np.prod(ref.shape[1:])) * ref.dtype.itemsize
    word = launch_config.copy_word_bytes(block_bytes)
    kptr = ctx.xp.asarray(np.array([ctx.address(a) for a in key_arrays], dtype=np.uint64))
    vptr = ctx.xp.asarray(np.array([ctx.address(a) for a in value_arrays], dtype=np.uint64))
    ctx.kernel(
        *module,
        f"copy_blocks_kernel<{word}>",
        (mapping.shape[0], len(key_arrays), 1),
        (256, 1, 1),
        (kptr, vptr, mapping, i64(block_bytes // word)),
    )
