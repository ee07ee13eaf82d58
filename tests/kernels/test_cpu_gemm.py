"""The small-M float32 product (``cpu_gemm.gemm_nt``) against float64 products, on every tile edge:
x rows padded to the tile, weight rows past the last full tile, one chunk per thread or many."""

import numpy as np
import pytest

from rawpaged.kernels.cpu import gemm as cpu_gemm
from rawpaged.kernels.cpu.backend import CPUBackend


@pytest.mark.parametrize("M", [1, 2, 3, 4, 5, 8, 17, 64])
@pytest.mark.parametrize("N", [1, 3, 4, 7, 64, 4 * cpu_gemm.CHUNKS + 3])
@pytest.mark.parametrize("K", [1, 17, 96])
def test_gemm_nt_matches_float64(M, N, K):
    rng = np.random.default_rng(M * 1000 + N * 10 + K)
    x = rng.standard_normal((M, K)).astype(np.float32)
    w = rng.standard_normal((N, K)).astype(np.float32)
    got = cpu_gemm.gemm_nt(x, w)
    want = x.astype(np.float64) @ w.astype(np.float64).T
    assert got.dtype == np.float32 and got.shape == (M, N)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.sqrt(K) * np.abs(want).max())


def test_gemm_nt_takes_views_and_other_dtypes():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((6, 40))
    w = rng.standard_normal((12, 20)).astype(np.float32)
    got = cpu_gemm.gemm_nt(x[::2, ::2], w)  # float64, strided
    np.testing.assert_allclose(got, x[::2, ::2] @ w.astype(np.float64).T, rtol=1e-5, atol=1e-5)


def test_gemm_nt_rejects_bad_shapes():
    w = np.zeros((8, 16), np.float32)
    with pytest.raises(ValueError, match="share K"):
        cpu_gemm.gemm_nt(np.zeros((2, 15), np.float32), w)
    with pytest.raises(ValueError, match="C-contiguous float32"):
        cpu_gemm.gemm_nt(np.zeros((2, 8), np.float32), w.T)
    with pytest.raises(ValueError, match="C-contiguous float32"):
        cpu_gemm.gemm_nt(np.zeros((2, 16), np.float32), w.astype(np.float64))


@pytest.mark.parametrize("M", [1, 2, 8, cpu_gemm.SMALL_M, cpu_gemm.SMALL_M + 1, 200])
def test_backend_linear_every_path_matches_float64(M):
    """``CPUBackend.linear`` on a loaded ``[out, in]`` weight, on the small-M kernel and on SGEMM."""
    be = CPUBackend()
    rng = np.random.default_rng(M)
    parts = [rng.standard_normal((24, 40)).astype(np.float32), rng.standard_normal((13, 40)).astype(np.float32)]
    w = be.load_linear(parts, "float32")
    x = rng.standard_normal((M, 40)).astype(np.float32)
    bias = rng.standard_normal(37).astype(np.float32)
    got = be.linear(x, w, bias)
    want = x.astype(np.float64) @ np.concatenate(parts).astype(np.float64).T + bias
    assert got.shape == (M, 37)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)


def test_backend_tied_head_is_the_embedding_array():
    """A float32 embedding loaded as a weight and as a one-part linear (a tied LM head) is one array."""
    be = CPUBackend()
    table = np.random.default_rng(0).standard_normal((50, 8)).astype(np.float32)
    emb = be.load_weight(table)
    assert be.load_linear([table]) is emb
    be.finish_loading()
    assert be.load_linear([table.astype(np.float64)]).flags.c_contiguous


@pytest.mark.parametrize("tile, width", [(cpu_gemm._tile_4x3, 3), (cpu_gemm._tile_4x6, 6)])
def test_both_tile_widths_match_float64_whichever_the_host_uses(tile, width):
    """``gemm_nt`` and the quantized row products run one width per host (``GEMM_TILE_N``: 6 with AVX-512,
    else 3); both are checked."""
    rng = np.random.default_rng(width)
    x = rng.standard_normal((4, 37)).astype(np.float32)
    w = rng.standard_normal((2 * width, 37)).astype(np.float32)
    out = np.full((4, 2 * width), np.nan, np.float32)
    tile(x, w, out, 0, width, width)
    want = x.astype(np.float64) @ w.astype(np.float64).T
    np.testing.assert_allclose(out[:, width:], want[:, width:], rtol=1e-5, atol=1e-4)
    assert np.isnan(out[:, :width]).all()  # nothing outside the tile written
    assert cpu_gemm.GEMM_TILE_N in (3, 6)
