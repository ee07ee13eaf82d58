"""Helpers shared by the benchmark scripts: conditions of the run, timing, table and JSON output."""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path


def blas_kernel() -> str:
    """The OpenBLAS core NumPy's BLAS runs (``SkylakeX``, ``Haswell``, ...), plus the OPENBLAS_*
    variables that steer it, or "unknown"."""
    import ctypes

    import numpy as np  # noqa: F401 (loads the BLAS library)

    names = []
    try:
        libs = {line.split()[-1] for line in open("/proc/self/maps") if "openblas" in line.lower()}
    except OSError:
        libs = set()
    for lib in sorted(p for p in libs if ".so" in p):
        handle = ctypes.CDLL(lib)
        for sym in ("scipy_openblas_get_corename64_", "openblas_get_corename64_", "openblas_get_corename"):
            f = getattr(handle, sym, None)
            if f is not None:
                f.restype = ctypes.c_char_p
                names.append(f().decode())
                break
    env = {k: v for k, v in os.environ.items() if k in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")}
    return (", ".join(names) or "unknown") + (f" ({env})" if env else " (OPENBLAS_CORETYPE/L2_SIZE unset)")


def read_bandwidth(nbytes: int = 512 << 20, repeats: int = 10) -> float:
    """Read-only memory bandwidth in bytes/s: the best of ``repeats`` parallel float32 sums over
    ``nbytes`` (beyond any cache), on all Numba threads, each chunk a slice summed with reassociation
    (so LLVM keeps several vector sums in flight). The ceiling a memory-bound decode step streams its
    weights against. (Index arithmetic that LLVM cannot prove non-negative, such as ``a[8 * i + j]``
    over ``range(lo, hi)``, keeps Numba's loads scalar: an earlier version measured 0.65x of this.)"""
    import numba as nb
    import numpy as np

    @nb.njit(parallel=True, fastmath=True, cache=False)
    def total(a):
        n = a.shape[0]
        chunks = 64
        out = np.zeros(chunks, np.float32)
        for c in nb.prange(chunks):
            part = a[c * n // chunks : (c + 1) * n // chunks]
            acc = np.float32(0.0)
            for i in range(part.shape[0]):
                acc += part[i]
            out[c] = acc
        return out.sum()

    a = np.ones(nbytes // 4, np.float32)
    total(a)
    best = min(timed(lambda: total(a)) for _ in range(repeats))
    return a.nbytes / best


def timed(fn) -> float:
    """Seconds one call of ``fn()`` takes."""
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def conditions(**extra) -> dict:
    """What a reader needs to interpret the numbers: machine, software, and the run's own settings."""
    import numba
    import numpy as np

    cpu = platform.processor() or "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "numba_threads": numba.config.NUMBA_NUM_THREADS,
        "numba_vectors": "512-bit preferred"
        if (numba.config.CPU_FEATURES or "").endswith("-prefer-256-bit")
        else "LLVM default width",
        "blas": blas_kernel(),
        "python": platform.python_version(),
        "numpy": np.__version__,
        "numba": numba.__version__,
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        **extra,
    }


def best_time(fn, repeat: int = 5, min_time: float = 0.2) -> float:
    """Median of ``repeat`` measurements, each averaging enough calls to last ``min_time`` seconds."""
    fn()  # warm-up (JIT compile, caches)
    t0 = time.perf_counter()
    fn()
    once = max(time.perf_counter() - t0, 1e-6)
    calls = max(1, int(min_time / once))
    samples = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        samples.append((time.perf_counter() - t0) / calls)
    return statistics.median(samples)


def print_table(rows: list, columns: list) -> None:
    widths = [max(len(c), *(len(_fmt(r.get(c))) for r in rows)) for c in columns]
    print("  ".join(c.rjust(w) for c, w in zip(columns, widths)))
    for r in rows:
        print("  ".join(_fmt(r.get(c)).rjust(w) for c, w in zip(columns, widths)))


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 100 else f"{v:.0f}"
    return str(v)


def write_json(path, payload: dict) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2))
    print(f"wrote {path}")


RSS_SCRIPT = """
import json, sys
from pathlib import Path
def rss(key):
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key):
            return int(line.split()[1]) * 1024
before = rss("VmRSS:")
from rawpaged import LLM, SamplingParams
imported = rss("VmRSS:")
llm = LLM(model=sys.argv[1], device="cpu", **json.loads(sys.argv[2]))
loaded = rss("VmRSS:")
runner = llm.engine.runner
kv = sum(int(getattr(c, "nbytes", 0)) for c in list(runner.key_caches) + list(runner.value_caches))
llm.generate({"prompt_token_ids": list(range(3, 67))}, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
print(json.dumps({"rss_at_start_bytes": before, "rss_after_import_bytes": imported, "rss_after_load_bytes": loaded,
                  "rss_after_generate_bytes": rss("VmRSS:"), "peak_rss_bytes": rss("VmHWM:"), "kv_pool_bytes": kv}))
"""


def fresh_process_memory(model, engine_args: dict, env=None) -> dict:
    """Absolute resident memory of a fresh CPU process on ``model`` (``RSS_SCRIPT``): at start, after
    importing rawpaged, after loading the model, after a short generation, and its peak, with the KV pool's
    bytes and the file's (a delta taken inside a process that loaded another model first is wrong: freeing
    that one's memory made it negative)."""
    out = subprocess.run(
        [sys.executable, "-c", RSS_SCRIPT, str(model), json.dumps(engine_args)],
        capture_output=True,
        text=True,
        check=True,
        cwd=Path(__file__).resolve().parents[1],
        env=env,
    ).stdout
    res = json.loads(out.strip().splitlines()[-1])
    res["file_bytes"] = Path(model).stat().st_size if Path(model).is_file() else None
    return res
