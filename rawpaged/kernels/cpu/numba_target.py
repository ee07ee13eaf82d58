"""Let Numba's LLVM use 512-bit vectors on AVX-512 hosts, as a ``-march=native`` C build does.

LLVM's tuning for Intel server cores (skylake-avx512 onwards) prefers 256-bit vectors, so Numba kernels
run at half the vector width the host has. Our memory-bound decode kernels (the quantized GEMVs of
``quant``) are compute-bound at that width: 512-bit vectors made the Q4_1 GEMV 2.1x faster on one
thread of a Xeon (Emerald Rapids) in one side-by-side run.

``configure()`` sets ``NUMBA_CPU_FEATURES`` to the host's features plus ``-prefer-256-bit``, which Numba
reads once, when it is imported. It is called first thing by ``import rawpaged`` and does nothing when:

- the host has no AVX-512 (``avx512f``), or is not x86;
- ``NUMBA_CPU_FEATURES`` or ``NUMBA_CPU_NAME`` is already set (the user's choice wins);
- ``RAWPAGED_NUMBA_PREFER_512=0`` (keep LLVM's default width);
- numba was imported before rawpaged (too late: its configuration is read).

The setting is process-wide: other Numba code in the process also gets the wider vectors.
"""

from __future__ import annotations

import os
import sys

OPT_OUT = "RAWPAGED_NUMBA_PREFER_512"


def cpu_features(host_features, environ) -> str | None:
    """The ``NUMBA_CPU_FEATURES`` value for a host (a mapping feature name -> enabled, as llvmlite's
    ``get_host_cpu_features()``) and an environment, or None to leave Numba's defaults."""
    if environ.get(OPT_OUT, "1") == "0":
        return None
    if environ.get("NUMBA_CPU_FEATURES") or environ.get("NUMBA_CPU_NAME"):
        return None
    if not host_features.get("avx512f"):
        return None
    flags = ",".join(("+" if on else "-") + name for name, on in sorted(host_features.items()))
    return flags + ",-prefer-256-bit"


def configure(environ=None) -> str | None:
    """Set ``NUMBA_CPU_FEATURES`` in ``environ`` (default ``os.environ``) as the module docstring says,
    unless numba is already imported. Returns the value set, or None when it left the environment alone."""
    environ = os.environ if environ is None else environ
    if "numba" in sys.modules:
        return None
    try:
        import llvmlite.binding as llvm  # deferred: LLVM, loaded only before Numba is

        host = llvm.get_host_cpu_features()
    except Exception:  # no host feature query on this platform: leave LLVM's defaults
        return None
    value = cpu_features(host, environ)
    if value is not None:
        environ["NUMBA_CPU_FEATURES"] = value
    return value
