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
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from rawpaged.errors import import_optional

QK = 32  # values per block in all three formats
#: name -> (bytes per block, bytes of fp16 header: d, or d and m)
FORMATS = {"Q4_0": (18, 2), "Q4_1": (20, 4), "Q8_0": (34, 2)}
NATIVE = tuple(FORMATS)


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

    def blocks(self) -> np.ndarray:
        """The GGUF bytes, uint8 ``[rows, cols / 32 * block bytes]``."""
        rows, cols = self.shape
        nblk = cols // QK
        parts = [self.scales.reshape(rows, nblk, 1).view(np.uint8)]
        if self.mins is not None:
            parts.append(self.mins.reshape(rows, nblk, 1).view(np.uint8))
        parts.append(self.qs.reshape(rows, nblk, -1))
        return np.concatenate(parts, axis=2).reshape(rows, -1)

    @property
    def nbytes(self) -> int:
        return self.qs.nbytes + self.scales.nbytes + (self.mins.nbytes if self.mins is not None else 0)

    def dequantize(self) -> np.ndarray:
        """float32 ``[rows, cols]``: each value ``d * q`` (Q8_0), ``d * (nibble - 8)`` (Q4_0) or
        ``d * nibble + m`` (Q4_1), computed in float32 from the fp16 ``d`` and ``m`` as ggml's
        ``dequantize_row_*`` and the ``gguf`` package compute them (tests check bit equality)."""
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
        mins = np.concatenate([p.mins for p in parts]) if first.mins is not None else None
        return QuantizedTensor(
            first.qtype,
            (rows, first.shape[1]),
            np.concatenate([p.qs for p in parts]),
            np.concatenate([p.scales for p in parts]),
            mins,
        )


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
