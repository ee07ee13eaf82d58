"""The CUDA sources compile with NVRTC exactly as the runtime compiles them (no GPU or driver needed).

NVRTC is called through ctypes from the ``nvidia-cuda-nvrtc-cu12`` wheel (or CUDA 13's
``nvidia-cuda-nvrtc``), with the runtime's options (``program.RUNTIME_OPTIONS`` + the ``-I`` for
``cuda_fp16.h``) plus what CuPy adds itself (``-ftz=true``), for sm_80 and sm_90, with every name expression
the runtime may launch. Any error, any warning or any register spill fails. Register/spill counts are
printed (``pytest -s``).
"""

from __future__ import annotations

import ctypes
import glob
import os
import re
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from rawpaged.kernels.cuda import launch_config, program

ARCHS = (80, 90)


def _find_nvrtc() -> str | None:
    for base in sys.path:
        for pattern in ("nvidia/cuda_nvrtc/lib/libnvrtc.so.*", "nvidia/cu1[0-9]/lib/libnvrtc.so.*"):
            for path in sorted(glob.glob(os.path.join(base, pattern))):
                if "builtins" not in path and ".alt." not in path:
                    return path
    return None


_NVRTC_PATH = _find_nvrtc()
pytestmark = [
    pytest.mark.skipif(_NVRTC_PATH is None, reason="NVRTC wheel not installed (pip install nvidia-cuda-nvrtc-cu12)"),
    pytest.mark.skipif(
        not program.cuda_include_dirs(), reason="cuda_fp16.h not found (pip install nvidia-cuda-runtime-cu12)"
    ),
]


class Nvrtc:
    def __init__(self, path: str):
        self.lib = ctypes.CDLL(path)
        self.lib.nvrtcGetErrorString.restype = ctypes.c_char_p

    def compile(self, source: str, names: list[str], options: list[str]):
        """Returns (result code, log, {name expression: lowered name}, cubin size)."""
        lib = self.lib
        prog = ctypes.c_void_p()
        rc = lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), b"rawpaged.cu", 0, None, None)
        assert rc == 0, lib.nvrtcGetErrorString(rc)
        try:
            for n in names:
                assert lib.nvrtcAddNameExpression(prog, n.encode()) == 0, n
            opts = [o.encode() for o in options]
            rc = lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
            size = ctypes.c_size_t()
            lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
            buf = ctypes.create_string_buffer(size.value)
            lib.nvrtcGetProgramLog(prog, buf)
            log = buf.value.decode(errors="replace")
            lowered, cubin = {}, 0
            if rc == 0:
                for n in names:
                    p = ctypes.c_char_p()
                    assert lib.nvrtcGetLoweredName(prog, n.encode(), ctypes.byref(p)) == 0, n
                    lowered[n] = p.value.decode()
                lib.nvrtcGetCUBINSize(prog, ctypes.byref(size))
                cubin = size.value
            return rc, log, lowered, cubin
        finally:
            lib.nvrtcDestroyProgram(ctypes.byref(prog))


def runtime_options(arch: int) -> list[str]:
    return [
        *program.RUNTIME_OPTIONS,
        *program.include_options(),
        *program.CUPY_IMPLICIT_OPTIONS,
        f"-arch=sm_{arch}",
        "--ptxas-options=-v",
    ]


def parse_ptxas(log: str) -> dict[str, dict]:
    """{mangled entry: {registers, spill_stores, spill_loads, stack}} from a ``ptxas -v`` log."""
    stats = {}
    for chunk in re.split(r"Compiling entry function ", log)[1:]:
        name = re.match(r"'([^']+)'", chunk).group(1)
        regs = re.search(r"Used (\d+) registers", chunk)
        spill = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", chunk)
        smem = re.search(r"(\d+) bytes smem", chunk)
        stats[name] = dict(
            smem=int(smem.group(1)) if smem else 0,
            registers=int(regs.group(1)),
            stack=int(spill.group(1)),
            spill_stores=int(spill.group(2)),
            spill_loads=int(spill.group(3)),
        )
    return stats


