"""LoRA's shrink and expand over a batch of rows, grouped by adapter (after Punica's SGMV: Chen et al.,
2023, and vLLM's ``lora/ops``): ``y[t] += scale[s] * (x[t] @ A[s].T) @ B[s].T`` for each row ``t`` whose
adapter slot ``s`` is not -1, the base weight untouched.

The rows come sorted by slot and cut into tiles of at most ``TILE_ROWS`` rows of one slot
(``tiles(...)``): a tile reads its adapter's A and B once for all its rows, and the tiles run in
parallel. ``shrink`` writes ``buf[j, :rank]`` (``j``: the row's position in the sorted order) and
``expand`` reads it back, so only the first ``rank`` columns of a slot are ever touched: a slot padded
to the manager's ``max_lora_rank`` costs its own rank only.
"""

from __future__ import annotations

import numba as nb
import numpy as np

from rawpaged.kernels.cpu.jit import jit_serial_and_parallel

#: rows of one adapter computed together (their A and B rows read once per tile)
TILE_ROWS = 8
#: multiply-adds below which a call runs on the calling thread: a decode step's products are tens of
#: microseconds of work (32 rows of rank 16 over 576 inputs: 17 us serial), less than waking the thread
#: pool, which measured 0.2-4 ms a call on a 2-core host with other work on it
PARALLEL_MIN_WORK = 1 << 21


def tiles(slots: np.ndarray, tile_rows: int = TILE_ROWS) -> tuple:
    """The tiling of a step's rows by adapter slot.

    slots: int ``[num_rows]``, each row's slot (-1: no adapter).
    Returns ``(order, tile_starts, tile_slots)``: int64 ``order [n]``, the rows with a slot, sorted by slot
    (stable); int64 ``tile_starts [num_tiles + 1]``, each tile's first position in ``order``; int64
    ``tile_slots [num_tiles]``, each tile's slot.
    """
    slots = np.asarray(slots, dtype=np.int64)
    active = np.flatnonzero(slots >= 0)
    order = active[np.argsort(slots[active], kind="stable")]
    sorted_slots = slots[order]
    starts = []
    for i in range(len(order)):
        if i == 0 or sorted_slots[i] != sorted_slots[i - 1] or i - starts[-1] >= tile_rows:
            starts.append(i)
    starts.append(len(order))
    tile_slots = sorted_slots[np.array(starts[:-1], dtype=np.int64)] if len(order) else np.zeros(0, np.int64)
    return order.astype(np.int64), np.array(starts, dtype=np.int64), tile_slots.astype(np.int64)


def _shrink(x, lora_a, scales, ranks, order, tile_starts, tile_slots, buf):
    """``buf[j, r] = scales[s] * sum_k x[order[j], k] * lora_a[s, r, k]`` for ``r < ranks[s]``.

    x: float32 ``[num_rows, in]``; lora_a: float32 ``[num_slots, max_rank, in]``; scales: float32
    ``[num_slots]``; ranks: int32 ``[num_slots]``; order, tile_starts, tile_slots: from ``tiles``;
    buf: float32 ``[len(order), max_rank]``, written in its first ``ranks[s]`` columns.
    """
    k_in = x.shape[1]
    for tile in nb.prange(len(tile_slots)):
        s = tile_slots[tile]
        scale = scales[s]
        for r in range(ranks[s]):
            for j in range(tile_starts[tile], tile_starts[tile + 1]):
                t = order[j]
                acc = np.float32(0.0)
                for k in range(k_in):
                    acc += x[t, k] * lora_a[s, r, k]
                buf[j, r] = acc * scale


def _expand(buf, lora_b, ranks, order, tile_starts, tile_slots, y, out_offset):
    """``y[order[j], out_offset + o] += sum_r buf[j, r] * lora_b[s, o, r]`` over ``r < ranks[s]``.

    buf: float32 ``[len(order), max_rank]`` (``shrink``'s); lora_b: float32 ``[num_slots, out, max_rank]``;
    y: float32 ``[num_rows, >= out_offset + out]``, added into in its columns ``out_offset ..
    out_offset + out - 1`` of the rows in ``order`` only.
    """
    n_out = lora_b.shape[1]
    for tile in nb.prange(len(tile_slots)):
        s = tile_slots[tile]
        rank = ranks[s]
        for j in range(tile_starts[tile], tile_starts[tile + 1]):
            t = order[j]
            for o in range(n_out):
                acc = np.float32(0.0)
                for r in range(rank):
                    acc += buf[j, r] * lora_b[s, o, r]
                y[t, out_offset + o] += acc


_shrink_serial, _shrink_parallel = jit_serial_and_parallel(_shrink)
_expand_serial, _expand_parallel = jit_serial_and_parallel(_expand)


def _parallel(tile_slots, ranks, rows: int, width: int) -> bool:
    """Whether a call is worth the thread pool: two tiles or more and ``PARALLEL_MIN_WORK`` multiply-adds."""
    if len(tile_slots) < 2:
        return False
    return rows * int(ranks[tile_slots].max()) * width >= PARALLEL_MIN_WORK


def shrink(x, lora_a, scales, ranks, order, tile_starts, tile_slots, buf) -> None:
    """``_shrink`` (its doc gives the arrays), over the thread pool for large work (``_parallel``)."""
    fn = _shrink_parallel if _parallel(tile_slots, ranks, len(order), x.shape[1]) else _shrink_serial
    fn(x, lora_a, scales, ranks, order, tile_starts, tile_slots, buf)


def expand(buf, lora_b, ranks, order, tile_starts, tile_slots, y, out_offset: int) -> None:
    """``_expand`` (its doc gives the arrays), over the thread pool for large work (``_parallel``)."""
    fn = _expand_parallel if _parallel(tile_slots, ranks, len(order), lora_b.shape[1]) else _expand_serial
    fn(buf, lora_b, ranks, order, tile_starts, tile_slots, y, out_offset)
