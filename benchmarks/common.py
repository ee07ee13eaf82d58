"""Helpers shared by the benchmark scripts: conditions of the run, timing, table and JSON output."""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from pathlib import Path


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
