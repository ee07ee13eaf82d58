"""Capture-safe cuBLAS (``rawpaged/kernels/cublas.py``) and ``CudaBackend.capture_graph``'s orchestration,
without a GPU: a stand-in library computes ``cublasGemmEx`` with cuBLAS's documented column-major
semantics on host memory, and a stand-in CuPy records streams, pools and captures."""

from __future__ import annotations

import contextlib
import ctypes

import numpy as np
import pytest

from rawpaged.kernels.cuda import cublas
from rawpaged.kernels.cuda.backend import CudaBackend


def _floats(address: int, count: int) -> np.ndarray:
    return np.ctypeslib.as_array((ctypes.c_float * count).from_address(address))


class FakeCublas:
    """``cublasCreate_v2``, ``cublasSetStream_v2``, ``cublasSetWorkspace_v2``, ``cublasDestroy_v2`` and a
    float32 ``cublasGemmEx``: ``C = alpha op(A) op(B) + beta C``, all column-major (cuBLAS's API)."""

    def __init__(self, fail: str | None = None):
        self.calls = []
        self.fail = fail

    def _status(self, name):
        return 7 if name == self.fail else 0

    def cublasCreate_v2(self, ref):
        ref._obj.value = 0x1234
        self.calls.append(("create",))
        return self._status("create")

    def cublasSetStream_v2(self, handle, stream):
        self.calls.append(("stream", handle.value, stream.value))
        return self._status("stream")

    def cublasSetWorkspace_v2(self, handle, ptr, size):
        self.calls.append(("workspace", ptr.value, size.value))
        return self._status("workspace")

    def cublasDestroy_v2(self, handle):
        self.calls.append(("destroy",))
        return 0

    def cublasGemmEx(self, handle, ta, tb, m, n, k, alpha, a, at, lda, b, bt, ldb, beta, c, ct, ldc, compute, algo):
        assert (at, bt, ct) == (cublas.CUDA_R_32F,) * 3, "this stand-in multiplies float32 only"
        assert (compute, algo) == (cublas.COMPUTE_32F, cublas.GEMM_DEFAULT)
        self.calls.append(("gemm", ta, tb, m, n, k, lda, ldb, ldc))
        rows_a, cols_a = (m, k) if ta == cublas.OP_N else (k, m)
        rows_b, cols_b = (k, n) if tb == cublas.OP_N else (n, k)
        assert lda >= rows_a and ldb >= rows_b and ldc >= m
        A = _floats(a, lda * cols_a).reshape(cols_a, lda).T[:rows_a]  # column-major with leading dim lda
        B = _floats(b, ldb * cols_b).reshape(cols_b, ldb).T[:rows_b]
        C = _floats(c, ldc * n).reshape(n, ldc).T[:m]
        opa = A if ta == cublas.OP_N else A.T
        opb = B if tb == cublas.OP_N else B.T
        s_alpha, s_beta = _floats(alpha, 1)[0], _floats(beta, 1)[0]
        product = s_alpha * (opa.astype(np.float64) @ opb)
        C[...] = product if s_beta == 0 else product + s_beta * C  # beta 0: C is not read (cuBLAS docs)
        return 0


def test_gemm_nt_maps_row_major_x_wT_onto_column_major_gemm():
    rng = np.random.default_rng(0)
    lib = FakeCublas()
    handle = cublas.CublasHandle(lib, stream_ptr=0x55, workspace_ptr=0x66, workspace_bytes=1024)
    alpha, beta = np.float32(1.0), np.float32(0.0)
    alpha_a, beta_a = np.array(alpha), np.array(beta)
    for n, m, k in [(3, 5, 7), (1, 9, 4), (6, 2, 3)]:
        x = rng.standard_normal((n, k)).astype(np.float32)
        w = rng.standard_normal((m, k)).astype(np.float32)
        y = np.full((n, m), np.nan, np.float32)
        cublas.gemm_nt(
            handle.gemm_ex,
            x.ctypes.data,
            w.ctypes.data,
            y.ctypes.data,
            n,
            m,
            k,
            cublas.CUDA_R_32F,
            cublas.CUDA_R_32F,
            alpha_a.ctypes.data,
            beta_a.ctypes.data,
        )
        np.testing.assert_allclose(y, x.astype(np.float64) @ w.T, rtol=1e-5, atol=1e-5)
    assert lib.calls[:3] == [("create",), ("stream", 0x1234, 0x55), ("workspace", 0x66, 1024)]


@pytest.mark.parametrize(
    "failing, name", [("create", "cublasCreate"), ("stream", "cublasSetStream"), ("workspace", "cublasSetWorkspace")]
)
def test_a_failing_cublas_call_raises_naming_it_and_frees_the_handle(failing, name):
    lib = FakeCublas(fail=failing)
    with pytest.raises(RuntimeError, match=f"{name} failed"):
        cublas.CublasHandle(lib, 1, 2, 3)
    assert (("destroy",) in lib.calls) == (failing != "create")


def test_the_loaded_cublas_is_found_in_the_process_maps():
    maps = (
        "7f00-7f10 r-xp 00000000 00:10 11 /opt/venv/lib/nvidia/cublas/lib/libcublasLt.so.13\n"
        "7f20-7f30 rw-p 00000000 00:00 0 \n"
        "7f40-7f50 r-xp 00000000 00:10 12 /opt/venv/lib/nvidia/cublas/lib/libcublas.so.13\n"
    )
    assert cublas.loaded_library_path(maps) == "/opt/venv/lib/nvidia/cublas/lib/libcublas.so.13"
    assert cublas.loaded_library_path("7f20-7f30 rw-p 00000000 00:00 0 [heap]\n") is None


