"""The CPU shrink/expand kernels against float64 NumPy: random adapters in mixed slots (and rows of no
adapter, -1), ranks 8 and 64, poisoned buffers and output rows they must not touch."""

import numpy as np
import pytest

from rawpaged.kernels.cpu import lora as k


def _reference(x, a, b, scales, ranks, slots, y0, offset):
    y = y0.astype(np.float64)
    for t, s in enumerate(slots):
        if s < 0:
            continue
        r = ranks[s]
        delta = scales[s] * (x[t].astype(np.float64) @ a[s, :r].T.astype(np.float64)) @ b[s, :, :r].T
        y[t, offset : offset + b.shape[1]] += delta
    return y


@pytest.mark.parametrize("path", ["parallel", "serial"])
@pytest.mark.parametrize("max_rank", [8, 64])
def test_shrink_expand_match_float64(max_rank, path, monkeypatch):
    """Both twins (forced by ``PARALLEL_MIN_WORK``) against the float64 merged delta."""
    monkeypatch.setattr(k, "PARALLEL_MIN_WORK", 0 if path == "parallel" else 1 << 62)
    rng = np.random.default_rng(max_rank)
    num_slots, fan_in, fan_out, offset, width = 4, 72, 40, 24, 80
    rows = 37
    a = rng.standard_normal((num_slots, max_rank, fan_in)).astype(np.float32)
    b = rng.standard_normal((num_slots, fan_out, max_rank)).astype(np.float32)
    ranks = np.array([max_rank, max_rank // 2, 0, 3], np.int32)  # a lower rank in a padded slot; 0: unused
    a[1, max_rank // 2 :] = np.nan  # padding beyond a slot's rank is never read
    b[1, :, max_rank // 2 :] = np.nan
    a[2], b[2] = np.nan, np.nan
    scales = np.array([0.5, 2.0, 1.0, 1.25], np.float32)
    slots = rng.choice([-1, 0, 1, 3], size=rows)
    slots[:3] = -1
    x = rng.standard_normal((rows, fan_in)).astype(np.float32)
    y0 = rng.standard_normal((rows, width)).astype(np.float32)
    y = y0.copy()
    order, starts, tile_slots = k.tiles(slots, tile_rows=4)
    buf = np.full((len(order), max_rank), np.nan, np.float32)  # poison: every entry read must be written
    k.shrink(x, a, scales, ranks, order, starts, tile_slots, buf)
    k.expand(buf, b, ranks, order, starts, tile_slots, y, offset)
    want = _reference(x, a, b, scales, ranks, slots, y0, offset)
    assert np.isfinite(y).all()
    np.testing.assert_allclose(y, want, rtol=1e-4, atol=1e-3 * np.abs(want).max())
    untouched = slots < 0
    assert np.array_equal(y[untouched], y0[untouched])  # rows of no adapter: bit for bit
    outside = np.r_[0:offset, offset + fan_out : width]
    assert np.array_equal(y[:, outside], y0[:, outside])  # columns of the other fused modules


def test_tiles_group_rows_by_slot():
    slots = np.array([2, -1, 0, 2, 0, 0, 2, -1, 0])
    order, starts, tile_slots = k.tiles(slots, tile_rows=2)
    assert order.tolist() == [2, 4, 5, 8, 0, 3, 6]  # sorted by slot, stable
    assert starts.tolist() == [0, 2, 4, 6, 7]
    assert tile_slots.tolist() == [0, 0, 2, 2]
    empty = k.tiles(np.full(3, -1))
    assert [len(a) for a in empty] == [0, 1, 0]


def test_one_tile_runs_the_serial_twin_with_the_same_results():
    """A decode of one adapter (one tile) takes the serial kernels: the same sums as the parallel ones."""
    rng = np.random.default_rng(3)
    a = rng.standard_normal((2, 16, 48)).astype(np.float32)
    b = rng.standard_normal((2, 24, 16)).astype(np.float32)
    ranks, scales = np.array([16, 16], np.int32), np.array([1.5, 0.5], np.float32)
    x = rng.standard_normal((3, 48)).astype(np.float32)
    slots = np.array([-1, 1, 1])
    order, starts, tile_slots = k.tiles(slots)
    assert len(tile_slots) == 1
    buf = np.full((len(order), 16), np.nan, np.float32)
    y0 = rng.standard_normal((3, 24)).astype(np.float32)
    y = y0.copy()
    k.shrink(x, a, scales, ranks, order, starts, tile_slots, buf)
    k.expand(buf, b, ranks, order, starts, tile_slots, y, 0)
    want = _reference(x, a, b, scales, ranks, slots, y0, 0)
    np.testing.assert_allclose(y, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
    assert np.array_equal(y[0], y0[0])
