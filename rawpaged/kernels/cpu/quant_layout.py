"""What the CPU's quantized kernels (``quant``, ``quant_subblock``) share: the repacked layout's row
interleave and the constants that size their passes."""

from __future__ import annotations

import numpy as np

#: rows interleaved in a repacked weight: one 512-bit vector of float32
R = 16
#: fast-math without ``reassoc``: the kernels' vectors run across rows (no reductions to reassociate),
#: and reassociation would let LLVM fold the independent running sums back into one dependency chain
FASTMATH = {"nnan", "ninf", "nsz", "arcp", "contract", "afn"}
JIT = dict(cache=True, nogil=True, fastmath=FASTMATH)
#: the products' groups are split into this many chunks (or fewer), each with its own scratch, which
#: numba's prange deals out to the threads: enough to balance dozens of threads.
CHUNKS = 128
#: how far ahead of the block being computed the GEMVs prefetch (bytes; 2-8 KiB measured alike)
PREFETCH_BYTES = 4096
#: weight rows one pass of the row products dequantizes: 3 groups, 8 of ``gemm``'s 4 x 6 tiles (16 of 4 x 3)
ROWS_PER_PASS = 3 * R


def interleave(plane: np.ndarray, groups: int) -> np.ndarray:
    """``[rows, n, inner]`` -> ``[groups, n, inner, R]`` (rows padded with zeros to ``groups * R``)."""
    rows = plane.shape[0]
    p = np.pad(plane, ((0, groups * R - rows),) + ((0, 0),) * (plane.ndim - 1))
    return np.ascontiguousarray(p.reshape(groups, R, *plane.shape[1:]).transpose(0, 2, 3, 1))