# ------------------------------------------------------------------------------------ capture_graph
class _Graph:
    def __init__(self, log):
        self.log = log

    def launch(self, stream=None):
        self.log.append(("launch", stream.name))


class _Stream:
    def __init__(self, cuda, name, ptr):
        self.cuda, self.name, self.ptr = cuda, name, ptr
        self.capturing = False

    def __enter__(self):
        self.cuda.stack.append(self)
        return self

    def __exit__(self, *exc):
        self.cuda.stack.pop()
        return False

    def synchronize(self):
        assert not self.capturing, "a capturing stream cannot synchronize"
        self.cuda.log.append(("sync", self.name))

    def begin_capture(self):
        self.capturing = True
        self.cuda.log.append(("begin", self.name))

    def end_capture(self):
        self.capturing = False
        self.cuda.log.append(("end", self.name))
        return _Graph(self.cuda.log)


class _FakeCuda:
    def __init__(self):
        self.log = []
        self.null = _Stream(self, "null", 0)
        self.stack = [self.null]
        self.allocator = None

    def Stream(self, non_blocking=False):  # noqa: N802 (CuPy's name)
        assert non_blocking, "capture needs a non-default stream"
        return _Stream(self, "graph", 0x77)

    def MemoryPool(self):  # noqa: N802
        return type("Pool", (), {"malloc": lambda self, n: n})()

    @contextlib.contextmanager
    def using_allocator(self, malloc):
        previous, self.allocator = self.allocator, malloc
        try:
            yield
        finally:
            self.allocator = previous

    def get_current_stream(self):
        return self.stack[-1]


class _FakeCupy:
    def __init__(self):
        self.cuda = _FakeCuda()
        self.cuda.device = type("Device", (), {"get_cublas_handle": staticmethod(lambda: 1)})()

    def empty(self, n, dtype):
        return np.empty(n, dtype)  # the cuBLAS workspace


def _capturing_backend(monkeypatch):
    xp = _FakeCupy()
    lib = FakeCublas()
    monkeypatch.setattr(cublas, "load_library", lambda: lib)
    backend = CudaBackend._with_launcher(xp, lambda *a: None, lambda a: a.ctypes.data, num_sms=4)
    backend.device = object()  # a "device": capture is allowed
    return backend, xp.cuda, lib


def test_capture_graph_warms_up_then_captures_on_its_stream_with_its_pool_and_handle(monkeypatch):
    backend, cuda, lib = _capturing_backend(monkeypatch)
    seen = []

    def fn():
        stream = cuda.get_current_stream()
        seen.append((stream.name, stream.capturing, cuda.allocator is not None, backend.ctx.capture_blas is not None))
        return "logits"

    replay, output = backend.capture_graph(fn)
    assert output == "logits"
    assert seen == [("graph", False, True, True), ("graph", True, True, True)]
    assert backend.ctx.capture_blas is None and cuda.allocator is None and cuda.get_current_stream() is cuda.null
    assert [e for e in cuda.log if e[0] != "sync"] == [("begin", "graph"), ("end", "graph")]
    assert ("stream", 0x1234, 0x77) in lib.calls  # the handle is bound to the capture stream
    with _Stream(cuda, "serving", 1):
        replay()
    assert cuda.log[-1] == ("launch", "serving")  # replays go on the caller's current stream
    backend.capture_graph(fn)
    assert sum(c[0] == "create" for c in lib.calls) == 1  # one handle, stream and pool for all graphs


def test_a_failed_capture_ends_the_capture_and_drops_the_handle(monkeypatch):
    backend, cuda, _ = _capturing_backend(monkeypatch)
    calls = []

    def fn():
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        backend.capture_graph(fn)
    assert cuda.log[-1] == ("end", "graph") and backend.ctx.capture_blas is None and cuda.allocator is None


def test_capture_needs_a_device():
    backend = CudaBackend._with_launcher(np, lambda *a: None, lambda a: a.ctypes.data, num_sms=4)
    assert not backend.supports_cuda_graphs
    with pytest.raises(RuntimeError, match="GPU"):
        backend.capture_graph(lambda: None)


def test_linear_goes_through_the_capture_handle_while_capturing():
    """float32 (and float32-out) products route to ``cublasGemmEx`` on the capture handle, bias included,
    instead of CuPy's matmul, which refuses to run under capture."""
    rng = np.random.default_rng(1)
    backend = CudaBackend._with_launcher(np, lambda *a: None, lambda a: a.ctypes.data, num_sms=4)
    lib = FakeCublas()
    backend.ctx.capture_blas = cublas.CublasHandle(lib, 1, 2, 3)
    x = rng.standard_normal((3, 8)).astype(np.float32)
    w = rng.standard_normal((5, 8)).astype(np.float32)
    bias = rng.standard_normal(5).astype(np.float32)
    np.testing.assert_allclose(backend.linear(x, w), x @ w.T, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(backend.linear(x, w, bias), x @ w.T + bias, rtol=1e-5, atol=1e-5)
    y = backend.linear(x, w, float32_out=True)
    assert y.dtype == np.float32
    np.testing.assert_allclose(y, x @ w.T, rtol=1e-5, atol=1e-5)
    assert sum(c[0] == "gemm" for c in lib.calls) == 3
