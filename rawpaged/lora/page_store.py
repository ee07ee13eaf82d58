"""An adapter's weights in pages of the KV pool: the bytes of pool blocks, and the adapter's layout in them.

A page is one block id of the pool, and its bytes are that block in every K and V tensor of the pool
(``ModelRunner.key_tensors``/``value_tensors``, a quantized cache's scales included): exactly the bytes
``kv_block_bytes`` counts for a block. An adapter is one float32 stream, its adapted linears in sorted
``(layer, module)`` order, each ``lora_A [r, in]`` then ``lora_B [out, r]`` row-major, cut into pages in
block order (the last page partly used). Host (NumPy) tensors only: LoRA runs on the CPU backend.
"""

from __future__ import annotations

import math

import numpy as np

from rawpaged.kernels.kv_cache import QuantizedKVCache


class PoolPages:
    """Byte views of the pool's blocks.

    Args:
        tensors: the pool's K and V tensors ``[num_blocks, ...]`` (arrays, or ``QuantizedKVCache``s: their
            data and scales both hold pages).

    Attributes:
        page_bytes: bytes of one block across the tensors.
    """

    def __init__(self, tensors):
        arrays = []
        for t in tensors:
            arrays += [t.data, t.scales] if isinstance(t, QuantizedKVCache) else [t]
        for a in arrays:
            if not isinstance(a, np.ndarray) or not a.flags.c_contiguous:
                raise ValueError("LoRA pages need the pool's tensors as contiguous host arrays (the CPU backend)")
        self._arrays = arrays
        self.page_bytes = sum(a[0].nbytes for a in arrays)

    def num_pages(self, num_bytes: int) -> int:
        """Pages ``num_bytes`` take: ``ceil(num_bytes / page_bytes)``."""
        return max(1, math.ceil(num_bytes / self.page_bytes))

    def _chunks(self, block_ids):
        for b in block_ids:
            for a in self._arrays:
                yield a[b].reshape(-1).view(np.uint8)

    def write(self, block_ids, data: np.ndarray) -> None:
        """Write the bytes of ``data`` (any contiguous array) into the blocks ``block_ids``, in order.
        Raises ValueError when they do not fit."""
        src = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
        if len(src) > len(block_ids) * self.page_bytes:
            raise ValueError(f"{len(src)} bytes do not fit in {len(block_ids)} pages of {self.page_bytes}")
        done = 0
        for chunk in self._chunks(block_ids):
            if done >= len(src):
                break
            n = min(len(chunk), len(src) - done)
            chunk[:n] = src[done : done + n]
            done += n

    def read(self, block_ids, num_bytes: int) -> np.ndarray:
        """A uint8 copy of the first ``num_bytes`` bytes of the blocks ``block_ids``, in order."""
        out = np.empty(num_bytes, np.uint8)
        done = 0
        for chunk in self._chunks(block_ids):
            if done >= num_bytes:
                break
            n = min(len(chunk), num_bytes - done)
            out[done : done + n] = chunk[:n]
            done += n
        return out


def pack(model) -> np.ndarray:
    """float32 ``[sum over linears of r * (in + out)]``: a ``LoRAModel``'s A and B matrices in page order."""
    parts = []
    for key in sorted(model.layers):
        w = model.layers[key]
        parts += [w.lora_a.reshape(-1), w.lora_b.reshape(-1)]
    return np.concatenate(parts).astype(np.float32, copy=False)


def unpack(flat: np.ndarray, spec) -> dict:
    """``{(layer, module): (lora_a [r, in], lora_b [out, r])}`` views of ``flat`` (``pack``'s layout) for a
    ``LoRAAdapterSpec``."""
    out, pos, r = {}, 0, spec.rank
    for key in sorted(spec.tensor_names):
        fan_in, fan_out = spec.module_shapes[key[1]]
        a = flat[pos : pos + r * fan_in].reshape(r, fan_in)
        pos += r * fan_in
        b = flat[pos : pos + fan_out * r].reshape(fan_out, r)
        pos += fan_out * r
        out[key] = (a, b)
    return out
