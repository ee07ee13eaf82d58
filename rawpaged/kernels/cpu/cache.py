"""The CPU's paged KV-cache writes, in Numba (vLLM's ``csrc/cache_kernels.cu`` names):

* ``reshape_and_cache``: scatter new K/V rows into their slots of the paged caches.
* ``rotary_embedding_and_cache``: RoPE of query and key, then the cache write (the CUDA backend's fused
  kernel, composed).
* ``copy_blocks``: copy-on-write block copies for every layer in one call.

Caches are ``[num_blocks, block_size, num_kv_heads, head_dim]``, float32 or bfloat16
(``ml_dtypes.bfloat16``, written as its uint16 bit pattern, rounded to nearest even). Slot of a token:
``block * block_size + offset``.
"""

from __future__ import annotations

import numba as nb
import numpy as np

from rawpaged.dtypes import BFLOAT16
from rawpaged.kernels.backend import check_block_mapping
from rawpaged.kernels.cpu.elementwise import rotary_embedding
from rawpaged.kernels.cpu.intrinsics import f32_to_bf16_bits
from rawpaged.kernels.cpu.jit import JIT

BF16 = BFLOAT16.numpy


def cache_view(cache):
    """The array the kernels see for a cache, and whether it holds bf16 bits."""
    if cache.dtype == BF16:
        return cache.view(np.uint16), True
    if cache.dtype != np.float32:
        raise ValueError(f"KV cache dtype must be float32 or bfloat16, got {cache.dtype}")
    return cache, False


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
    kc, is_bf16 = cache_view(key_cache)
    vc, _ = cache_view(value_cache)
    if key.shape != value.shape or key.shape[1:] != key_cache.shape[2:]:
        raise ValueError(f"key {key.shape} / value {value.shape} do not match cache {key_cache.shape}")
    if slot_mapping.shape[0] != key.shape[0]:
        raise ValueError(f"slot_mapping has {slot_mapping.shape[0]} entries for {key.shape[0]} tokens")
    key = np.ascontiguousarray(key, dtype=np.float32)
    value = np.ascontiguousarray(value, dtype=np.float32)
    if is_bf16:
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
        kcv, _ = cache_view(kc)
        vcv, _ = cache_view(vc)
        _copy_blocks_layer(kcv, vcv, block_mapping)
