"""How the CUDA backend reaches a device: ``KernelContext`` (everything a kernel call needs), the CuPy
launcher that compiles one ``RawModule`` per (activation, cache) dtype pair, and the argument helpers
every launch uses (C++ element types, int32/int64 scalars, row strides).

The plain functions of ``cache``, ``attention``, ``elementwise``, ``sampling``, ``linear`` and
``weights`` take a ``KernelContext`` first; ``backend.CudaBackend`` holds one. The CPU emulation tests
build one over NumPy and the g++-compiled kernels instead of CuPy and a GPU.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from rawpaged.dtypes import FLOAT_TYPES
from rawpaged.kernels.cuda import launch_config, program
from rawpaged.kernels.kv_cache import QuantizedKVCache

#: Device storage dtype -> C++ element type.
CTYPES = {t.device: t.cxx for t in FLOAT_TYPES.values()}
#: dynamic shared memory a block gets without opting in
DEFAULT_SMEM = 48 * 1024
MEMCPY_HOST_TO_DEVICE = 1  # cudaMemcpyHostToDevice


@functools.cache
def instantiated(act: str, cache: str) -> frozenset:
    """The kernel names compiled into the module of one (activation, cache) C++ dtype pair."""
    return frozenset(program.name_expressions(act, cache))


def ctype(a, what: str) -> str:
    """The C++ element type of array ``a`` (uint16 storage is bfloat16). Raises ValueError naming ``what``
    for any other dtype."""
    try:
        return CTYPES[np.dtype(a.dtype)]
    except KeyError:
        raise ValueError(f"{what} dtype must be float32, float16 or bfloat16 (uint16 bits), got {a.dtype}") from None


#: a null pointer argument (an operand a kernel does not read)
NULL = np.uint64(0)


def kv_cache_operands(cache, what: str) -> tuple:
    """``(C++ element type, values, scales)`` of one layer's cache as the kernels take it: a float array
    with ``NULL`` scales, or a ``QuantizedKVCache``'s values and scales. Raises ValueError naming ``what``
    for any other dtype."""
    if isinstance(cache, QuantizedKVCache):
        return cache.kind.cxx, cache.data, cache.scales
    return ctype(cache, what), cache, NULL


def i32(v) -> np.int32:
    return np.int32(v)


def i64(v) -> np.int64:
    return np.int64(v)


def row_stride(a, what: str, inner_dims: int) -> int:
    """Element stride of axis 0 of ``a``, checking that the last ``inner_dims`` axes are contiguous
    (ValueError naming ``what`` otherwise)."""
    item = a.dtype.itemsize
    expect = item
    for ax in range(a.ndim - 1, a.ndim - 1 - inner_dims, -1):
        if a.shape[ax] > 1 and a.strides[ax] != expect:
            raise ValueError(f"{what}: the last {inner_dims} axes must be contiguous (strides {a.strides})")
        expect *= a.shape[ax]
    if a.strides[0] % item:
        raise ValueError(f"{what}: misaligned stride {a.strides}")
    return a.strides[0] // item if a.shape[0] > 1 else int(np.prod(a.shape[1:]))


def host_byte_copy(dst, host) -> None:
    """``copy_to_device`` for array modules whose arrays live on the host (the emulation tests)."""
    dst.reshape(-1).view(np.uint8)[...] = np.ascontiguousarray(host).reshape(-1).view(np.uint8)


class CupyLauncher:
    """Compiles one RawModule per (activation, cache) dtype pair on first use and launches its kernels.

    ``modules`` maps the pairs compiled so far to their modules."""

    def __init__(self, cupy):
        self._cupy = cupy
        self.modules: dict[tuple[str, str], object] = {}
        self._functions: dict[tuple[str, str, str], object] = {}

    def module(self, act: str, cache: str):
        key = (act, cache)
        if key not in self.modules:
            self.modules[key] = self._cupy.RawModule(
                code=program.module_source(),
                options=program.RUNTIME_OPTIONS + program.include_options(),
                name_expressions=program.name_expressions(act, cache),
            )
        return self.modules[key]

    def _function(self, act, cache, name):
        key = (act, cache, name)
        if key not in self._functions:
            self._functions[key] = self.module(act, cache).get_function(name)
        return self._functions[key]

    def __call__(self, act, cache, name, grid, block, args, smem_bytes=0):
        fn = self._function(act, cache, name)
        if smem_bytes > DEFAULT_SMEM and fn.max_dynamic_shared_size_bytes < smem_bytes:
            fn.max_dynamic_shared_size_bytes = smem_bytes
        fn(tuple(grid), tuple(block), tuple(args), shared_mem=int(smem_bytes))

    def static_smem_bytes(self, act, cache, name) -> int:
        """The kernel's static ``__shared__`` bytes, as the driver reports them."""
        fn = self._function(act, cache, name)
        return int(getattr(fn, "shared_size_bytes", launch_config.SAMPLE_STATIC_SMEM_BYTES))

    @staticmethod
    def address(a) -> int:
        return int(a.data.ptr)


@dataclass
class KernelContext:
    """What a kernel call needs of the device.

    Attributes:
        xp: the array module (CuPy; NumPy in the emulation tests).
        launch: ``launch(act, cache, name, grid, block, args, smem_bytes)`` runs one kernel instantiation.
        address: device address of an array (``int``).
        num_sms: the device's streaming multiprocessors (sizes grids and split-K partitions).
        max_smem_optin: the most shared memory a block may opt in to, in bytes.
        copy_to_device: ``copy_to_device(dst, host)`` moves a NumPy array's bytes into a device array.
        capture_blas: the cuBLAS handle bound to the stream a CUDA graph is being captured on, while one
            is (``graphs.GraphCapture``); None otherwise.
    """

    xp: Any
    launch: Callable
    address: Callable
    num_sms: int
    max_smem_optin: int
    copy_to_device: Callable = host_byte_copy
    capture_blas: Any = None

    def kernel(self, act, cache, name, grid, block, args, smem_bytes=0) -> None:
        """Launch the instantiation ``name`` of the (``act``, ``cache``) module.

        Raises:
            ValueError: ``name`` is not instantiated for that pair (``program.name_expressions``), or it
                asks for more shared memory than the device allows.
        """
        if name not in instantiated(act, cache):
            raise ValueError(
                f"kernel {name} is not instantiated for activations {act} / cache {cache}; "
                f"add it to rawpaged/kernels/cuda/program.py"
            )
        if smem_bytes > self.max_smem_optin:
            raise ValueError(
                f"{name} needs {smem_bytes} bytes of shared memory per block; this GPU allows {self.max_smem_optin}"
            )
        self.launch(act, cache, name, grid, block, args, smem_bytes)

    def to_device(self, a, dtype):
        """``a`` as a contiguous device array of ``dtype`` (uploads host arrays)."""
        return self.xp.ascontiguousarray(self.xp.asarray(a, dtype=dtype))
