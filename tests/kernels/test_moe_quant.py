"""Grouped products of quantized experts (``moe_quant.grouped_quant_linear``, ``CPUBackend.grouped_linear``):
each expert's rows against the dense quantized product of that expert's 2-D weight, in every native
format, at decode (one row) and prefill sizes; experts with no rows are never read."""

import pytest

pytest.importorskip("gguf")  # absent on some hosts (the GPU host has no package index)

import numpy as np

from rawpaged.kernels.cpu import moe_quant
from rawpaged.kernels.cpu import quant as cpu_quant
from rawpaged.kernels.cpu.backend import CPUBackend
from rawpaged.kernels.cpu.quant_weights import repack
from rawpaged.kernels.quantization import FORMATS, NATIVE, SUBBLOCK, QuantizedExperts
from tests.kernels.test_quantized_experts import expert_bytes

E, K = 6, 512


def stack(qtype, rows, seed=0, num=E):
    return QuantizedExperts.from_blocks(qtype, (num, rows, K), expert_bytes(qtype, num, rows, K, seed))


def dense_per_expert(x, offsets, st):
    """Each expert's rows through the dense quantized ``linear`` of its 2-D weight."""
    out = np.full((x.shape[0], st.shape[1]), np.nan, np.float32)
    for e in range(st.shape[0]):
        a, b = offsets[e], offsets[e + 1]
        if b > a:
            out[a:b] = cpu_quant.quant_linear(x[a:b], repack(st.expert(e)))
    return out


def rows_for(counts, seed=0):
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    x = np.random.default_rng(seed).standard_normal((int(offsets[-1]), K)).astype(np.float32)
    return x, offsets


# counts per expert: decode at batch 1 with top-2 (two experts of one row), batched decode (1-8 rows: the
# integer path's 1 and groups of 4, unpadded counts), and a prefill (up to ROWS_MAX_BATCH rows an expert)
COUNTS = {
    "decode": [0, 1, 0, 0, 1, 0],
    "batched": [3, 1, 0, 8, 2, 5],
    "prefill": [40, 0, 9, 130, 1, 76],
}


@pytest.mark.parametrize("qtype", NATIVE)
@pytest.mark.parametrize("case", COUNTS)
def test_each_expert_equals_the_dense_quantized_linear_of_its_rows(qtype, case):
    rows = 40 if case == "prefill" else 24  # 24: not a multiple of 16 (experts repacked one by one)
    st = stack(qtype, rows)
    x, offsets = rows_for(COUNTS[case])
    got = moe_quant.grouped_quant_linear(
        x, offsets, moe_quant.repack_experts([st]), np.empty((len(x), rows), np.float32)
    )
    np.testing.assert_array_equal(got, dense_per_expert(x, offsets, st))


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_K", "Q6_K"])
def test_more_rows_than_the_dense_row_products_take(qtype):
    """An expert with more rows than ``quant.ROWS_MAX_BATCH``: the dense product tiles through SGEMM, the
    grouped one keeps its register tiles (float32 rounding apart)."""
    st = stack(qtype, 32)  # 32: repacked in one piece
    x, offsets = rows_for([0, cpu_quant.ROWS_MAX_BATCH + 30, 2, 0, 0, 1])
    got = moe_quant.grouped_quant_linear(x, offsets, moe_quant.repack_experts([st]), np.empty((len(x), 32), np.float32))
    want = dense_per_expert(x, offsets, st)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    np.testing.assert_array_equal(got[offsets[2] :], want[offsets[2] :])


def poison(data: np.ndarray, qtype: str, e: int) -> np.ndarray:
    """``data`` with every fp16 field of expert e's blocks set to NaN (its dequantized values all NaN)."""
    data = data.copy()
    nan = np.frombuffer(np.float16(np.nan).tobytes(), np.uint8)
    size = FORMATS[qtype][0] if qtype in FORMATS else SUBBLOCK[qtype][1]
    offsets = {"Q4_1": (0, 2), "Q5_1": (0, 2), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}.get(qtype, (0,))
    blocks = data[e].reshape(data.shape[1], -1, size)
    for o in offsets:
        blocks[:, :, o : o + 2] = nan
    return data


