"""Shorten how long OpenBLAS's idle threads spin before they sleep.

After each call, OpenBLAS's worker threads busy-wait for new work for ``2^OPENBLAS_THREAD_TIMEOUT`` cycles
(default 2^28, about 0.1 s at 2.7 GHz) before they sleep. The Numba kernels that run next need the same
cores: on a 2-core host the first decode step after a prefill (whose products go through SGEMM) took
91-124 ms where the next ones took 40-55 ms, and with 2^16 cycles (about 25 us) 35-50 ms like the rest,
while the prefill steps themselves kept their speed (benchmarks/RESULTS.md).

``configure()`` sets ``OPENBLAS_THREAD_TIMEOUT`` to ``THREAD_TIMEOUT``, which OpenBLAS reads once, when it
is loaded (when numpy is imported). It is called first thing by ``import rawpaged`` and does nothing when
the variable is already set (the user's choice wins) or numpy was imported before rawpaged (too late).
"""

from __future__ import annotations

import os
import sys

#: log2 of the cycles an idle OpenBLAS thread spins (OpenBLAS accepts 4-30)
THREAD_TIMEOUT = 16


def configure(environ=None, modules=None) -> str | None:
    """Set ``OPENBLAS_THREAD_TIMEOUT`` in ``environ`` (default ``os.environ``) unless it is set or numpy is
    in ``modules`` (default ``sys.modules``). Returns the value set, or None."""
    environ = os.environ if environ is None else environ
    modules = sys.modules if modules is None else modules
    if "numpy" in modules or "OPENBLAS_THREAD_TIMEOUT" in environ:
        return None
    environ["OPENBLAS_THREAD_TIMEOUT"] = str(THREAD_TIMEOUT)
    return environ["OPENBLAS_THREAD_TIMEOUT"]
