"""Block-quantized weights in llama.cpp's GGUF formats, kept in their blocks on the backend.

GGUF stores a 2-D weight ``[rows, cols]`` row by row as blocks of 32 values (ggml's ``block_q8_0``,
``block_q4_0``, ``block_q4_1``, ggml-common.h):

- ``Q8_0`` (34 bytes): fp16 scale d, 32 int8 q; value = d * q.
- ``Q4_0`` (18 bytes): fp16 d, 16 bytes of nibbles; value j (j < 16) = d * ((qs[j] & 15) - 8), value
  16 + j = d * ((qs[j] >> 4) - 8).
- ``Q4_1`` (20 bytes): fp16 d, fp16 min m, 16 bytes of nibbles; value = d * nibble + m.

A ``QuantizedTensor`` holds the same bytes repacked into planes, so kernels read each kind of byte
contiguously: ``qs`` (uint8 ``[rows, cols]`` for Q8_0, ``[rows, cols / 2]`` nibble bytes for the 4-bit
formats, in block order), ``scales`` and ``mins`` (the fp16 bit patterns, uint16 ``[rows, cols / 32]``;
``mins`` only for Q4_1). Nothing is expanded: the planes are exactly the GGUF bytes (``blocks()`` puts
them back). Dequantizing all three and quantizing to Q8_0 are computed here (the GGUF format's
definitions, ggml-quants.c; tests check them bit for bit against the ``gguf`` package's reference
``gguf.quants``), so neither needs that package; the kernels that compute on the planes are
``rawpaged.kernels.cpu.quant``.

The 5-bit formats and the K-quants (``SUBBLOCK``) are held as their GGUF bytes (``qs`` uint8
``[rows, bytes per row]``, no other plane) and described here as 32-value sub-blocks by
``SubBlockPlanes`` (``subblock_planes``), the form their kernels compute on:

- ``Q5_0`` (22 bytes / 32 values): fp16 d, 32 high bits qh (little-endian uint32, bit j for value j),
  16 nibble bytes as Q4_0; value = d * (q5 - 16).
- ``Q5_1`` (24 bytes / 32): fp16 d, fp16 m, qh, nibbles; value = d * q5 + m.
- ``Q4_K`` (144 bytes / 256, ggml's ``block_q4_K``): fp16 d and dmin, 12 bytes packing eight 6-bit
  scales and mins (``get_scale_min_k4``), 128 nibble bytes: sub-block s of 32 values is byte
  ``32 * (s // 2) + l``'s low (s even) or high (s odd) nibble; value = d * sc_s * q4 - dmin * m_s.
- ``Q5_K`` (176 / 256): as Q4_K with 32 bytes qh between scales and nibbles: value l of sub-block s has
  its fifth bit at bit s of ``qh[l]``.
- ``Q6_K`` (210 / 256, ``block_q6_K``): 128 bytes of low nibbles ql, 64 bytes of 2-bit highs qh, 16 int8
  scales (one per 16 values), fp16 d last; value = d * sc * (q6 - 32) (``dequantize_row_q6_K``).

A mixture of experts' stacked weights (GGUF's 3-D ``ffn_*_exps``) are a ``QuantizedExperts``: the same
planes with a leading expert axis, each expert a 2-D ``QuantizedTensor`` view; ``concat_rows`` fuses two
stacks expert by expert (gate and up).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from rawpaged.errors import import_optional

QK = 32  # values per block in the 32-value formats, and per sub-block in the K-quants
QK_K = 256  # values per K-quant super-block
#: name -> (bytes per block, bytes of fp16 header: d, or d and m): the formats held as planes
FORMATS = {"Q4_0": (18, 2), "Q4_1": (20, 4), "Q8_0": (34, 2)}
#: name -> (values per block, bytes per block): the formats held as GGUF bytes, computed on as sub-blocks
SUBBLOCK = {"Q5_0": (32, 22), "Q5_1": (32, 24), "Q4_K": (256, 144), "Q5_K": (256, 176), "Q6_K": (256, 210)}
#: every format the kernels compute on without a float32 copy
NATIVE = tuple(FORMATS) + tuple(SUBBLOCK)
#: bits per value of the sub-block formats
SUBBLOCK_BITS = {"Q5_0": 5, "Q5_1": 5, "Q4_K": 4, "Q5_K": 5, "Q6_K": 6}
#: the code each backend's kernels know a format by (CPU ``quant``, CUDA ``cuda/quant.cu``'s FMT)
FORMAT_CODES = {"Q8_0": 0, "Q4_0": 1, "Q4_1": 2, "Q5_0": 3, "Q5_1": 4, "Q4_K": 5, "Q5_K": 6, "Q6_K": 7}


@dataclass(frozen=True)
class QuantizedTensor:
    """A ``[rows, cols]`` weight in a GGUF block format, as planes (see the module docstring)."""

    qtype: str
    shape: tuple
    qs: np.ndarray
    scales: np.ndarray
    mins: np.ndarray | None = None

    @classmethod
    def from_blocks(cls, qtype: str, shape: tuple, data: np.ndarray) -> QuantizedTensor:
        """From GGUF bytes uint8 ``[rows, cols / 32 * block bytes]`` (e.g. a ``gguf`` reader's tensor).

        Raises ValueError for an unknown format, a width not a multiple of 32, or a ``data`` shape that
        does not match ``shape``."""
        if qtype in SUBBLOCK:
            return cls._from_subblock_bytes(qtype, shape, data)
        if qtype not in FORMATS:
            raise ValueError(f"quantization type {qtype!r} is not a native format {NATIVE}")
        rows, cols = (int(s) for s in shape)
        if cols % QK:
            raise ValueError(f"{qtype} weight of {cols} columns: not a multiple of {QK}")
        size, head = FORMATS[qtype]
        nblk = cols // QK
        data = np.asarray(data)
        if data.dtype != np.uint8 or data.shape != (rows, nblk * size):
            raise ValueError(f"{qtype} data {data.shape} {data.dtype}: expected uint8 {(rows, nblk * size)}")
        blocks = data.reshape(rows, nblk, size)
        scales = np.ascontiguousarray(blocks[:, :, 0:2]).view(np.uint16).reshape(rows, nblk)
        mins = np.ascontiguousarray(blocks[:, :, 2:4]).view(np.uint16).reshape(rows, nblk) if head == 4 else None
        qs = np.ascontiguousarray(blocks[:, :, head:]).reshape(rows, -1)
        return cls(qtype, (rows, cols), qs, scales, mins)

    @classmethod
    def _from_subblock_bytes(cls, qtype: str, shape: tuple, data: np.ndarray) -> QuantizedTensor:
        rows, cols = (int(s) for s in shape)
        per, size = SUBBLOCK[qtype]
        if cols % per:
            raise ValueError(f"{qtype} weight of {cols} columns: not a multiple of {per}")
        data = np.asarray(data)
        if data.dtype != np.uint8 or data.shape != (rows, cols // per * size):
            raise ValueError(f"{qtype} data {data.shape} {data.dtype}: expected uint8 {(rows, cols // per * size)}")
        return cls(qtype, (rows, cols), np.ascontiguousarray(data), None)

    def blocks(self) -> np.ndarray:
        """The GGUF bytes, uint8 ``[rows, cols / block values * block bytes]``."""
        if self.qtype in SUBBLOCK:
            return self.qs
        rows, cols = self.shape
        nblk = cols // QK
        parts = [self.scales.reshape(rows, nblk, 1).view(np.uint8)]
        if self.mins is not None:
            parts.append(self.mins.reshape(rows, nblk, 1).view(np.uint8))
        parts.append(self.qs.reshape(rows, nblk, -1))
        return np.concatenate(parts, axis=2).reshape(rows, -1)

    @property
    def nbytes(self) -> int:
        planes = (self.qs, self.scales, self.mins)
        return sum(p.nbytes for p in planes if p is not None)

    def dequantize(self) -> np.ndarray:
        """float32 ``[rows, cols]``: each value ``d * q`` (Q8_0), ``d * (nibble - 8)`` (Q4_0) or
        ``d * nibble + m`` (Q4_1), computed in float32 from the fp16 ``d`` and ``m`` as ggml's
        ``dequantize_row_*`` and the ``gguf`` package compute them (tests check bit equality); the
        sub-block formats through ``SubBlockPlanes.dequantize``."""
        if self.qtype in SUBBLOCK:
            return subblock_planes(self).dequantize()
        rows, cols = self.shape
        nblk = cols // QK
        d = self.scales.view(np.float16).astype(np.float32).reshape(rows, nblk, 1)
        if self.qtype == "Q8_0":
            values = self.qs.view(np.int8).reshape(rows, nblk, QK).astype(np.float32) * d
        else:
            nibbles = self.qs.reshape(rows, nblk, QK // 2)
            q = np.concatenate([nibbles & 15, nibbles >> 4], axis=2)  # value j low nibble, 16 + j high
            if self.qtype == "Q4_0":
                values = d * (q.astype(np.int8) - np.int8(8)).astype(np.float32)
            else:
                values = d * q.astype(np.float32) + self.mins.view(np.float16).astype(np.float32).reshape(rows, nblk, 1)
        return values.reshape(rows, cols)

    @classmethod
    def quantize(cls, weight: np.ndarray, qtype: str = "Q8_0") -> QuantizedTensor:
        """Quantize a float ``[rows, cols]`` weight (cols a multiple of 32) into ``qtype`` blocks.

        Q8_0 is computed here, as ggml's ``quantize_row_q8_0_ref``: per block ``d = max|x| / 127`` in
        float32, ``q = roundf(x / d)`` (half away from zero; 0 where ``d`` is 0), ``d`` stored as fp16.
        The 4-bit formats go through the ``gguf`` package's reference quantizer (tests and tools only).

        Raises:
            ValueError for a width not a multiple of 32; MissingDependencyError for Q4_0/Q4_1 without
            the ``gguf`` package.
        """
        w = np.ascontiguousarray(weight, dtype=np.float32)
        if w.ndim != 2 or w.shape[1] % QK:
            raise ValueError(f"quantize takes a [rows, cols] weight with cols a multiple of {QK}, got {w.shape}")
        if qtype == "Q8_0":
            return cls.from_blocks(qtype, w.shape, _quantize_q8_0(w))
        gguf = import_optional("gguf", f"quantizing to {qtype}")
        data = gguf.quants.quantize(w, gguf.GGMLQuantizationType[qtype])
        return cls.from_blocks(qtype, w.shape, data.reshape(w.shape[0], -1))

    @staticmethod
    def concat(parts: list) -> QuantizedTensor:
        """Row-wise concatenation of same-format, same-width parts (fused q/k/v, gate/up).

        Raises ValueError for parts of different formats or widths."""
        first = parts[0]
        if any(p.qtype != first.qtype or p.shape[1] != first.shape[1] for p in parts):
            raise ValueError("fused quantized parts must share format and width")
        if len(parts) == 1:
            return first
        rows = sum(p.shape[0] for p in parts)
        if first.qtype in SUBBLOCK:
            return QuantizedTensor(first.qtype, (rows, first.shape[1]), np.concatenate([p.qs for p in parts]), None)
        mins = np.concatenate([p.mins for p in parts]) if first.mins is not None else None
        return QuantizedTensor(
            first.qtype,
            (rows, first.shape[1]),
            np.concatenate([p.qs for p in parts]),
            np.concatenate([p.scales for p in parts]),
            mins,
        )


@dataclass(frozen=True)
class QuantizedExperts:
    """A stack of E ``[rows, cols]`` weights of one native format: a mixture of experts' gate, up or down
    projections, GGUF's 3-D ``ffn_*_exps`` tensors (ggml ne ``[cols, rows, E]``, so numpy's
    ``[E, rows, cols]``). The planes are ``QuantizedTensor``'s with a leading expert axis: ``qs`` uint8
    ``[E, rows, n]`` (the 32-value formats' quants, or the sub-block formats' GGUF bytes), ``scales``
    and ``mins`` uint16 ``[E, rows, cols / 32]`` (None where the format has none), so each expert's bytes
    are contiguous. ``expert(e)`` is expert e's 2-D ``QuantizedTensor`` (views, no copy). Nothing is
    dequantized to build, slice or concatenate a stack."""

    qtype: str
    shape: tuple
    qs: np.ndarray
    scales: np.ndarray | None = None
    mins: np.ndarray | None = None

    @classmethod
    def from_blocks(cls, qtype: str, shape: tuple, data: np.ndarray) -> QuantizedExperts:
        """From GGUF bytes uint8 ``[E, rows, bytes per row]`` (a ``gguf`` reader's 3-D tensor) of a stack of
        ``shape == (E, rows, cols)``.

        Raises ValueError for a format outside ``NATIVE``, a width not a multiple of its block, or data
        of another shape or dtype."""
        num, rows, cols = (int(s) for s in shape)
        data = np.asarray(data)
        if data.dtype != np.uint8 or data.ndim != 3 or data.shape[:2] != (num, rows):
            raise ValueError(f"{qtype} experts data {data.shape} {data.dtype}: expected uint8 [{num}, {rows}, ...]")
        return cls._of(QuantizedTensor.from_blocks(qtype, (num * rows, cols), data.reshape(num * rows, -1)), num)

    @classmethod
    def _of(cls, flat: QuantizedTensor, num: int) -> QuantizedExperts:
        """The stack whose experts are ``num`` equal runs of ``flat``'s rows."""
        rows, cols = flat.shape[0] // num, flat.shape[1]

        def split(plane):
            return None if plane is None else plane.reshape(num, rows, plane.shape[1])

        return cls(flat.qtype, (num, rows, cols), split(flat.qs), split(flat.scales), split(flat.mins))

    @classmethod
    def stack(cls, experts: list) -> QuantizedExperts:
        """The stack of same-format, same-shape 2-D ``QuantizedTensor``s (their bytes copied once).

        Raises ValueError for experts of different formats or shapes."""
        first = experts[0]
        if any(q.qtype != first.qtype or tuple(q.shape) != tuple(first.shape) for q in experts):
            raise ValueError("stacked experts must share format and shape")
        return cls._of(QuantizedTensor.concat(list(experts)) if len(experts) > 1 else first, len(experts))

    @property
    def format(self) -> str:
        """The GGUF format name (one of ``NATIVE``)."""
        return self.qtype

    @property
    def num_experts(self) -> int:
        return self.shape[0]

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in (self.qs, self.scales, self.mins) if p is not None)

    def expert(self, e: int) -> QuantizedTensor:
        """Expert e's ``[rows, cols]`` weight, views of the stack's planes. Raises IndexError for e
        outside ``0 .. E - 1``."""
        if not 0 <= e < self.shape[0]:
            raise IndexError(f"expert {e} of a stack of {self.shape[0]}")
        return QuantizedTensor(
            self.qtype,
            self.shape[1:],
            self.qs[e],
            None if self.scales is None else self.scales[e],
            None if self.mins is None else self.mins[e],
        )

    def blocks(self) -> np.ndarray:
        """The GGUF bytes, uint8 ``[E, rows, bytes per row]`` (what ``from_blocks`` takes)."""
        num, rows, _ = self.shape
        return self.flat().blocks().reshape(num, rows, -1)

    def dequantize(self) -> np.ndarray:
        """float32 ``[E, rows, cols]`` (tests and reference paths only: kernels compute on the blocks)."""
        return self.flat().dequantize().reshape(self.shape)

    def flat(self) -> QuantizedTensor:
        """The stack as one ``[E * rows, cols]`` ``QuantizedTensor`` (views): expert e is rows
        ``e * rows .. (e + 1) * rows``."""
        num, rows, cols = self.shape

        def flat(plane):
            return None if plane is None else plane.reshape(num * rows, plane.shape[2])

        return QuantizedTensor(self.qtype, (num * rows, cols), flat(self.qs), flat(self.scales), flat(self.mins))


