"""cuBLAS through ``ctypes`` on a handle bound once to one stream: matrix products a CUDA graph can capture.

CuPy's cuBLAS wrappers set the handle's stream before every call and refuse to while the stream
captures (``NotImplementedError: calling cuBLAS API during stream capture is currently unsupported``).
cuBLAS itself supports capture when the handle's stream is the capturing stream and the handle has a
workspace of its own, so it allocates nothing during capture (cuBLAS documentation, "CUDA Graphs
Support"; PyTorch and vLLM capture cuBLAS the same way). :class:`CublasHandle` creates its handle,
binds it to the capture stream and gives it a workspace, once; :func:`gemm_nt` is the one product the
model needs, ``y = x @ w.T`` for row-major ``x [n, k]`` and HF-layout ``w [m, k]``.

The library is the ``libcublas`` CuPy already loaded into the process (found in ``/proc/self/maps``), or
else the first of :data:`SONAMES` the loader finds.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

# cuBLAS / CUDA enum values (cublas_api.h, library_types.h); stable across CUDA 11-13.
OP_N, OP_T = 0, 1
CUDA_R_32F, CUDA_R_16F, CUDA_R_16BF = 0, 2, 14
COMPUTE_32F = 68
GEMM_DEFAULT = -1
#: workspace per handle: cuBLAS's recommendation for Hopper is 32 MiB (4 MiB before it)
WORKSPACE_BYTES = 32 << 20
SONAMES = ("libcublas.so.13", "libcublas.so.12", "libcublas.so.11", "libcublas.so")

_GEMM_EX_ARGTYPES = [
    ctypes.c_void_p,  # handle
    ctypes.c_int,  # transa
    ctypes.c_int,  # transb
    ctypes.c_int,  # m
    ctypes.c_int,  # n
    ctypes.c_int,  # k
    ctypes.c_void_p,  # alpha (host pointer)
    ctypes.c_void_p,  # A
    ctypes.c_int,  # Atype
    ctypes.c_int,  # lda
    ctypes.c_void_p,  # B
    ctypes.c_int,  # Btype
    ctypes.c_int,  # ldb
    ctypes.c_void_p,  # beta (host pointer)
    ctypes.c_void_p,  # C
    ctypes.c_int,  # Ctype
    ctypes.c_int,  # ldc
    ctypes.c_int,  # computeType
    ctypes.c_int,  # algo
]


def loaded_library_path(maps: str | None = None) -> str | None:
    """Path of the ``libcublas.so*`` mapped into this process (not ``libcublasLt``), or None.
    ``maps``: the text of ``/proc/self/maps`` (read when None)."""
    if maps is None:
        try:
            maps = Path("/proc/self/maps").read_text()
        except OSError:
            return None
    for line in maps.splitlines():
        parts = line.split(maxsplit=5)
        if len(parts) == 6 and Path(parts[5]).name.startswith("libcublas.so"):
            return parts[5]
    return None


def load_library():
    """The cuBLAS shared library as a ``ctypes.CDLL`` with ``cublasGemmEx``'s argument types set.
    Raises OSError naming the sonames tried when none loads."""
    tried = []
    for name in filter(None, (loaded_library_path(), *SONAMES)):
        try:
            lib = ctypes.CDLL(name)
        except OSError as e:
            tried.append(f"{name}: {e}")
            continue
        lib.cublasGemmEx.argtypes = _GEMM_EX_ARGTYPES
        lib.cublasGemmEx.restype = ctypes.c_int
        return lib
    raise OSError("cuBLAS not found for CUDA-graph capture; tried " + "; ".join(tried))


def _check(status: int, what: str) -> None:
    if status != 0:
        raise RuntimeError(f"{what} failed with cublasStatus_t {status}")


class CublasHandle:
    """A cuBLAS handle bound to ``stream_ptr`` with its own workspace, for products captured in a graph.

    Args:
        lib: the library (:func:`load_library`, or a stand-in with the same functions in tests).
        stream_ptr: ``cudaStream_t`` as an int (the capturing stream).
        workspace_ptr, workspace_bytes: device memory the handle may use (kept alive by the caller).
    Raises:
        RuntimeError: a cuBLAS call returned an error status.
    """

    def __init__(self, lib, stream_ptr: int, workspace_ptr: int, workspace_bytes: int = WORKSPACE_BYTES):
        self.lib = lib
        handle = ctypes.c_void_p()
        _check(lib.cublasCreate_v2(ctypes.byref(handle)), "cublasCreate")
        self.handle = handle
        try:
            _check(lib.cublasSetStream_v2(handle, ctypes.c_void_p(stream_ptr)), "cublasSetStream")
            _check(
                lib.cublasSetWorkspace_v2(handle, ctypes.c_void_p(workspace_ptr), ctypes.c_size_t(workspace_bytes)),
                "cublasSetWorkspace",
            )
        except RuntimeError:
            self.close()
            raise

    def gemm_ex(self, transa, transb, m, n, k, alpha, a, a_type, lda, b, b_type, ldb, beta, c, c_type, ldc):
        """``cublasGemmEx`` (column-major ``C = alpha op(A) op(B) + beta C``, float32 compute); ``alpha``
        and ``beta`` are host addresses of float32 scalars, ``a``/``b``/``c`` device addresses."""
        status = self.lib.cublasGemmEx(
            self.handle,
            transa,
            transb,
            m,
            n,
            k,
            alpha,
            a,
            a_type,
            lda,
            b,
            b_type,
            ldb,
            beta,
            c,
            c_type,
            ldc,
            COMPUTE_32F,
            GEMM_DEFAULT,
        )
        _check(status, "cublasGemmEx")

    def close(self) -> None:
        if self.handle is not None:
            self.lib.cublasDestroy_v2(self.handle)
            self.handle = None


def gemm_nt(gemm_ex, x_ptr, w_ptr, y_ptr, n, m, k, in_type, out_type, alpha_ptr, beta_ptr) -> None:
    """Row-major ``y [n, m] = x [n, k] @ w [m, k].T`` (C-contiguous) through ``gemm_ex`` (the signature
    of :meth:`CublasHandle.gemm_ex`): in cuBLAS's column-major terms that is ``y^T [m, n] = W^T x^T``
    where the row-major ``w`` is a column-major ``[k, m]`` matrix, hence ``OP_T`` on it and ``OP_N`` on
    ``x`` (a column-major ``[k, n]``)."""
    gemm_ex(OP_T, OP_N, m, n, k, alpha_ptr, w_ptr, in_type, k, x_ptr, in_type, k, beta_ptr, y_ptr, out_type, m)
