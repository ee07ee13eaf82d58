"""Random GGUF blocks of the sub-block formats, for tests and benchmarks: the ``gguf`` package dequantizes
the K-quants but cannot quantize them, so weights in those formats are written as raw block bytes."""

from __future__ import annotations

import numpy as np

from rawpaged.kernels.quantization import SUBBLOCK

#: (byte offset of each fp16 field in a block, its magnitude): the values come out within about +-scale
_F16_FIELDS = {
    "Q5_0": ((0, 1 / 16),),
    "Q5_1": ((0, 1 / 16), (2, -1.0)),
    "Q4_K": ((0, 1 / 240), (2, 1 / 32)),
    "Q5_K": ((0, 1 / 480), (2, 1 / 32)),
    "Q6_K": ((208, 1 / 2048),),
}


def random_blocks(qtype: str, rows: int, cols: int, rng: np.random.Generator, scale: float = 1.0) -> np.ndarray:
    """GGUF bytes uint8 ``[rows, cols / block values * block bytes]`` of a ``qtype`` weight: random quants,
    scales and minimums, with finite fp16 fields whose values land within about ``+-scale``.

    Raises ValueError for a format outside ``SUBBLOCK`` or ``cols`` not a multiple of its block."""
    if qtype not in SUBBLOCK:
        raise ValueError(f"random_blocks writes {tuple(SUBBLOCK)}, not {qtype!r}")
    per, size = SUBBLOCK[qtype]
    if cols % per:
        raise ValueError(f"{qtype}: cols {cols} is not a multiple of {per}")
    nblk = cols // per
    data = rng.integers(0, 256, (rows, nblk, size), dtype=np.uint8)
    for offset, magnitude in _F16_FIELDS[qtype]:
        f = (scale * magnitude * rng.uniform(0.5, 1.0, (rows, nblk))).astype(np.float16)
        data[:, :, offset : offset + 2] = f.view(np.uint8).reshape(rows, nblk, 2)
    return data.reshape(rows, nblk * size)


def weight_bytes(model) -> tuple:
    """(bytes of every weight a model holds, shapes of its float32 2-D arrays): what a check that no
    float32 copy of a quantized weight is made counts (a tied embedding and LM head once)."""
    seen, total, dense = set(), 0, []

    def visit(x):
        nonlocal total
        if x is None or id(x) in seen:
            return
        seen.add(id(x))
        if isinstance(x, np.ndarray):
            total += x.nbytes
            if x.ndim == 2 and x.dtype == np.float32:
                dense.append(x.shape)
        elif hasattr(x, "parts"):
            for p in x.parts:
                visit(p)
        elif hasattr(x, "qtype"):
            total += x.nbytes

    for layer in model.layers:
        for v in layer.values():
            visit(v)
    for name in ("embed_tokens", "lm_head", "norm"):
        visit(getattr(model, name, None))
    return total, dense
