"""How the CPU kernels are compiled: Numba's options, and the serial and thread-parallel twins of a
``prange`` kernel."""

from __future__ import annotations

import types

import numba as nb
from numba.core.dispatcher import Dispatcher

#: the kernels' Numba options; ``fastmath`` lets LLVM reassociate float32 sums into vectors
JIT = dict(cache=True, nogil=True, fastmath=True)


def copy_function(fn, name):
    """A copy of a plain function under another name (so two jitted variants cache separately)."""
    new = types.FunctionType(fn.__code__.replace(co_name=name), fn.__globals__, name, fn.__defaults__, fn.__closure__)
    new.__qualname__ = name
    return new


#: every (serial, parallel) pair ``jit_serial_and_parallel`` made, for ``compile_twins``
TWINS: list = []


def jit_serial_and_parallel(fn, **options):
    """Two compiled versions of a prange kernel: serial, for small work, where waking the thread pool
    (next to BLAS's own threads) costs more than the work itself, and parallel. ``options``: Numba's
    (default ``JIT``). The pair is kept in ``TWINS``: a caller picks one of the two by the size of the
    work, so a warm-up that ran one gets the other compiled too (``compile_twins``)."""
    options = options or JIT
    serial = nb.njit(**options)(fn)
    parallel = nb.njit(parallel=True, **options)(copy_function(fn, fn.__name__ + "_parallel"))
    TWINS.append((serial, parallel))
    return serial, parallel


def compile_twins() -> int:
    """Compile (or load from Numba's cache) each twin's signatures that the other of its pair has, so that
    whichever of the two the work's size picks is ready. Returns the number of signatures added."""
    added = 0
    for pair in TWINS:
        for have, other in (pair, pair[::-1]):
            for sig in set(have.signatures) - set(other.signatures):
                other.compile(sig)
                added += 1
    return added


def kernel_signatures(modules) -> dict:
    """``{"module.name": number of compiled signatures}`` of every Numba dispatcher bound at the top
    level of ``modules`` (a dispatcher gains one each time it compiles or loads from the cache a new
    argument-type signature; a kernel that gains none serves from what it has)."""
    out = {}
    for module in modules:
        for name, value in vars(module).items():
            if isinstance(value, Dispatcher):
                out[f"{module.__name__}.{name}"] = len(value.signatures)
    return out
