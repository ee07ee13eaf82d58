"""CPU (Numba) grouped products of a mixture of experts' GGUF-quantized weights: rows of x sorted by expert
(``moe_align``), each expert's rows times that expert's weight, in one parallel kernel.

Layout: ``RepackedExperts`` holds E experts' ``quant_weights.RepackedQuantized`` planes one after another
along their groups of ``R`` = 16 rows (``G = ceil(N / 16)`` groups an expert), so expert e's group gl is
group ``e * G + gl`` of the planes and ``quant``'s per-group bodies read it unchanged.

``grouped_quant_linear(x, expert_offsets, experts, out)`` computes ``out[r] = x[r] @ dequantize(W_e).T``
for the rows r of expert e (``expert_offsets[e] .. expert_offsets[e + 1]``). One compiled call lists the
work (an expert with no rows gets none, so its weights are never read), then a ``prange`` runs it. Each
expert takes the path the dense ``quant.quant_linear`` takes for its number of rows m:

- the sub-block formats (Q5_0, Q5_1, Q4_K, Q5_K, Q6_K) up to ``quant_subblock.INT_MAX_ROWS`` rows: the
  integer dot products with int16 activations (``quant_subblock.int_group``), a work item being a run of
  ``DIRECT_GROUPS`` groups;
- Q8_0, Q4_0 and Q4_1 at m = 1: the float GEMV bodies (``quant.gemv_group_q8_0``, ``gemv_group_q4``);
- more rows: 48 weight rows at a time dequantized into a float32 scratch (``quant.group_rows``,
  ``quant_subblock.group_rows``) and multiplied in ``gemm``'s register tiles (``gemm.rows_tiles``), a work
  item being one such pass, so each used expert's weights are read once a call whatever its rows.

So up to ``quant.ROWS_MAX_BATCH`` rows an expert's output is bit for bit the dense product of its rows
(above, the dense product goes through SGEMM tiles, with float32 rounding of its own).
"""

from __future__ import annotations

from dataclasses import dataclass

import numba as nb
import numpy as np

from rawpaged.kernels.cpu import quant_subblock as sb
from rawpaged.kernels.cpu.gemm import TILE_M, rows_tiles
from rawpaged.kernels.cpu.quant import block_sums, gemv_group_q4, gemv_group_q8_0, group_rows
from rawpaged.kernels.cpu.quant_layout import JIT, ROWS_PER_PASS, R
from rawpaged.kernels.cpu.quant_weights import RepackedQuantized, kernel_planes
from rawpaged.kernels.quantization import (
    FORMAT_CODES,
    QK,
    QuantizedExperts,
    StackedExpertParts,
    concat_rows,
    runs_of_one_format,
)

#: groups of 16 weight rows in one work item of the direct (GEMV, integer) paths
DIRECT_GROUPS = 4
_PLANES = ("qs", "scales", "mins", "qh", "sub")