def concat_rows(stacks: list) -> QuantizedExperts:
    """Expert by expert, the rows of ``stacks`` one after another (gate then up, for a fused product):
    ``[E, sum rows_i, cols]``, the bytes copied once, never dequantized.

    Raises ValueError for stacks of different formats, expert counts or widths."""
    first = stacks[0]
    if any(s.qtype != first.qtype or s.shape[0] != first.shape[0] or s.shape[2] != first.shape[2] for s in stacks):
        raise ValueError("concatenated expert stacks must share format, expert count and width")
    if len(stacks) == 1:
        return first

    def cat(name):
        planes = [getattr(s, name) for s in stacks]
        return None if planes[0] is None else np.concatenate(planes, axis=1)

    num, _, cols = first.shape
    rows = sum(s.shape[1] for s in stacks)
    return QuantizedExperts(first.qtype, (num, rows, cols), cat("qs"), cat("scales"), cat("mins"))


class StackedExpertParts:
    """What a backend's experts of fused parts in different formats (gate in one, up in another) say of
    themselves: each part an expert stack ``[E, rows_i, cols]`` with ``qtype`` and ``nbytes``, its rows
    the next columns of the product. A dataclass with a ``parts`` tuple subclasses it."""

    parts: tuple

    @property
    def shape(self) -> tuple:
        first = self.parts[0].shape
        return (first[0], sum(p.shape[1] for p in self.parts), first[2])

    @property
    def qtype(self) -> str:
        return "+".join(p.qtype for p in self.parts)

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)


