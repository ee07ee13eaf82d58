"""The CUDA program: the sources of ``cuda/*.cu``, the NVRTC options and headers, and the template
instantiations (NVRTC name expressions) the runtime may launch.

Imported by the runtime (``rawpaged/kernels/cuda/launch.py``), the NVRTC compile test and the CPU
emulation tests, so all three compile exactly the same thing. Needs no GPU and never imports CuPy. The
grid and block sizes are in ``launch_config``.

Dtype names here are the C++ ones (``rawpaged.dtypes``: ``float``, ``__half``, ``__nv_bfloat16``).
"""

from __future__ import annotations

import glob
import os
import sys
from pathlib import Path

from rawpaged.dtypes import BFLOAT16, FLOAT16, FLOAT32, FLOAT_TYPES, kv_cache_type
from rawpaged.kernels.quantization import FORMAT_CODES

# --------------------------------------------------------------------------- sources
HEADER = "common.cuh"


def _find_cuda_dir() -> Path:
    """``RAWPAGED_CUDA_SRC`` if set; else ``cuda/`` of the source tree (editable installs, PYTHONPATH=.);
    else ``rawpaged/_cuda`` where a wheel installs the same files."""
    if os.environ.get("RAWPAGED_CUDA_SRC"):
        return Path(os.environ["RAWPAGED_CUDA_SRC"])
    here = Path(__file__).resolve().parents[2]  # rawpaged/
    tree = here.parent / "cuda"
    return tree if (tree / HEADER).is_file() else here / "_cuda"


#: Directory of the ``.cu`` sources (see :func:`_find_cuda_dir`).
CUDA_DIR = _find_cuda_dir()
SOURCE_FILES = ("cache.cu", "attention.cu", "layers.cu", "sampling.cu", "logprobs.cu", "quant.cu", "moe.cu")

#: NVRTC options the runtime passes to ``cupy.RawModule`` (plus :func:`include_options`).
RUNTIME_OPTIONS = ("--std=c++17",)
#: Options CuPy adds on its own when it compiles a RawModule with NVRTC (mirrored by the compile test).
CUPY_IMPLICIT_OPTIONS = ("-ftz=true",)

# --------------------------------------------------------------------------- instantiations
F32, F16, BF16 = FLOAT32.cxx, FLOAT16.cxx, BFLOAT16.cxx
#: (activation dtype, KV-cache dtype) name pairs the runtime supports ...
DTYPE_NAME_PAIRS = (
    ("float32", "float32"),
    ("float32", "bfloat16"),
    ("float32", "float16"),
    ("float16", "float16"),
    ("bfloat16", "bfloat16"),
    *((act, kv) for act in ("float32", "float16", "bfloat16") for kv in ("int8", "fp8_e4m3")),
)
#: ... and the same pairs as C++ element types.
DTYPE_PAIRS = tuple((FLOAT_TYPES[a].cxx, kv_cache_type(c).cxx) for a, c in DTYPE_NAME_PAIRS)
#: head sizes the attention kernels are built for (256: Gemma 2 and Gemma 3)
HEAD_DIMS = (64, 128, 256)
#: Compile-time upper bounds on the query heads one decode block serves (a group is padded up to one).
DECODE_GMAX = (1, 2, 4, 8, 16)
COPY_WORD_BYTES = (16, 8, 4, 2)

#: GGUF block formats of cuda/quant.cu (its FMT template argument) and its kernels.
QUANT_FORMATS = FORMAT_CODES
QUANT_KERNELS = ("quant_gemv_kernel", "quant_gemm_kernel", "quant_embedding_kernel")
#: the mixture of experts' grouped products (cuda/quant.cu): float experts of the activation dtype, and GGUF
#: experts of each format
MOE_FLOAT_KERNELS = ("moe_gemv_kernel", "moe_gemm_kernel")
MOE_QUANT_KERNELS = ("moe_quant_gemv_kernel", "moe_quant_gemm_kernel")
#: cuda/moe.cu: the expert ids moe_align_kernel stages in shared memory at a time
MOE_ALIGN_CHUNK = 1024
#: rows per tile of the grouped products' two paths (``launch_config.QUANT_GEMV_MAX_M``, ``QG_BM``)
MOE_TILE_ROWS = (8, 32)


def read_source(name: str) -> str:
    return (CUDA_DIR / name).read_text()


def module_source() -> str:
    """The single translation unit handed to NVRTC: the header, then every ``.cu`` file with its
    ``#include "common.cuh"`` line removed (its text is already there, so no include path is needed for
    it and CuPy's cache key covers every byte that is compiled)."""
    header = "\n".join(
        "// (#pragma once: inlined once)" if line.strip() == "#pragma once" else line
        for line in read_source(HEADER).splitlines()
    )
    parts = [f"// ---- {HEADER}\n", header, "\n"]
    for name in SOURCE_FILES:
        text = "\n".join(
            "// (common.cuh inlined above)" if line.strip() == f'#include "{HEADER}"' else line
            for line in read_source(name).splitlines()
        )
        parts += [f"\n// ---- {name}\n", text, "\n"]
    return "".join(parts)


