"""The CPU's quantized weights: GGUF block-quantized tensors (``rawpaged.kernels.quantization``) repacked
into the layout ``quant``'s products read, and weights whose parts differ in format.

Layout. On load the CPU backend repacks a ``QuantizedTensor`` into a ``RepackedQuantized``: ``R`` = 16
rows interleaved (llama.cpp's CPU backend repacks its Q4_0 the same way, ``block_q4_0x8``). For group g
of 16 rows and block b, the quant bytes of position j of all 16 rows are adjacent (``qs[g, b, j, :]``),
and so are their fp16 scales (``scales[g, b, :]``) and Q4_1 minimums. Nothing is expanded: the bytes are
the GGUF ones in another order (rows padded to a multiple of 16 with zero blocks). The sub-block formats
hold ``quant_subblock.repack_subblock``'s planes.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from rawpaged.kernels.cpu import quant_subblock as sb
from rawpaged.kernels.cpu.quant_layout import R, interleave
from rawpaged.kernels.quantization import (
    QK,
    SUBBLOCK,
    QuantizedTensor,
    SubBlockPlanes,
    _pack_values,
    runs_of_one_format,
    subblock_planes,
)


@dataclass(frozen=True)
class RepackedQuantized:
    """A ``[rows, cols]`` GGUF block-quantized weight with ``R`` rows interleaved (module docstring).

    ``qs`` uint8 ``[groups, cols / 32, L, R]`` (L = 32 bytes per block for Q8_0, whose bytes are int8;
    16 nibble bytes for Q4_0/Q4_1: byte j holds position j in its low and 16 + j in its high nibble);
    ``scales`` and ``mins`` (Q4_1 only) the fp16 bit patterns, uint16 ``[groups, cols / 32, R]``.
    The sub-block formats (Q5_0, Q5_1, Q4_K, Q5_K, Q6_K) hold ``quant_subblock.repack_subblock``'s planes,
    with ``qh`` and ``sub`` besides.
    """

    qtype: str
    shape: tuple
    qs: np.ndarray
    scales: np.ndarray
    mins: np.ndarray | None = None
    qh: np.ndarray | None = None
    sub: np.ndarray | None = None

    @classmethod
    def from_quantized(cls, q: QuantizedTensor) -> RepackedQuantized:
        """Repack a ``QuantizedTensor`` (rows padded with zero blocks to a multiple of ``R``)."""
        if q.qtype in SUBBLOCK:
            p = sb.repack_subblock(subblock_planes(q))
            return cls(q.qtype, tuple(q.shape), p["qs"], p["scales"], p["mins"], p["qh"], p["sub"])
        rows, cols = q.shape
        nblk = cols // QK
        groups = -(-rows // R)

        def by_block(plane, inner):  # [rows, nblk * inner] -> [groups, nblk, inner, R]
            return interleave(plane.reshape(rows, nblk, inner), groups)

        qs = by_block(q.qs, q.qs.shape[1] // nblk)
        scales = by_block(q.scales, 1)[:, :, 0, :].copy()
        mins = by_block(q.mins, 1)[:, :, 0, :].copy() if q.mins is not None else None
        return cls(q.qtype, (rows, cols), qs, scales, mins)

    @property
    def nbytes(self) -> int:
        planes = (self.qs, self.scales, self.mins, self.qh, self.sub)
        return sum(p.nbytes for p in planes if p is not None)

    def to_quantized(self) -> QuantizedTensor:
        """The GGUF row-major planes back (padding dropped). Raises ValueError for a sub-block format
        (its planes are regrouped bits, see ``to_planes``)."""
        if self.qtype in SUBBLOCK:
            raise ValueError(f"a repacked {self.qtype} weight gives its planes back (to_planes), not GGUF blocks")
        rows, cols = self.shape

        def rowmajor(p):  # [groups, nblk, inner, R] -> [rows, nblk * inner]
            groups, nblk, inner, _ = p.shape
            return np.ascontiguousarray(p.transpose(0, 3, 1, 2).reshape(groups * R, nblk * inner)[:rows])

        qs = rowmajor(self.qs)
        scales = rowmajor(self.scales[:, :, None, :])
        mins = rowmajor(self.mins[:, :, None, :]) if self.mins is not None else None
        return QuantizedTensor(self.qtype, self.shape, qs, scales, mins)

    def to_planes(self) -> SubBlockPlanes:
        """A sub-block format's ``SubBlockPlanes`` back (padding dropped)."""
        rows = self.shape[0]

        def rowmajor(p):  # [groups, n, inner, R] -> [rows, n, inner]
            return np.ascontiguousarray(p.transpose(0, 3, 1, 2).reshape(p.shape[0] * R, *p.shape[1:3])[:rows])

        mins = rowmajor(self.mins[:, :, None, :])[:, :, 0] if self.mins.shape[1] else None
        sub = rowmajor(self.sub) if self.sub.shape[1] else None
        scales = rowmajor(self.scales[:, :, None, :])[:, :, 0]
        values = sb.unpack_values(self.qs, self.qh, rows)
        return _pack_values(self.qtype, self.shape, values, scales, mins, sub)

    def dequantize(self) -> np.ndarray:
        """float32 ``[rows, cols]``, as ``QuantizedTensor.dequantize`` computes it."""
        if self.qtype in SUBBLOCK:
            return self.to_planes().dequantize()
        return self.to_quantized().dequantize()


@dataclass(frozen=True)
class StackedQuantized:
    """Quantized weights of different formats stacked along their rows (``[sum rows_i, cols]``): a fused
    projection whose parts differ in format, as K-quant mixes give (Q4_K_M files keep ``attn_v`` and some
    ``ffn_down`` in Q6_K, Q8_0 or Q5_0 beside Q4_K). Each part is a ``RepackedQuantized``; a product
    computes part by part into its columns of the output."""

    parts: tuple
    shape: tuple

    @classmethod
    def from_parts(cls, parts: list) -> StackedQuantized:
        """Adjacent parts of one format are concatenated first (one product each)."""
        packed = tuple(repack(QuantizedTensor.concat(run)) for run in runs_of_one_format(parts))
        return cls(packed, (sum(p.shape[0] for p in packed), parts[0].shape[1]))

    @property
    def qtype(self) -> str:
        return "+".join(p.qtype for p in self.parts)

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    def dequantize(self) -> np.ndarray:
        return np.concatenate([p.dequantize() for p in self.parts])


def repack(q: QuantizedTensor | RepackedQuantized) -> RepackedQuantized:
    """``q`` in the CPU kernels' layout (a ``RepackedQuantized`` is returned as it is)."""
    return q if isinstance(q, RepackedQuantized) else RepackedQuantized.from_quantized(q)


_NO_U8 = np.zeros((0, 0, 0, R), np.uint8)


def kernel_planes(w: RepackedQuantized):
    """``(qs, qh, scales, mins, sub)``: every format's planes with one type each (absent ones empty or
    standing in; the kernels never read them)."""
    mins = w.mins if w.mins is not None else w.scales  # unread for Q8_0/Q4_0 (and Q5_0, Q6_K's empty plane)
    qh = w.qh if w.qh is not None else _NO_U8
    sub = w.sub if w.sub is not None else _NO_U8
    return w.qs, qh, w.scales, mins, sub