def runs_of_one_format(parts: list) -> list:
    """``parts`` (anything with a ``qtype``) as lists of adjacent parts of one format, in order: what a
    fused projection of mixed formats concatenates before repacking (Q4_K query and key rows together,
    a Q6_K value beside them)."""
    runs: list = []
    for p in parts:
        if runs and runs[-1][-1].qtype == p.qtype:
            runs[-1].append(p)
        else:
            runs.append([p])
    return runs


def _quantize_q8_0(w: np.ndarray) -> np.ndarray:
    """GGUF Q8_0 bytes uint8 ``[rows, cols / 32 * 34]`` of float32 ``w [rows, cols]``."""
    rows, cols = w.shape
    blocks = w.reshape(rows, cols // QK, QK)
    d = np.abs(blocks).max(axis=2, keepdims=True) / np.float32(127)
    inv = np.divide(np.float32(1), d, out=np.zeros_like(d), where=d != 0)
    x = blocks * inv
    a = np.abs(x)
    whole = np.floor(a)
    q = np.sign(x) * (whole + (a - whole >= 0.5))  # roundf: the fraction a - floor(a) is exact
    out = np.empty((rows, cols // QK, 2 + QK), dtype=np.uint8)
    out[:, :, :2] = d.astype(np.float16).view(np.uint8)
    out[:, :, 2:] = q.astype(np.int8).view(np.uint8)
    return out.reshape(rows, -1)


@dataclass(frozen=True)
class SubBlockPlanes:
    """A ``SUBBLOCK``-format ``[rows, cols]`` weight as 32-value sub-blocks (``nsub = cols / 32``), its
    bits regrouped so one kernel reads every format alike (a permutation of the GGUF bits; nothing is
    rounded):

    - ``qs`` uint8 ``[rows, nsub, 16]``: the low 4 bits of the values, byte j holding value j in its low
      nibble and value 16 + j in its high one (Q4_0's order);
    - ``qh`` uint8 ``[rows, nsub, hb]``: the high bits; hb = 0 (Q4_K), 4 (5-bit: bit ``v % 8`` of byte
      ``v // 8`` is value v's fifth bit), 8 (Q6_K: bits ``2 (v % 4)`` of byte ``v // 4`` are its two
      high bits);
    - ``scales`` uint16 ``[rows, nscale]``: fp16 d per sub-block (Q5_0, Q5_1) or per super-block (K);
    - ``mins`` uint16 like ``scales``: Q5_1's m, Q4_K/Q5_K's dmin (None for Q5_0, Q6_K);
    - ``sub`` uint8 ``[rows, nsub, 2]``: Q4_K/Q5_K's 6-bit (scale, min) of each sub-block, Q6_K's two
      int8 scales (values 0-15, 16-31); None for Q5_0/Q5_1.

    Sub-block s's values are ``a_h * q - b_h`` for its halves h: Q5_0 ``d (q - 16)``, Q5_1 ``d q + m``,
    Q4_K/Q5_K ``(d sc) q - dmin m``, Q6_K ``(d sc_h) (q - 32)``.
    """

    qtype: str
    shape: tuple
    qs: np.ndarray
    qh: np.ndarray
    scales: np.ndarray
    mins: np.ndarray | None
    sub: np.ndarray | None

    def values(self) -> np.ndarray:
        """The unsigned quants, uint8 ``[rows, nsub, 32]``."""
        lo = np.concatenate([self.qs & 15, self.qs >> 4], axis=2)
        hb = self.qh.shape[2]
        if hb == 0:
            return lo
        v = np.arange(QK)
        if hb == 4:
            high = (self.qh[:, :, v // 8] >> (v % 8).astype(np.uint8)) & 1
        else:
            high = (self.qh[:, :, v // 4] >> (2 * (v % 4)).astype(np.uint8)) & 3
        return lo | (high << 4).astype(np.uint8)

    def dequantize(self) -> np.ndarray:
        """float32 ``[rows, cols]``, computed in the order ggml's ``dequantize_row_*`` and the ``gguf``
        package use (tests check bit equality with ``gguf.quants.dequantize``)."""
        rows, cols = self.shape
        nsub = cols // QK
        q = self.values().astype(np.float32)
        d = self.scales.view(np.float16).astype(np.float32)
        if self.qtype in ("Q5_0", "Q5_1"):
            d = d.reshape(rows, nsub, 1)
            if self.qtype == "Q5_0":
                out = d * (self.values().astype(np.int8) - np.int8(16)).astype(np.float32)
            else:
                out = d * q + self.mins.view(np.float16).astype(np.float32).reshape(rows, nsub, 1)
            return out.reshape(rows, cols)
        d = np.repeat(d, QK_K // QK, axis=1).reshape(rows, nsub, 1)
        if self.qtype == "Q6_K":
            sc = self.sub.view(np.int8).astype(np.float32)  # [rows, nsub, 2]
            scale = np.repeat(d * sc, QK // 2, axis=2)  # [rows, nsub, 32]
            return (scale * (self.values().astype(np.int8) - np.int8(32)).astype(np.float32)).reshape(rows, cols)
        dmin = np.repeat(self.mins.view(np.float16).astype(np.float32), QK_K // QK, axis=1).reshape(rows, nsub, 1)
        sc = self.sub[:, :, 0:1].astype(np.float32)
        m = self.sub[:, :, 1:2].astype(np.float32)
        return ((d * sc) * q - dmin * m).reshape(rows, cols)


def subblock_planes(q: QuantizedTensor) -> SubBlockPlanes:
    """The ``SubBlockPlanes`` of a ``SUBBLOCK``-format tensor (GGUF bytes -> regrouped bits).

    Raises ValueError for another format."""
    if q.qtype not in SUBBLOCK:
        raise ValueError(f"{q.qtype} is not a sub-block format {tuple(SUBBLOCK)}")
    rows, cols = q.shape
    per, size = SUBBLOCK[q.qtype]
    nblk = cols // per
    blocks = q.qs.reshape(rows, nblk, size)
    nsub = cols // QK

    def u16(a):
        return np.ascontiguousarray(a).view(np.uint16).reshape(rows, nblk)

    if q.qtype in ("Q5_0", "Q5_1"):
        head = 2 if q.qtype == "Q5_0" else 4
        scales = u16(blocks[:, :, 0:2])
        mins = u16(blocks[:, :, 2:4]) if head == 4 else None
        qh = np.ascontiguousarray(blocks[:, :, head : head + 4])
        qs = np.ascontiguousarray(blocks[:, :, head + 4 :])
        return SubBlockPlanes(q.qtype, q.shape, qs, qh, scales, mins, None)
    if q.qtype in ("Q4_K", "Q5_K"):
        scales, mins = u16(blocks[:, :, 0:2]), u16(blocks[:, :, 2:4])
        packed = blocks[:, :, 4:16]
        a, b, c = packed[:, :, 0:4], packed[:, :, 4:8], packed[:, :, 8:12]
        sc = np.concatenate([a & 63, (c & 15) | ((a >> 6) << 4)], axis=2)  # get_scale_min_k4
        mn = np.concatenate([b & 63, (c >> 4) | ((b >> 6) << 4)], axis=2)
        sub = np.stack([sc, mn], axis=3).reshape(rows, nsub, 2)
        start = 16 if q.qtype == "Q4_K" else 48
        nib = blocks[:, :, start:].reshape(rows, nblk, 4, 1, 32)
        v = np.concatenate([nib & 15, nib >> 4], axis=3).reshape(rows, nblk, 8, 32)  # sub-block s = 2 c + h
        if q.qtype == "Q5_K":
            qh5 = blocks[:, :, 16:48].reshape(rows, nblk, 1, 32)
            v = v | (((qh5 >> np.arange(8, dtype=np.uint8).reshape(1, 1, 8, 1)) & 1) << 4)
        v = v.reshape(rows, nsub, QK)
    else:  # Q6_K: ql[128], qh[64], scales[16], d
        scales = u16(blocks[:, :, 208:210])
        mins = None
        sub = np.ascontiguousarray(blocks[:, :, 192:208]).reshape(rows, nsub, 2)
        ql = blocks[:, :, 0:128].reshape(rows, nblk, 2, 2, 32)  # [half n, l / 32 (ql[l] or ql[l + 32])]
        lo = np.stack([ql & 15, ql >> 4], axis=3)  # [rows, nblk, n, nibble, 2, 32]: value 64 nibble + 32 i + l
        qh = blocks[:, :, 128:192].reshape(rows, nblk, 2, 1, 32)
        hi = (qh >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 1, 4, 1)) & 3  # shift 2k: value 32 k + l
        v = lo.reshape(rows, nblk, 2, 4, 32) | (hi << 4)
        v = v.reshape(rows, nsub, QK)
    return _pack_values(q.qtype, q.shape, v, scales, mins, sub)


def _pack_values(qtype, shape, v, scales, mins, sub) -> SubBlockPlanes:
    """SubBlockPlanes from unsigned quants ``v`` uint8 ``[rows, nsub, 32]``."""
    rows, nsub, _ = v.shape
    qs = (v[:, :, :16] & 15) | ((v[:, :, 16:] & 15) << 4)
    bits = SUBBLOCK_BITS[qtype]
    if bits == 4:
        qh = np.zeros((rows, nsub, 0), np.uint8)
    elif bits == 5:
        qh = np.packbits((v >> 4) & 1, axis=2, bitorder="little")
    else:
        h = ((v >> 4) & 3).reshape(rows, nsub, 8, 4)
        qh = h[..., 0] | (h[..., 1] << 2) | (h[..., 2] << 4) | (h[..., 3] << 6)
    return SubBlockPlanes(
        qtype,
        tuple(shape),
        np.ascontiguousarray(qs, dtype=np.uint8),
        np.ascontiguousarray(qh, dtype=np.uint8),
        np.ascontiguousarray(scales),
        None if mins is None else np.ascontiguousarray(mins),
        None if sub is None else np.ascontiguousarray(sub, dtype=np.uint8),
    )
