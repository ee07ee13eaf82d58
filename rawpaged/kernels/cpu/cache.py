"""The CPU's paged KV-cache writes, in Numba (vLLM's ``csrc/cache_kernels.cu`` names):

* ``reshape_and_cache``: scatter new K/V rows into their slots of the paged caches.
* ``rotary_embedding_and_cache``: RoPE of query and key, then the cache write (the CUDA backend's fused
  kernel, composed).
* ``copy_blocks``: copy-on-write block copies for every layer in one call.

Caches are ``[num_blocks, block_size, num_kv_heads, head_dim]``, float32 or bfloat16
(``ml_dtypes.bfloat16``, written as its uint16 bit pattern, rounded to nearest even), or a
``QuantizedKVCache`` (``rawpaged.kernels.kv_cache``): int8 values or fp8 E4M3 bits with one float32 scale
per (slot, KV head), quantized here as each row is written (``rawpaged.dtypes.QuantizedKVType`` gives the
math). Slot of a token: ``block * block_size + offset``.
"""

from __future__ import annotations

import numba as nb
import numpy as np
from numba import types as nb_types
from numba.extending import overload

from rawpaged.dtypes import BFLOAT16
from rawpaged.kernels.backend import check_block_mapping
from rawpaged.kernels.cpu.elementwise import rotary_embedding
from rawpaged.kernels.cpu.intrinsics import f32_to_bf16_bits, f32_to_fp8_e4m3_bits
from rawpaged.kernels.cpu.jit import JIT
from rawpaged.kernels.kv_cache import QuantizedKVCache

BF16 = BFLOAT16.numpy
#: the scales a float cache's kernels are given (never read)
NO_SCALES = np.ones((1, 1, 1), np.float32)


def cache_view(cache) -> tuple:
    """``(values, scales)`` as the kernels see a cache: float32 as it is, bfloat16 as its uint16 bits, a
    ``QuantizedKVCache`` as its int8 or uint8 (fp8 bits) values; ``scales`` float32 ``[num_blocks,
    block_size, num_kv_heads]`` (``NO_SCALES`` for a float cache). The values' dtype tells the kernels the
    type. Raises ValueError for any other cache."""
    if isinstance(cache, QuantizedKVCache):
        return cache.data, cache.scales
    if cache.dtype == BF16:
        return cache.view(np.uint16), NO_SCALES
    if cache.dtype != np.float32:
        raise ValueError(f"KV cache dtype must be float32 or bfloat16, got {cache.dtype}")
    return cache, NO_SCALES


@nb.njit(**JIT)  # serial: a memory copy, too small per call for a parallel region
def reshape_and_cache_f32(key, value, key_cache, value_cache, slot_mapping):
    block_size = key_cache.shape[1]
    for t in range(key.shape[0]):
        slot = np.int64(slot_mapping[t])
        if slot < 0:
            continue
        b = slot // block_size
        o = slot % block_size
        key_cache[b, o] = key[t]
        value_cache[b, o] = value[t]


@nb.njit(**JIT)  # serial: a memory copy, too small per call for a parallel region
def reshape_and_cache_bf16(key_bits, value_bits, key_cache, value_cache, slot_mapping):
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
                key_cache[b, o, h, d] = f32_to_bf16_bits(key_bits[t, h, d])
                value_cache[b, o, h, d] = f32_to_bf16_bits(value_bits[t, h, d])


def quantize_row(src, dst, qmax):
    """One (token, KV head) row, in compiled code: ``dst`` (int8 values or uint8 fp8 E4M3 bits) ``~= src /
    scale`` with ``scale = max|src| / qmax`` (1 for a zero row); returns the scale
    (``rawpaged.dtypes.QuantizedKVType``)."""


@overload(quantize_row, jit_options=JIT)
def _quantize_row_impl(src, dst, qmax):
    int8 = dst.dtype == nb_types.int8

    def quantize(src, dst, qmax):
        amax = np.float32(0.0)
        for d in range(src.shape[0]):
            amax = max(amax, abs(src[d]))
        scale = amax / qmax if amax > 0 else np.float32(1.0)
        for d in range(src.shape[0]):
            if int8:
                dst[d] = np.int8(min(max(np.rint(src[d] / scale), np.float32(-127.0)), np.float32(127.0)))
            else:
                dst[d] = f32_to_fp8_e4m3_bits(src[d] / scale)
        return scale

    return quantize


@nb.njit(**JIT)  # serial: a few rows per sequence and step
def reshape_and_cache_quantized(key, value, key_cache, value_cache, key_scales, value_scales, slot_mapping, qmax):
    block_size = key_cache.shape[1]
    for t in range(key.shape[0]):
        slot = np.int64(slot_mapping[t])
        if slot < 0:
            continue
        b = slot // block_size
        o = slot % block_size
        for h in range(key.shape[1]):
            key_scales[b, o, h] = quantize_row(key[t, h], key_cache[b, o, h], qmax)
            value_scales[b, o, h] = quantize_row(value[t, h], value_cache[b, o, h], qmax)


def reshape_and_cache(key, value, key_cache, value_cache, slot_mapping):
    """Write new K/V rows into the paged caches.

    Args:
        key, value: float32 ``[num_tokens, num_kv_heads, head_dim]``.
        key_cache, value_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``, float32 or bf16, or
            ``QuantizedKVCache``s of that shape (each row quantized with its scale); written in place.
        slot_mapping: int64 ``[num_tokens]``; token t goes to block ``slot // block_size``, offset
            ``slot % block_size``; ``-1`` skips the token (padding).
    Raises:
        ValueError: on mismatched shapes or dtypes.
    """
    kc, ks = cache_view(key_cache)
    vc, vs = cache_view(value_cache)
    if kc.dtype != vc.dtype:
        raise ValueError(f"key_cache ({kc.dtype}) and value_cache ({vc.dtype}) must have one type")
    if key.shape != value.shape or key.shape[1:] != key_cache.shape[2:]:
        raise ValueError(f"key {key.shape} / value {value.shape} do not match cache {key_cache.shape}")
    if slot_mapping.shape[0] != key.shape[0]:
        raise ValueError(f"slot_mapping has {slot_mapping.shape[0]} entries for {key.shape[0]} tokens")
    key = np.ascontiguousarray(key, dtype=np.float32)
    value = np.ascontiguousarray(value, dtype=np.float32)
    if isinstance(key_cache, QuantizedKVCache):
        qmax = np.float32(key_cache.kind.qmax)
        reshape_and_cache_quantized(key, value, kc, vc, ks, vs, slot_mapping, qmax)
    elif kc.dtype == np.uint16:
        reshape_and_cache_bf16(key.view(np.uint32), value.view(np.uint32), kc, vc, slot_mapping)
    else:
        reshape_and_cache_f32(key, value, kc, vc, slot_mapping)


def rotary_embedding_and_cache(positions, query, key, value, key_cache, value_cache, slot_mapping, cos_sin_cache):
    """``rotary_embedding`` of query and key (both in place), then ``reshape_and_cache`` of the rotated
    key and the value: the CUDA backend's fused kernel, composed. Arguments as those two take them."""
    rotary_embedding(positions, query, key, cos_sin_cache)
    reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)


@nb.njit(**JIT)  # serial: a memory copy, too small per call for a parallel region
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
            head_dim]`` caches, modified in place (a ``QuantizedKVCache``'s scales move with its values).
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
        kcv, ks = cache_view(kc)
        vcv, vs = cache_view(vc)
        _copy_blocks_layer(kcv, vcv, block_mapping)
        if isinstance(kc, QuantizedKVCache):
            _copy_blocks_layer(ks, vs, block_mapping)
