"""How the CPU kernels are compiled: Numba's options, and the serial and thread-parallel twins of a
``prange`` kernel."""

from __future__ import annotations

import types

import numba as nb

#: the kernels' Numba options; ``fastmath`` lets LLVM reassociate float32 sums into vectors
JIT = dict(cache=True, nogil=True, fastmath=True)


def copy_function(fn, name):
    """A copy of a plain function under another name (so two jitted variants cache separately)."""
    new = types.FunctionType(fn.__code__.replace(co_name=name), fn.__globals__, name, fn.__defaults__, fn.__closure__)
    new.__qualname__ = name
    return new


def jit_serial_and_parallel(fn):
    """Two compiled versions of a prange kernel: serial, for small work, where waking the thread pool
    (next to BLAS's own threads) costs more than the work itself, and parallel."""
    serial = nb.njit(**JIT)(fn)
    parallel = nb.njit(parallel=True, **JIT)(copy_function(fn, fn.__name__ + "_parallel"))
    return serial, parallel