@pytest.fixture(scope="module")
def module_builds():
    """The runtime's translation unit with every name expression, for each architecture (in parallel)."""
    nvrtc = Nvrtc(_NVRTC_PATH)
    names = program.all_name_expressions()
    source = program.module_source()
    with ThreadPoolExecutor(len(ARCHS)) as pool:
        results = dict(zip(ARCHS, pool.map(lambda a: nvrtc.compile(source, names, runtime_options(a)), ARCHS)))
    return names, results


@pytest.mark.parametrize("arch", ARCHS)
def test_runtime_module_compiles_every_instantiation(module_builds, arch):
    names, results = module_builds
    rc, log, lowered, cubin = results[arch]
    assert rc == 0, f"NVRTC failed for sm_{arch}:\n{log[-8000:]}"
    warnings = [line for line in log.splitlines() if re.search(r"warning", line, re.I)]
    assert not warnings, "\n".join(warnings[:40])
    assert set(lowered) == set(names) and cubin > 0
    stats = parse_ptxas(log)
    missing = [n for n, m in lowered.items() if m not in stats]
    assert not missing, f"no ptxas report for {missing[:5]}"
    print(f"\nsm_{arch}: {len(names)} kernels, cubin {cubin} bytes")
    print(f"{'regs':>4} {'spill st/ld':>11} {'stack':>5}  name expression")
    for n in names:
        s = stats[lowered[n]]
        print(f"{s['registers']:>4} {s['spill_stores']:>5}/{s['spill_loads']:<5} {s['stack']:>5}  {n}")


@pytest.mark.parametrize("arch", ARCHS)
def test_no_register_spills(module_builds, arch):
    names, results = module_builds
    rc, log, lowered, _ = results[arch]
    assert rc == 0
    stats = parse_ptxas(log)
    per_name = {n: stats[lowered[n]] for n in names}
    spills = {n: s for n, s in per_name.items() if s["spill_stores"] or s["spill_loads"]}
    assert not spills, "\n".join(f"{n}: {s}" for n, s in spills.items())


@pytest.mark.parametrize("arch", ARCHS)
def test_sample_kernel_static_shared_memory_is_what_the_emulation_assumes(module_builds, arch):
    """``launch_config.SAMPLE_STATIC_SMEM_BYTES`` (the emulation's stand-in for the driver's
    ``shared_size_bytes``) is what ptxas allocates for every ``sample_kernel`` instantiation."""
    names, results = module_builds
    _, log, lowered, _ = results[arch]
    stats = parse_ptxas(log)
    sample = [n for n in names if n.startswith("sample_kernel<")]
    assert sample and {stats[lowered[n]]["smem"] for n in sample} == {launch_config.SAMPLE_STATIC_SMEM_BYTES}


@pytest.mark.parametrize("filename", program.SOURCE_FILES)
def test_each_source_file_compiles_on_its_own(filename):
    """Every .cu is self-contained (includes common.cuh itself); one instantiation each keeps this cheap."""
    names = program.names_in_file(program.all_name_expressions(), filename)
    assert names, f"no name expression belongs to {filename}"
    first_per_template = list({n.split("<")[0]: n for n in names}.values())
    rc, log, lowered, _ = Nvrtc(_NVRTC_PATH).compile(
        program.read_source(filename), first_per_template, [*runtime_options(90), f"-I{program.CUDA_DIR}"]
    )
    assert rc == 0, log[-8000:]
    assert "warning" not in log.lower(), log[-4000:]


def test_every_template_is_instantiated():
    """Each __global__ template in the sources has at least one name expression (uninstantiated templates
    are never checked by NVRTC)."""
    names = program.all_name_expressions()
    for filename in program.SOURCE_FILES:
        for kernel in re.findall(r"\b(\w+_kernel)\s*\(", program.read_source(filename)):
            assert any(n.startswith(kernel + "<") for n in names), f"{kernel} ({filename}) is never instantiated"
