"""The CPU's mixture-of-experts kernels (``rawpaged.kernels.cpu.moe``) against plain NumPy: routing with
each normalization (ties to the lower index), the alignment by expert (stable, experts with no rows),
the grouped products (an expert with no rows is never read) and the weighted scatter back."""

from __future__ import annotations

import numpy as np
import pytest

from rawpaged.kernels.cpu.backend import CPUBackend
from rawpaged.kernels.cpu.moe import TILE_N

be = CPUBackend()


def _softmax(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def _route_ref(logits, k, before, renorm):
    logits = logits.astype(np.float64)
    ids = np.argsort(-logits, axis=-1, kind="stable")[:, :k]  # stable: the lower index first on ties
    if before:
        w = np.take_along_axis(_softmax(logits), ids, -1)
        if renorm:
            w = w / w.sum(-1, keepdims=True)
    else:
        w = _softmax(np.take_along_axis(logits, ids, -1))
    return ids, w


@pytest.mark.parametrize("before,renorm", [(True, False), (True, True), (False, False), (False, True)])
def test_route_matches_numpy(before, renorm):
    logits = np.random.default_rng(0).standard_normal((37, 8)).astype(np.float32) * 3
    ids, w = be.moe_route(logits, 3, before, renorm)
    want_ids, want_w = _route_ref(logits, 3, before, renorm)
    assert ids.dtype == np.int32 and w.dtype == np.float32 and ids.shape == w.shape == (37, 3)
    np.testing.assert_array_equal(ids, want_ids)
    np.testing.assert_allclose(w, want_w, rtol=1e-6, atol=1e-7)
    if renorm or not before:
        np.testing.assert_allclose(w.sum(-1), 1.0, rtol=1e-6)


def test_route_ties_go_to_the_lower_expert_index():
    logits = np.array([[1.0, 2.0, 2.0, 2.0, 0.0], [0.0, 0.0, 0.0, 0.0, 0.0]], np.float32)
    ids, w = be.moe_route(logits, 2, True, False)
    np.testing.assert_array_equal(ids, [[1, 2], [0, 1]])
    np.testing.assert_allclose(w[1], [0.2, 0.2], rtol=1e-6)
    ids, w = be.moe_route(logits, 2, False, False)
    np.testing.assert_array_equal(ids, [[1, 2], [0, 1]])
    np.testing.assert_allclose(w, 0.5)


def test_route_refuses_k_beyond_the_experts():
    with pytest.raises(ValueError, match="top_k 5"):
        be.moe_route(np.zeros((2, 4), np.float32), 5, True, False)


def test_align_is_a_stable_sort_by_expert_with_empty_experts():
    ids = np.array([[3, 0], [3, 5], [0, 3]], np.int32)  # experts 1, 2, 4 get no rows
    sorted_ids, offsets = be.moe_align(ids, 6)
    assert sorted_ids.dtype == np.int32 and offsets.dtype == np.int64
    np.testing.assert_array_equal(offsets, [0, 2, 2, 2, 5, 5, 6])
    np.testing.assert_array_equal(sorted_ids, np.argsort(ids.reshape(-1), kind="stable"))
    np.testing.assert_array_equal(sorted_ids, [1, 4, 0, 2, 5, 3])
    with pytest.raises(ValueError, match="expert ids"):
        be.moe_align(np.array([[6]], np.int32), 6)


def test_grouped_linear_matches_numpy_and_never_reads_an_expert_without_rows():
    rng = np.random.default_rng(1)
    E, N, K = 5, 2 * TILE_N + 3, 40  # a partial last tile
    w = rng.standard_normal((E, N, K)).astype(np.float32)
    w[2] = np.nan  # no rows for experts 2 and 4
    w[4] = np.nan
    experts = be.load_experts([w[:, :7], w[:, 7:]], "float32")
    np.testing.assert_array_equal(np.isnan(experts), np.isnan(w))
    offsets = np.array([0, 3, 4, 4, 9, 9], np.int64)
    x = rng.standard_normal((9, K)).astype(np.float32)
    out = be.grouped_linear(x, offsets, experts)
    owner = np.repeat(np.arange(E), np.diff(offsets))
    want = np.einsum("mk,mnk->mn", x.astype(np.float64), w[owner].astype(np.float64))
    assert out.shape == (9, N) and np.isfinite(out).all()
    np.testing.assert_allclose(out, want, rtol=1e-4, atol=1e-4)
    assert be.grouped_linear(x[:0], np.zeros(E + 1, np.int64), experts).shape == (0, N)
    with pytest.raises(ValueError, match="grouped_linear"):
        be.grouped_linear(x, offsets[:-1], experts)


@pytest.mark.parametrize("rows", [(13, 0, 4, 6), (1, 2, 3, 0), (33, 8, 0, 5)])
def test_grouped_linear_in_register_tiles_matches_a_float64_reference(rows):
    """Experts of many rows (prefill): whole tiles of 4 rows, the rows past them, weight rows past the
    last whole tile of 6 (3) and of 4, against the float64 product; an expert without rows never read."""
    rng = np.random.default_rng(sum(rows))
    E, N, K = len(rows), TILE_N + 7, 67
    w = rng.standard_normal((E, N, K)).astype(np.float32)
    for e in np.flatnonzero(np.array(rows) == 0):
        w[e] = np.nan
    offsets = np.concatenate([[0], np.cumsum(rows)]).astype(np.int64)
    x = rng.standard_normal((offsets[-1], K)).astype(np.float32)
    out = be.grouped_linear(x, offsets, be.load_experts([w], "float32"))
    owner = np.repeat(np.arange(E), rows)
    want = np.einsum("mk,mnk->mn", x.astype(np.float64), w[owner].astype(np.float64))
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def test_combine_weights_and_sums_each_tokens_rows():
    rng = np.random.default_rng(2)
    T, k, H = 4, 3, 10
    topk_ids = rng.integers(0, 6, (T, k)).astype(np.int32)
    weights = rng.random((T, k)).astype(np.float32)
    sorted_ids, _ = be.moe_align(topk_ids, 6)
    per_slot = rng.standard_normal((T * k, H)).astype(np.float32)  # row t * k + j: token t's slot j
    y = per_slot[sorted_ids]  # in expert order, as the grouped products give them
    out = be.moe_combine(y, sorted_ids, weights, T)
    want = (weights[:, :, None].astype(np.float64) * per_slot.reshape(T, k, H)).sum(1)
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-6)