@pytest.mark.parametrize("qtype", NATIVE)
@pytest.mark.parametrize("case", COUNTS)
def test_experts_without_rows_are_never_read(qtype, case):
    counts = COUNTS[case]
    idle = counts.index(0)
    data = expert_bytes(qtype, E, 24, K, seed=3)
    clean = QuantizedExperts.from_blocks(qtype, (E, 24, K), data)
    bad = QuantizedExperts.from_blocks(qtype, (E, 24, K), poison(data, qtype, idle))
    assert np.isnan(bad.expert(idle).dequantize()).all()
    x, offsets = rows_for(counts, seed=1)
    got = CPUBackend().grouped_linear(x, offsets, CPUBackend().load_experts([bad]))
    assert np.isfinite(got).all()
    np.testing.assert_array_equal(got, dense_per_expert(x, offsets, clean))


def test_backend_fuses_gate_and_up_and_stacks_mixed_formats():
    be = CPUBackend()
    gate, up, up_k = stack("Q8_0", 24, seed=4), stack("Q8_0", 24, seed=5), stack("Q4_K", 24, seed=5)
    x, offsets = rows_for(COUNTS["batched"], seed=2)
    fused = be.load_experts([gate, up])
    assert isinstance(fused, moe_quant.RepackedExperts) and fused.shape == (E, 48, K)
    want = np.concatenate([dense_per_expert(x, offsets, gate), dense_per_expert(x, offsets, up)], axis=1)
    np.testing.assert_array_equal(be.grouped_linear(x, offsets, fused), want)
    mixed = be.load_experts([gate, up_k])
    assert isinstance(mixed, moe_quant.StackedExperts) and mixed.shape == (E, 48, K)
    want = np.concatenate([dense_per_expert(x, offsets, gate), dense_per_expert(x, offsets, up_k)], axis=1)
    np.testing.assert_array_equal(be.grouped_linear(x, offsets, mixed), want)


def test_float_experts_and_quantized_ones_mixed_with_float():
    be = CPUBackend()
    rng = np.random.default_rng(6)
    w = rng.standard_normal((E, 24, K)).astype(np.float32)
    q = stack("Q4_0", 24, seed=6)
    handle = be.load_experts([w, q])
    assert isinstance(handle, np.ndarray) and handle.shape == (E, 48, K)
    x, offsets = rows_for(COUNTS["batched"], seed=3)
    got = be.grouped_linear(x, offsets, handle)
    full = np.concatenate([w, q.dequantize()], axis=1).astype(np.float64)
    e_of_row = np.repeat(np.arange(E), np.diff(offsets))
    want = np.einsum("mk,mnk->mn", x.astype(np.float64), full[e_of_row])
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


def test_bad_arguments_are_refused():
    handle = moe_quant.repack_experts([stack("Q8_0", 16)])
    x, offsets = rows_for([1, 0, 0, 0, 0, 1])
    out = np.empty((2, 16), np.float32)
    with pytest.raises(ValueError, match="expert_offsets"):
        moe_quant.grouped_quant_linear(x, offsets[:-1], handle, out)
    with pytest.raises(ValueError, match="expert_offsets"):
        moe_quant.grouped_quant_linear(x, offsets[::-1].copy(), handle, out)
    with pytest.raises(ValueError, match="x"):
        moe_quant.grouped_quant_linear(x[:, :32], offsets, handle, out)
    with pytest.raises(ValueError, match="out"):
        moe_quant.grouped_quant_linear(x, offsets, handle, np.empty((2, 8), np.float32))


@pytest.mark.parametrize("fmt", [0, 5])
@pytest.mark.parametrize("case", COUNTS)
def test_work_items_cover_each_used_expert_once_and_no_other(fmt, case):
    """The kernel's work list: every group (direct paths) or pass (dequantizing path) of each expert with
    rows exactly once, nothing of an expert without rows."""
    counts = COUNTS[case]
    G = 7
    _, offsets = rows_for(counts)
    items, pad_off = moe_quant._work(fmt, offsets, G)
    direct_max = 8 if fmt >= 3 else 1
    for e, m in enumerate(counts):
        mine = items[items[:, 0] == e]
        if m == 0:
            assert len(mine) == 0
            continue
        top = G if m <= direct_max else -(-G // 3)
        covered = np.concatenate([np.arange(a, b) for _, a, b in mine])
        np.testing.assert_array_equal(np.sort(covered), np.arange(top))
        assert pad_off[e + 1] - pad_off[e] == (0 if m <= direct_max else -(-m // 4) * 4)