def layer_names(act: str) -> list[str]:
    """Name expressions of the dtype-generic kernels for activation dtype ``act``."""
    weight_types = [act] if act == F32 else [act, F32]
    names = [f"rms_norm_kernel<{act}, {w}>" for w in weight_types]
    names += [f"rotary_embedding_kernel<{act}>", f"silu_and_mul_kernel<{act}>", f"gelu_tanh_and_mul_kernel<{act}>"]
    names.append(f"sample_kernel<{act}>")
    names += [f"apply_token_bitmask_kernel<{act}>", f"apply_logits_edits_kernel<{act}>", f"logprobs_kernel<{act}>"]
    names += [f"{k}<{act}, {f}>" for f in QUANT_FORMATS.values() for k in QUANT_KERNELS]
    names += [f"{k}<{act}>" for k in MOE_FLOAT_KERNELS] + [f"moe_combine_kernel<{act}>"]
    names += [f"{k}<{act}, {f}>" for f in QUANT_FORMATS.values() for k in MOE_QUANT_KERNELS]
    return names


def moe_names() -> list[str]:
    """The mixture of experts' dtype-free kernels (cuda/moe.cu; in every module): routing on float32 logits,
    the alignment, the tile lists of the two grouped-product paths, the inverse permutation."""
    tiles = [f"moe_tiles_kernel<{bm}>" for bm in MOE_TILE_ROWS]
    return [f"moe_route_kernel<{F32}>", f"moe_align_kernel<{MOE_ALIGN_CHUNK}>", *tiles, "moe_invert_kernel<int>"]


def convert_names() -> list[str]:
    """``convert_kernel<D, S>`` for every ordered pair of distinct element types (in every module)."""
    types = (F32, F16, BF16)
    return [f"convert_kernel<{d}, {s}>" for d in types for s in types if d != s]


def name_expressions(act: str, cache: str) -> list[str]:
    """Every instantiation the runtime may launch for activations ``act`` and a KV cache of ``cache``."""
    if (act, cache) not in DTYPE_PAIRS:
        raise ValueError(f"unsupported (activation, cache) dtypes: {(act, cache)}; supported: {DTYPE_PAIRS}")
    names = [f"reshape_and_cache_kernel<{act}, {cache}>", f"rotary_embedding_and_cache_kernel<{act}, {cache}>"]
    names += [f"copy_blocks_kernel<{b}>" for b in COPY_WORD_BYTES] + convert_names() + moe_names()
    for d in HEAD_DIMS:
        names += [f"paged_attention_kernel<{act}, {cache}, {d}, {g}>" for g in DECODE_GMAX if g <= gmax_cap(d)]
        names.append(f"prefill_attention_kernel<{act}, {cache}, {d}>")
    names.append(f"paged_attention_reduce_kernel<{act}>")
    names += layer_names(act)
    return names


def all_name_expressions() -> list[str]:
    """The union over :data:`DTYPE_PAIRS`, each name once, in a stable order."""
    seen: dict[str, None] = {}
    for act, cache in DTYPE_PAIRS:
        for n in name_expressions(act, cache):
            seen.setdefault(n, None)
    return list(seen)


def names_in_file(names: list[str], filename: str) -> list[str]:
    """The subset of ``names`` whose template is defined in ``filename``."""
    text = read_source(filename)
    return [n for n in names if f" {n.split('<')[0]}(" in text]


# --------------------------------------------------------------------------- headers
def cuda_include_dirs() -> list[str]:
    """Directories holding ``cuda_fp16.h``/``cuda_bf16.h`` for NVRTC: the NVIDIA runtime wheels
    (``nvidia-cuda-runtime-cu12`` -> ``nvidia/cuda_runtime/include``, CUDA 13's ``nvidia-cuda-runtime``
    -> ``nvidia/cu13/include``), then ``CUDA_PATH``/``CUDA_HOME``, then ``/usr/local/cuda``."""
    found: list[str] = []
    for base in sys.path:
        for pattern in ("nvidia/cuda_runtime/include", "nvidia/cu1[0-9]/include"):
            for d in sorted(glob.glob(os.path.join(base, pattern))):
                if os.path.isfile(os.path.join(d, "cuda_fp16.h")) and d not in found:
                    found.append(d)
    for env in ("CUDA_PATH", "CUDA_HOME"):
        if os.environ.get(env):
            found.append(os.path.join(os.environ[env], "include"))
    found.append("/usr/local/cuda/include")
    return [d for d in dict.fromkeys(found) if os.path.isfile(os.path.join(d, "cuda_bf16.h"))]


def include_options() -> tuple[str, ...]:
    """``-I`` for the first directory of :func:`cuda_include_dirs` (empty if none: NVRTC then fails with
    a clear 'cannot open source file cuda_fp16.h')."""
    dirs = cuda_include_dirs()
    return (f"-I{dirs[0]}",) if dirs else ()


def gmax_cap(head_dim: int) -> int:
    """Largest GMAX for a head size: bounded by registers (GMAX * head_dim / 32 accumulators per thread;
    at 256, GMAX 8 spills with float32 caches; Gemma's groups are 2 or 4)."""
    return 16 if head_dim <= 128 else 4
