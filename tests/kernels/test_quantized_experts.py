"""``QuantizedExperts``: stacks of E GGUF-quantized weights (a mixture of experts' 3-D ``ffn_*_exps``
tensors) built from their bytes, each expert a 2-D view that dequantizes as the ``gguf`` package does."""

import pytest

pytest.importorskip("gguf")  # absent on some hosts (the GPU host has no package index)

import gguf
import numpy as np

from rawpaged.kernels.quantization import FORMATS, NATIVE, QuantizedExperts, QuantizedTensor, concat_rows
from rawpaged.testing.quant_blocks import random_blocks

E, ROWS, COLS = 5, 24, 512  # 512: two K-quant super-blocks per row


def expert_bytes(qtype: str, num=E, rows=ROWS, cols=COLS, seed=0) -> np.ndarray:
    """GGUF bytes uint8 ``[num, rows, bytes per row]`` of a random stack in ``qtype``."""
    rng = np.random.default_rng(seed)
    if qtype in FORMATS:
        w = rng.standard_normal((num, rows, cols)).astype(np.float32)
        return gguf.quants.quantize(w, gguf.GGMLQuantizationType[qtype])
    return random_blocks(qtype, num * rows, cols, rng).reshape(num, rows, -1)


@pytest.mark.parametrize("qtype", NATIVE)
def test_each_expert_dequantizes_as_gguf_does_its_slice(qtype):
    data = expert_bytes(qtype)
    stack = QuantizedExperts.from_blocks(qtype, (E, ROWS, COLS), data)
    assert stack.shape == (E, ROWS, COLS) and stack.format == qtype and stack.num_experts == E
    assert stack.nbytes == data.nbytes
    for e in range(E):
        q = stack.expert(e)
        assert isinstance(q, QuantizedTensor) and q.shape == (ROWS, COLS) and q.qtype == qtype
        want = gguf.quants.dequantize(data[e], gguf.GGMLQuantizationType[qtype])
        got = q.dequantize()
        assert got.dtype == np.float32 and np.isfinite(want).all()
        np.testing.assert_array_equal(got.view(np.uint32), want.astype(np.float32).view(np.uint32))
        np.testing.assert_array_equal(q.blocks(), data[e])
    np.testing.assert_array_equal(stack.blocks(), data)


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_1", "Q4_K"])
def test_experts_are_views_of_the_stack(qtype):
    stack = QuantizedExperts.from_blocks(qtype, (E, ROWS, COLS), expert_bytes(qtype))
    q = stack.expert(3)
    assert np.shares_memory(q.qs, stack.qs)
    assert q.scales is None or np.shares_memory(q.scales, stack.scales)
    with pytest.raises(IndexError):
        stack.expert(E)


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_1", "Q5_0", "Q6_K"])
def test_concat_rows_puts_each_experts_rows_after_one_another(qtype):
    gate = QuantizedExperts.from_blocks(qtype, (E, ROWS, COLS), expert_bytes(qtype, seed=1))
    up = QuantizedExperts.from_blocks(qtype, (E, 8, COLS), expert_bytes(qtype, rows=8, seed=2))
    fused = concat_rows([gate, up])
    assert fused.shape == (E, ROWS + 8, COLS)
    for e in range(E):
        want = np.concatenate([gate.expert(e).dequantize(), up.expert(e).dequantize()])
        np.testing.assert_array_equal(fused.expert(e).dequantize(), want)
    restacked = QuantizedExperts.stack([fused.expert(e) for e in range(E)])
    np.testing.assert_array_equal(restacked.blocks(), fused.blocks())


def test_bad_stacks_are_refused():
    data = expert_bytes("Q8_0")
    with pytest.raises(ValueError, match="expected uint8"):
        QuantizedExperts.from_blocks("Q8_0", (E + 1, ROWS, COLS), data)
    with pytest.raises(ValueError, match="not a native format"):
        QuantizedExperts.from_blocks("Q2_K", (E, ROWS, COLS), data)
    a = QuantizedExperts.from_blocks("Q8_0", (E, ROWS, COLS), data)
    b = QuantizedExperts.from_blocks("Q4_0", (E, ROWS, COLS), expert_bytes("Q4_0"))
    with pytest.raises(ValueError, match="share format"):
        concat_rows([a, b])