@dataclass(frozen=True)
class RepackedExperts:
    """E ``[N, K]`` experts of one format in the CPU kernels' layout (module docstring): ``shape == (E, N,
    K)``, ``groups`` = G per expert, planes as ``RepackedQuantized``'s with ``E * G`` groups."""

    qtype: str
    shape: tuple
    groups: int
    qs: np.ndarray
    scales: np.ndarray
    mins: np.ndarray | None = None
    qh: np.ndarray | None = None
    sub: np.ndarray | None = None

    @classmethod
    def from_experts(cls, stack: QuantizedExperts) -> RepackedExperts:
        """Repack a stack (never dequantized): in one piece where N is a multiple of 16, else expert by
        expert (each padded to whole groups)."""
        num, rows, cols = stack.shape
        groups = -(-rows // R)
        if rows % R == 0:
            parts = [RepackedQuantized.from_quantized(stack.flat())]
        else:
            parts = [RepackedQuantized.from_quantized(stack.expert(e)) for e in range(num)]
        planes = {}
        for name in _PLANES:
            got = [getattr(p, name) for p in parts]
            planes[name] = None if got[0] is None else np.concatenate(got) if len(got) > 1 else got[0]
        return cls(stack.qtype, (num, rows, cols), groups, **planes)

    @property
    def nbytes(self) -> int:
        return sum(getattr(self, n).nbytes for n in _PLANES if getattr(self, n) is not None)

    def expert(self, e: int) -> RepackedQuantized:
        """Expert e as a dense ``RepackedQuantized`` (views): what ``quant.quant_linear`` takes."""
        g = slice(e * self.groups, (e + 1) * self.groups)
        planes = {n: None if getattr(self, n) is None else getattr(self, n)[g] for n in _PLANES}
        return RepackedQuantized(self.qtype, self.shape[1:], **planes)


@dataclass(frozen=True)
class StackedExperts(StackedExpertParts):
    """Experts whose fused parts differ in format (gate in one, up in another): each part a
    ``RepackedExperts``, its rows the next columns of the output."""

    parts: tuple


def repack_experts(parts: list) -> RepackedExperts | StackedExperts:
    """Stacks ``[E, N_i, K]`` fused along N (``concat_rows`` for adjacent parts of one format), repacked.

    Raises ValueError for stacks of different expert counts or widths."""
    first = parts[0]
    if any(p.shape[0] != first.shape[0] or p.shape[2] != first.shape[2] for p in parts):
        raise ValueError("fused expert stacks must share expert count and width")
    packed = tuple(RepackedExperts.from_experts(concat_rows(run)) for run in runs_of_one_format(parts))
    return packed[0] if len(packed) == 1 else StackedExperts(packed)


def grouped_quant_linear(x: np.ndarray, expert_offsets: np.ndarray, experts, out: np.ndarray) -> np.ndarray:
    """``out[r] = x[r] @ dequantize(W_e).T`` for each expert e's rows r (``expert_offsets[e] ..
    expert_offsets[e + 1]``), an expert with no rows never read (module docstring).

    Args:
        x: float32 ``[M, K]``, rows in expert order.
        expert_offsets: int64 ``[E + 1]``, non-decreasing from 0 to M.
        experts: ``RepackedExperts`` or ``StackedExperts`` of shape ``(E, N, K)`` (``repack_experts``).
        out: float32 ``[M, N]``, C-contiguous; written and returned.

    Raises:
        ValueError: shapes that do not match, or offsets out of order.
    """
    x = np.ascontiguousarray(x, dtype=np.float32)
    offsets = np.ascontiguousarray(expert_offsets, dtype=np.int64)
    E, N, K = experts.shape
    M = x.shape[0]
    if x.ndim != 2 or x.shape[1] != K:
        raise ValueError(f"x {x.shape}: expected [M, {K}] for experts of shape {experts.shape}")
    if offsets.shape != (E + 1,) or offsets[0] != 0 or offsets[-1] != M or (np.diff(offsets) < 0).any():
        raise ValueError(f"expert_offsets must rise from 0 to {M} over {E + 1} entries, got {offsets.tolist()}")
    if out.shape != (M, N) or out.dtype != np.float32 or not out.flags.c_contiguous:
        raise ValueError(f"out {out.shape} {out.dtype}: expected C-contiguous float32 {(M, N)}")
    if isinstance(experts, StackedExperts):
        n0 = 0
        for part in experts.parts:
            n1 = n0 + part.shape[1]
            out[:, n0:n1] = grouped_quant_linear(x, offsets, part, np.empty((M, n1 - n0), np.float32))
            n0 = n1
        return out
    if M == 0:
        return out
    qs, qh, scales, mins, sub = kernel_planes(experts)
    _grouped(FORMAT_CODES[experts.qtype], x, offsets, qs, qh, scales, mins, sub, experts.groups, out,
             4 * nb.get_num_threads())  # fmt: skip
    return out


@nb.njit(**JIT)
def _work(fmt, offsets, G):
    """The work items ``[n, 3]`` (expert, first, last) of the grouped product (``_grouped``): group runs
    for the direct paths, passes for the dequantizing one; and each expert's first row in the padded
    activations of the dequantizing path (``pad_off [E + 1]``, rows rounded up to ``TILE_M``)."""
    E = offsets.shape[0] - 1
    direct_max = sb.INT_MAX_ROWS if fmt >= 3 else 1
    gpp = ROWS_PER_PASS // R
    passes = -(-G // gpp)
    runs = -(-G // DIRECT_GROUPS)
    pad_off = np.zeros(E + 1, np.int64)
    n = 0
    for e in range(E):
        m = offsets[e + 1] - offsets[e]
        padded = 0
        if 0 < m <= direct_max:
            n += runs
        elif m > direct_max:
            n += passes
            padded = -(-m // TILE_M) * TILE_M
        pad_off[e + 1] = pad_off[e] + padded
    items = np.empty((n, 3), np.int64)
    i = 0
    for e in range(E):
        m = offsets[e + 1] - offsets[e]
        if m == 0:
            continue
        step, count = (DIRECT_GROUPS, runs) if m <= direct_max else (1, passes)
        top = G if m <= direct_max else passes
        for k in range(count):
            items[i, 0] = e
            items[i, 1] = k * step
            items[i, 2] = min(top, (k + 1) * step)
            i += 1
    return items, pad_off


@nb.njit(**JIT)
def _passes(fmt, qs, qh, scales, mins, sub, e, G, a, b, cf, w, x, res):
    """Passes ``a .. b`` of expert e (48 weight rows each, dequantized into ``w``) times its padded rows
    ``x``, into ``res``'s columns of those rows."""
    gpp = ROWS_PER_PASS // R
    for p in range(a, b):
        for gi in range(gpp):
            gl = p * gpp + gi
            if gl >= G:
                w[gi * R : (gi + 1) * R, :] = 0.0
            elif fmt >= 3:
                sb.group_rows(fmt, qs, qh, scales, mins, sub, e * G + gl, cf, w, gi * R)
            else:
                group_rows(fmt, qs, scales, mins, e * G + gl, cf, w, gi * R)
        rows_tiles(x, w, res, p * ROWS_PER_PASS)


@nb.njit(parallel=True, **JIT)
def _grouped(fmt, x, offsets, qs, qh, scales, mins, sub, G, out, max_chunks):
    """``grouped_quant_linear``'s kernel on the experts' planes (``quant_weights.kernel_planes``)."""
    E = offsets.shape[0] - 1
    M, K = x.shape
    N = out.shape[1]
    nblk = K // QK
    gpp = ROWS_PER_PASS // R
    direct_max = sb.INT_MAX_ROWS if fmt >= 3 else 1
    items, pad_off = _work(fmt, offsets, G)
    # the integer path's activations, for the rows of experts that take it
    int_rows = np.zeros(0, np.int64)
    if fmt >= 3:
        n_int = 0
        for e in range(E):
            if offsets[e + 1] - offsets[e] <= direct_max:
                n_int += offsets[e + 1] - offsets[e]
        int_rows = np.empty(n_int, np.int64)
        j = 0
        for e in range(E):
            if offsets[e + 1] - offsets[e] <= direct_max:
                for r in range(offsets[e], offsets[e + 1]):
                    int_rows[j] = r
                    j += 1
    xq16, dxf, xsf = sb.quantize_rows(x, int_rows)
    # the dequantizing path's activations, each expert's rows padded to whole tiles, and its results
    Mp = pad_off[E]
    xp = np.zeros((Mp, K), np.float32)
    res = np.empty((Mp, -(-G // gpp) * ROWS_PER_PASS), np.float32)
    for e in range(E):
        if pad_off[e + 1] > pad_off[e]:
            xp[pad_off[e] : pad_off[e] + offsets[e + 1] - offsets[e]] = x[offsets[e] : offsets[e + 1]]
    n = items.shape[0]
    nchunks = min(n, max_chunks)
    # the passes' scratch only where some expert takes them (decode needs none: no 1.5 MB map and unmap a step)
    rows = np.empty((max(nchunks, 1) if Mp else 1, ROWS_PER_PASS, K if Mp else QK), np.float32)
    cfs = np.empty((max(nchunks, 1), 4, R), np.float32)
    accs = np.empty((max(nchunks, 1), sb.INT_MAX_ROWS * R), np.float32)
    for c in nb.prange(nchunks):
        w, cf, acc = rows[c], cfs[c], accs[c]
        for i in range(c * n // nchunks, (c + 1) * n // nchunks):
            e, a, b = items[i, 0], items[i, 1], items[i, 2]
            r0 = offsets[e]
            m = offsets[e + 1] - r0
            if m <= direct_max:
                mp = 1 if m == 1 else -(-m // TILE_M) * TILE_M
                xsum = block_sums(x[r0], nblk) if fmt == 1 or fmt == 2 else cf[0, :1]
                for gl in range(a, b):
                    g = e * G + gl
                    if fmt >= 3:
                        sb.int_group(fmt, qs, qh, scales, mins, sub, g, xq16, dxf, xsf, r0, mp, acc)
                    elif fmt == 0:
                        gemv_group_q8_0(x[r0], qs, scales, g, acc)
                    else:
                        gemv_group_q4(x[r0], xsum, qs, scales, mins, fmt, g, acc, cf[:2])
                    for k in range(m):
                        for r in range(R):
                            col = gl * R + r
                            if col < N:
                                out[r0 + k, col] = acc[k * R + r]
            else:
                _passes(fmt, qs, qh, scales, mins, sub, e, G, a, b, cf, w, xp[pad_off[e] : pad_off[e + 1]],
                        res[pad_off[e] : pad_off[e + 1]])  # fmt: skip
    for e in range(E):
        if pad_off[e + 1] > pad_off[e]:
            m = offsets[e + 1] - offsets[e]
            out[offsets[e] : offsets[e + 1]] = res[pad_off[e] : pad_off[e] + m, :N]
    return out
