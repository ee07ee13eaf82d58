"""Build and drive the CPU emulation of the CUDA kernels (``cuda_emu.h``) from Python.

:func:`build` compiles the real ``cuda/*.cu`` sources with g++ against the emulation header into a shared
library (one registered launcher per NVRTC name expression of ``rawpaged.kernels.cuda.program``), cached
under the system temp dir keyed by a hash of every input. :class:`Emulator` launches kernels through it
like ``cuLaunchKernel`` (a pointer per argument), checking each argument against the kernel's parameter
list the way the GPU never would: a NumPy scalar of the right size and kind for every scalar parameter, an
array of the right element size for every pointer, no Python scalars (CuPy would pass those as 64-bit).
:func:`emulated_backend` gives a :class:`rawpaged.kernels.cuda.CudaBackend` whose arrays are NumPy arrays
and whose kernels run here, so the runtime's own launch code is what the tests exercise.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import struct
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from rawpaged.kernels.cuda import program

HERE = Path(__file__).resolve().parent
SHIM = HERE / "shim"
CXXFLAGS = ("-std=c++17", "-O1", "-fPIC", "-pthread", "-Wall", "-Wno-unknown-pragmas", "-Werror")
TSAN_FLAGS = ("-fsanitize=thread", "-g")


def missing_requirements() -> str | None:
    """Why the emulation cannot be built here, or None."""
    if shutil.which("g++") is None:
        return "g++ not found"
    if not _fp16_include_dir():
        return "cuda_fp16.h not found: pip install nvidia-cuda-runtime-cu12 (the test extra)"
    return None


def _fp16_include_dir() -> str | None:
    dirs = program.cuda_include_dirs()
    return dirs[0] if dirs else None


#: Kernels used only by the emulation's own self-test (selftest.cu).
SELFTEST_NAMES = ("neighbour_exchange_kernel<true>", "neighbour_exchange_kernel<false>")


def _inputs() -> list[Path]:
    files = [HERE / "cuda_emu.h", HERE / "selftest.cu", HERE / "replay_main.cpp", *sorted(SHIM.rglob("*"))]
    files += [program.CUDA_DIR / program.HEADER] + [program.CUDA_DIR / f for f in program.SOURCE_FILES]
    return [f for f in files if f.is_file()]


def _translation_unit(names: list[str], define_api: bool) -> str:
    lines = ["#define EMU_DEFINE_API 1"] if define_api else []
    lines.append('#include "cuda_emu.h"')
    lines += [f'#include "{program.CUDA_DIR / f}"' for f in program.SOURCE_FILES]
    lines.append('#include "selftest.cu"')
    lines.append("namespace {")
    lines.append("[[maybe_unused]] const bool registered[] = {")
    lines += [f'    emu::reg("{n}", &{n}),' for n in names]
    lines.append("    true};")
    lines.append("}  // namespace")
    return "\n".join(lines) + "\n"


def build(names: list[str] | None = None, tsan: bool = False, replay: bool = False, jobs: int | None = None) -> Path:
    """Compile (or reuse) the emulation holding ``names`` (default: every name expression, plus the
    self-test kernels): a shared library for ctypes, or with ``replay`` the standalone replay executable
    (``replay_main.cpp``); ``tsan`` builds with ``-fsanitize=thread``."""
    names = list(names) if names is not None else program.all_name_expressions() + list(SELFTEST_NAMES)
    flags = list(CXXFLAGS) + (list(TSAN_FLAGS) if tsan else [])
    inc = _fp16_include_dir()
    h = hashlib.sha256()
    for f in _inputs():
        h.update(str(f.name).encode() + b"\0" + f.read_bytes())
    version = subprocess.run(["g++", "--version"], capture_output=True, text=True).stdout
    h.update("\0".join(names + flags + [str(inc), version, str(replay)]).encode())
    out_dir = Path(tempfile.gettempdir()) / "rawpaged_cuda_emu" / h.hexdigest()[:20]
    lib = out_dir / (("emu_replay" if replay else "libemu") + ("_tsan" if tsan else "") + ("" if replay else ".so"))
    if lib.exists():
        return lib
    out_dir.mkdir(parents=True, exist_ok=True)
    jobs = jobs or max(1, min(4, os.cpu_count() or 1))
    parts = [names[i::jobs] for i in range(jobs)]
    include = ["-I", str(HERE), "-isystem", str(SHIM), "-isystem", inc]
    tmp = Path(tempfile.mkdtemp(dir=out_dir))

    def compile_part(i: int) -> Path:
        cpp = tmp / f"tu{i}.cpp"
        cpp.write_text(_translation_unit(parts[i], define_api=(i == 0)))
        obj = tmp / f"tu{i}.o"
        r = subprocess.run(["g++", *flags, *include, "-c", str(cpp), "-o", str(obj)], capture_output=True, text=True)
        if r.returncode:
            raise RuntimeError(f"g++ failed on the emulated kernels:\n{r.stderr[-8000:]}")
        return obj

    with ThreadPoolExecutor(jobs) as pool:
        objs = list(pool.map(compile_part, range(jobs)))
    tmp_lib = tmp / lib.name
    link = [str(HERE / "replay_main.cpp")] if replay else ["-shared"]
    r = subprocess.run(
        ["g++", *flags, *include, *link, *map(str, objs), "-o", str(tmp_lib)], capture_output=True, text=True
    )
    if r.returncode:
        raise RuntimeError(f"linking the emulation library failed:\n{r.stderr[-8000:]}")
    os.replace(tmp_lib, lib)
    shutil.rmtree(tmp, ignore_errors=True)
    return lib


_INT_CTYPES = {("i", 4): ctypes.c_int32, ("i", 8): ctypes.c_int64, ("u", 4): ctypes.c_uint32, ("u", 8): ctypes.c_uint64}
_FLOAT_CTYPES = {4: ctypes.c_float, 8: ctypes.c_double}


class Emulator:
    """Kernel launches into a library made by :func:`build`."""

    def __init__(self, lib_path: Path):
        self.lib = ctypes.CDLL(str(lib_path))
        self.lib.emu_num_kernels.restype = ctypes.c_int
        self.lib.emu_kernel_name.restype = ctypes.c_char_p
        self.lib.emu_kernel_name.argtypes = [ctypes.c_int]
        self.lib.emu_param_info.restype = ctypes.c_int
        self.lib.emu_param_info.argtypes = [
            ctypes.c_char_p,
            ctypes.c_int,
            ctypes.POINTER(ctypes.c_ulonglong),
            ctypes.POINTER(ctypes.c_ulonglong),
            ctypes.c_char_p,
        ]
        self.lib.emu_launch.restype = ctypes.c_int
        self.lib.emu_launch.argtypes = (
            [ctypes.c_char_p]
            + [ctypes.c_uint] * 6
            + [ctypes.c_ulonglong, ctypes.POINTER(ctypes.c_void_p), ctypes.c_int]
        )
        self._info: dict[str, tuple] = {}
        self.launches: list[tuple] = []  # (name, grid, block, smem) of every launch, for tests to inspect

    def names(self) -> list[str]:
        return [self.lib.emu_kernel_name(i).decode() for i in range(self.lib.emu_num_kernels())]

    def param_info(self, name: str):
        if name not in self._info:
            sizes = (ctypes.c_ulonglong * 64)()
            pointees = (ctypes.c_ulonglong * 64)()
            kinds = ctypes.create_string_buffer(65)
            n = self.lib.emu_param_info(name.encode(), 64, sizes, pointees, kinds)
            if n < 0:
                raise KeyError(f"kernel {name!r} is not in the emulation library")
            self._info[name] = (list(sizes[:n]), list(pointees[:n]), kinds.raw[:n].decode())
        return self._info[name]

    def launch(self, name: str, grid, block, args, smem_bytes: int = 0):
        sizes, pointees, kinds = self.param_info(name)
        if len(args) != len(sizes):
            raise TypeError(f"{name}: {len(args)} arguments for {len(sizes)} parameters")
        holders = []
        ptrs = (ctypes.c_void_p * max(1, len(args)))()
        for i, (a, size, pointee, kind) in enumerate(zip(args, sizes, pointees, kinds)):
            where = f"{name} argument {i}"
            if isinstance(a, np.ndarray):
                if kind != "p":
                    raise TypeError(f"{where}: array passed for a scalar parameter")
                if a.dtype.itemsize != pointee:
                    raise TypeError(f"{where}: {a.dtype} array for a pointer to {pointee}-byte elements")
                c = ctypes.c_void_p(a.ctypes.data)
            elif isinstance(a, np.generic):
                if kind == "p":
                    if a.dtype != np.uint64:
                        raise TypeError(f"{where}: pointer parameter needs an array or a uint64 address")
                    c = ctypes.c_uint64(int(a))
                elif kind == "f":
                    if a.dtype.kind != "f" or a.dtype.itemsize != size:
                        raise TypeError(f"{where}: {a.dtype} for a {size}-byte float parameter")
                    c = _FLOAT_CTYPES[size](float(a))
                else:
                    if a.dtype.kind not in "iu" or a.dtype.itemsize != size:
                        raise TypeError(f"{where}: {a.dtype} for a {size}-byte integer parameter")
                    c = _INT_CTYPES[(kind, size)](int(a))
            else:
                raise TypeError(f"{where}: {type(a).__name__} is not a NumPy array or NumPy scalar")
            holders.append(c)
            ptrs[i] = ctypes.cast(ctypes.pointer(c), ctypes.c_void_p)
        g = tuple(grid) + (1,) * (3 - len(grid))
        b = tuple(block) + (1,) * (3 - len(block))
        if b[0] * b[1] * b[2] > 1024 or min(g) < 1 or g[1] > 65535 or g[2] > 65535:
            raise ValueError(f"{name}: invalid launch geometry grid={g} block={b}")
        self.launches.append((name, g, b, smem_bytes))
        rc = self.lib.emu_launch(name.encode(), *map(int, g), *map(int, b), int(smem_bytes), ptrs, len(args))
        if rc == -3:
            raise RuntimeError(f"{name} wrote outside its {smem_bytes} bytes of dynamic shared memory")
        if rc:
            raise RuntimeError(f"emu_launch({name}) failed with {rc}")


class Recorder:
    """Runs launches through an :class:`Emulator` and records them for :func:`replay` (every buffer is
    snapshotted before the first launch that touches it; the final contents are kept for comparison)."""

    def __init__(self, emulator: Emulator):
        self.emu = emulator
        self.roots: list[np.ndarray] = []
        self.initial: list[bytes] = []
        self.records: list[tuple] = []

    def _buffer(self, a: np.ndarray) -> tuple[int, int]:
        root = a
        while isinstance(root.base, np.ndarray):
            root = root.base
        i = next((k for k, r in enumerate(self.roots) if r is root), None)
        if i is None:
            if not root.flags.c_contiguous:
                raise ValueError("recorded arrays must live in C-contiguous allocations")
            self.roots.append(root)
            self.initial.append(root.tobytes())
            i = len(self.roots) - 1
        return i, a.ctypes.data - root.ctypes.data

    def launch(self, name, grid, block, args, smem_bytes=0):
        rec = [(1, *self._buffer(a)) if isinstance(a, np.ndarray) else (0, np.asarray(a).tobytes()) for a in args]
        self.emu.launch(name, grid, block, args, smem_bytes)
        g = tuple(grid) + (1,) * (3 - len(grid))
        b = tuple(block) + (1,) * (3 - len(block))
        self.records.append((name, g, b, int(smem_bytes), rec))

    def final(self) -> list[bytes]:
        return [r.tobytes() for r in self.roots]

    def write(self, path: Path):
        out = [b"RPEMU1", struct.pack("<I", len(self.initial))]
        for data in self.initial:
            out += [struct.pack("<Q", len(data)), data]
        out.append(struct.pack("<I", len(self.records)))
        for name, g, b, smem, rec in self.records:
            out += [struct.pack("<I", len(name)), name.encode(), struct.pack("<6IQI", *g, *b, smem, len(rec))]
            for item in rec:
                if item[0] == 0:
                    out += [struct.pack("<BI", 0, len(item[1])), item[1]]
                else:
                    out.append(struct.pack("<BIQ", 1, item[1], item[2]))
        Path(path).write_bytes(b"".join(out))


def read_replay_output(path: Path) -> list[bytes]:
    data = Path(path).read_bytes()
    (n,) = struct.unpack_from("<I", data, 0)
    pos, bufs = 4, []
    for _ in range(n):
        (size,) = struct.unpack_from("<Q", data, pos)
        bufs.append(data[pos + 8 : pos + 8 + size])
        pos += 8 + size
    return bufs


def emulated_backend(emulator: Emulator | Recorder, num_sms: int = 4):
    """A ``CudaBackend`` over NumPy arrays whose kernels run in ``emulator`` (or a :class:`Recorder`).
    ``num_sms`` steers the flash-decoding partition count like the GPU's SM count does."""
    from rawpaged.kernels.cuda.backend import CudaBackend

    def launch(act, cache, name, grid, block, args, smem_bytes):
        emulator.launch(name, grid, block, args, smem_bytes)

    return CudaBackend._with_launcher(np, launch, lambda a: a.ctypes.data, num_sms=num_sms)
