"""How a layer's KV cache is held: a float array ``[num_blocks, block_size, num_kv_heads, head_dim]``, or
for a quantized ``kv_cache_dtype`` (``rawpaged.dtypes.QUANTIZED_KV_TYPES``) a :class:`QuantizedKVCache`:
the 8-bit values in that shape and one float32 scale per (block, slot, KV head) beside them. A block id
indexes both, so block copies (copy-on-write) and block moves take a block's scales with its values."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from rawpaged.dtypes import QuantizedKVType, kv_cache_type


@dataclass(frozen=True)
class QuantizedKVCache:
    """One layer's K (or V) cache in a quantized type.

    Attributes:
        data: ``[num_blocks, block_size, num_kv_heads, head_dim]`` of ``kind.storage`` (int8 values, or
            fp8 E4M3 bits as uint8).
        scales: float32 ``[num_blocks, block_size, num_kv_heads]``; slot ``(b, o)``'s row of KV head ``h``
            is ``value(data[b, o, h]) * scales[b, o, h]``.
        kind: the quantized type.
    """

    data: Any
    scales: Any
    kind: QuantizedKVType

    @property
    def shape(self) -> tuple:
        return tuple(self.data.shape)

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes + self.scales.nbytes)


def allocate_kv_cache(zeros: Callable, shape: tuple, kv_cache_dtype: str):
    """A zero-filled cache of ``shape`` ``[num_blocks, block_size, num_kv_heads, head_dim]`` for
    ``kv_cache_dtype``, made with the backend's ``zeros(shape, numpy_dtype)``: a float array, or a
    :class:`QuantizedKVCache`. Raises ValueError for an unknown type name."""
    t = kv_cache_type(kv_cache_dtype)
    if isinstance(t, QuantizedKVType):
        return QuantizedKVCache(zeros(shape, t.storage), zeros(shape[:3], np.float32), t)
    return zeros(shape, t.numpy)