def test_the_four_ops_make_the_moe_block():
    """route -> align -> grouped gate/up -> SwiGLU -> grouped down -> combine equals the per-token loop."""
    rng = np.random.default_rng(3)
    T, E, k, H, F = 6, 4, 2, 16, 8
    x = rng.standard_normal((T, H)).astype(np.float32)
    router = rng.standard_normal((E, H)).astype(np.float32)
    gate, up, down = (rng.standard_normal(s).astype(np.float32) * 0.3 for s in ((E, F, H), (E, F, H), (E, H, F)))
    ids, w = be.moe_route(x @ router.T, k, True, True)
    sorted_ids, offsets = be.moe_align(ids, E)
    gate_up = be.load_experts([gate, up], "float32")
    h = be.silu_and_mul(be.grouped_linear(x[sorted_ids // k], offsets, gate_up))
    out = be.moe_combine(be.grouped_linear(h, offsets, be.load_experts([down], "float32")), sorted_ids, w, T)
    want = np.zeros((T, H))
    for t in range(T):
        for j in range(k):
            e = ids[t, j]
            g, u = gate[e] @ x[t], up[e] @ x[t]
            want[t] += w[t, j] * (down[e] @ (g / (1 + np.exp(-g)) * u))
    np.testing.assert_allclose(out, want, rtol=1e-4, atol=1e-5)
