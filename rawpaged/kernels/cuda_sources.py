"""Everything about the CUDA kernels that needs no GPU and no CuPy: sources, compile options, the
template instantiations (NVRTC name expressions) and the launch geometry.

Imported by the runtime (``rawpaged/kernels/cuda.py``), the NVRTC compile test and the CPU emulation
tests, so all three build and launch exactly the same thing. Never imports CuPy.

Dtype names here are the C++ ones (``rawpaged.dtypes``: ``float``, ``__half``, ``__nv_bfloat16``).
"""

from __future__ import annotations

import functools
import glob
import os
import sys
from pathlib import Path
from types import MappingProxyType

from rawpaged.dtypes import BFLOAT16, FLOAT16, FLOAT32, FLOAT_TYPES

# --------------------------------------------------------------------------- sources
HEADER = "common.cuh"


def _find_cuda_dir() -> Path:
    """``RAWPAGED_CUDA_SRC`` if set; else ``cuda/`` of the source tree (editable installs, PYTHONPATH=.);
    else ``rawpaged/_cuda`` where a wheel installs the same files."""
    if os.environ.get("RAWPAGED_CUDA_SRC"):
        return Path(os.environ["RAWPAGED_CUDA_SRC"])
    here = Path(__file__).resolve().parents[1]
    tree = here.parent / "cuda"
    return tree if (tree / HEADER).is_file() else here / "_cuda"


#: Directory of the ``.cu`` sources (see :func:`_find_cuda_dir`).
CUDA_DIR = _find_cuda_dir()
SOURCE_FILES = ("cache.cu", "attention.cu", "layers.cu", "sampling.cu", "quant.cu")

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
)
#: ... and the same pairs as C++ element types.
DTYPE_PAIRS = tuple((FLOAT_TYPES[a].cxx, FLOAT_TYPES[c].cxx) for a, c in DTYPE_NAME_PAIRS)
HEAD_DIMS = (64, 128)
#: Compile-time upper bounds on the query heads one decode block serves (a group is padded up to one).
DECODE_GMAX = (1, 2, 4, 8, 16)
COPY_WORD_BYTES = (16, 8, 4, 2)

# Kernel geometry (mirrors the constants in cuda/attention.cu).
DEC_THREADS, DEC_WARPS, DEC_CHUNK = 128, 4, 128
PF_THREADS, PF_KT = 128, 32
#: GGUF block formats of cuda/quant.cu (its FMT template argument) and its kernels; the GEMV serves up to
#: QUANT_GEMV_MAX_M rows of x, the tiled GEMM (QG_BM x QG_BN tiles, QG_THREADS threads) any number.
QUANT_FORMATS = {"Q8_0": 0, "Q4_0": 1, "Q4_1": 2}
QUANT_KERNELS = ("quant_gemv_kernel", "quant_gemm_kernel", "quant_embedding_kernel")
QUANT_GEMV_MAX_M = 8
QG_BM, QG_BN, QG_THREADS = 32, 64, 256
#: Shortest context a decode partition gets (shorter partitions cost more in the merge than they save).
MIN_SPLIT_TOKENS = 128
#: ... unless the grid at MIN_SPLIT_TOKENS leaves SMs idle (batch 1: 3 KV heads x 8 partitions of a
#: 1024-token context are 24 blocks on 132 SMs); then partitions go down to this length
SMALL_GRID_MIN_SPLIT_TOKENS = 32


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
    names += [f"rotary_embedding_kernel<{act}>", f"silu_and_mul_kernel<{act}>", f"sample_kernel<{act}>"]
    names += [f"apply_token_bitmask_kernel<{act}>"]
    names += [f"{k}<{act}, {f}>" for f in QUANT_FORMATS.values() for k in QUANT_KERNELS]
    return names


def convert_names() -> list[str]:
    """``convert_kernel<D, S>`` for every ordered pair of distinct element types (in every module)."""
    types = (F32, F16, BF16)
    return [f"convert_kernel<{d}, {s}>" for d in types for s in types if d != s]


def name_expressions(act: str, cache: str) -> list[str]:
    """Every instantiation the runtime may launch for activations ``act`` and a KV cache of ``cache``."""
    if (act, cache) not in DTYPE_PAIRS:
        raise ValueError(f"unsupported (activation, cache) dtypes: {(act, cache)}; supported: {DTYPE_PAIRS}")
    names = [f"reshape_and_cache_kernel<{act}, {cache}>", f"rotary_embedding_and_cache_kernel<{act}, {cache}>"]
    names += [f"copy_blocks_kernel<{b}>" for b in COPY_WORD_BYTES] + convert_names()
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


# --------------------------------------------------------------------------- launch geometry
def gmax_cap(head_dim: int) -> int:
    """Largest GMAX for a head size: bounded by registers (GMAX * head_dim / 32 accumulators per thread)."""
    return 16 if head_dim <= 128 else 8


def decode_gmax(group: int, head_dim: int) -> int:
    """Smallest instantiated GMAX >= group (capped; larger groups are served in several chunks)."""
    cap = gmax_cap(head_dim)
    for g in DECODE_GMAX:
        if g >= group or g == cap:
            return g
    return cap


def decode_smem_floats(head_dim: int, gmax: int) -> int:
    """Mirror of ``DecodeSmem<D, GMAX>::TOTAL`` in cuda/attention.cu."""
    stats = gmax * head_dim
    work = stats + ((3 * gmax + 3) // 4) * 4
    return work + max(gmax * DEC_CHUNK, DEC_WARPS * gmax * head_dim)


@functools.lru_cache(maxsize=1024)
def decode_config(
    num_seqs: int, num_heads: int, num_kv_heads: int, head_dim: int, max_context_len: int, num_sms: int
) -> dict:
    """Grid and partitioning of ``paged_attention_kernel`` (flash-decoding split-K).

    The base grid has one block per (sequence, KV head, chunk of <= GMAX query heads). When that is too
    few blocks to fill the GPU (2 blocks per SM) the context is split into partitions of at least
    MIN_SPLIT_TOKENS positions (SMALL_GRID_MIN_SPLIT_TOKENS when that still leaves SMs idle), merged by
    ``paged_attention_reduce_kernel``. Cached (every layer of a
    step asks the same): the mapping returned is read-only.
    """
    group = num_heads // num_kv_heads
    gmax = decode_gmax(group, head_dim)
    gchunks = -(-group // gmax)
    base_blocks = max(1, num_seqs * num_kv_heads * gchunks)
    max_ctx = max(1, int(max_context_len))
    want = -(-2 * num_sms // base_blocks)
    splits = max(1, min(want, -(-max_ctx // MIN_SPLIT_TOKENS)))
    if splits > 1 and base_blocks * splits < num_sms:
        splits = max(1, min(want, -(-max_ctx // SMALL_GRID_MIN_SPLIT_TOKENS)))
    split_len = -(-max_ctx // splits)
    split_len = -(-split_len // 16) * 16
    splits = -(-max_ctx // split_len)
    return MappingProxyType(
        dict(
            gmax=gmax,
            gchunks=gchunks,
            num_splits=splits,
            split_len=split_len,
            grid=(num_kv_heads * gchunks, num_seqs, splits),
            block=(DEC_THREADS, 1, 1),
            smem_bytes=4 * decode_smem_floats(head_dim, gmax),
            reduce_block=(min(256, -(-head_dim // 32) * 32), 1, 1),
        )
    )


def prefill_rows(head_dim: int) -> int:
    """Mirror of ``PrefillCfg<D>::ROWS``."""
    return 16 * (4 if head_dim <= 128 else 2)


def prefill_smem_floats(head_dim: int) -> int:
    """Mirror of ``PrefillCfg<D>::TOTAL``."""
    rows = prefill_rows(head_dim)
    qs = head_dim + 1
    return rows * qs + 2 * PF_KT * qs + rows * (PF_KT + 1)


@functools.lru_cache(maxsize=1024)
def prefill_config(num_seqs: int, num_heads: int, num_kv_heads: int, head_dim: int, max_query_len: int) -> dict:
    """Grid of ``prefill_attention_kernel``: query tiles of ROWS (token, head) rows per KV head (cached,
    read-only)."""
    group = num_heads // num_kv_heads
    rows = prefill_rows(head_dim)
    heads_per_block = min(group, rows)
    hchunks = -(-group // heads_per_block)
    tokens_per_tile = rows // heads_per_block
    tiles = max(1, -(-int(max_query_len) // tokens_per_tile))
    return MappingProxyType(
        dict(
            heads_per_block=heads_per_block,
            tokens_per_tile=tokens_per_tile,
            grid=(tiles, num_kv_heads * hchunks, num_seqs),
            block=(PF_THREADS, 1, 1),
            smem_bytes=4 * prefill_smem_floats(head_dim),
        )
    )


def round_threads(n: int, cap: int) -> int:
    """Threads for a per-row kernel: n rounded up to a warp multiple, within [32, cap]."""
    return max(32, min(cap, -(-n // 32) * 32))


def copy_word_bytes(block_bytes: int) -> int:
    """Widest copy word in COPY_WORD_BYTES dividing the byte size of one KV block."""
    for b in COPY_WORD_BYTES:
        if block_bytes % b == 0:
            return b
    raise ValueError(f"KV block of {block_bytes} bytes is not a multiple of 2 bytes")


def sample_threads(vocab: int) -> int:
    """Threads of a ``sample_kernel`` block: about 16 logits per thread, a warp multiple in [32, 512]
    (``__launch_bounds__(512)``: more threads would cap registers low enough to spill)."""
    return round_threads(-(-int(vocab) // 16), 512)


#: bytes of static ``__shared__`` memory ptxas gives ``sample_kernel`` (cuda/sampling.cu: fscratch[32],
#: iscratch[32], hist[256], digit_above[2] are 1288 bytes, placed with padding);
#: tests/kernels/test_cuda_compile.py checks it for every instantiation. A device reports its own
#: (``shared_size_bytes``); this is the emulation's.
SAMPLE_STATIC_SMEM_BYTES = 1296


def sample_smem_bytes(vocab: int, max_smem_optin: int, static_smem_bytes: int = SAMPLE_STATIC_SMEM_BYTES) -> int:
    """Dynamic shared memory for one ``sample_kernel`` block: the row's ``vocab`` float32 probabilities
    when they fit beside the kernel's static shared memory within the device's opt-in maximum per block
    (``cudaDevAttrMaxSharedMemoryPerBlockOptin``: the sum of both must not exceed it), else 0 (the
    probabilities go to a global workspace)."""
    need = 4 * int(vocab)
    return need if need + int(static_smem_bytes) <= int(max_smem_optin) else 0


def elementwise_blocks(n: int, threads: int, num_sms: int) -> int:
    """Blocks for a grid-stride elementwise kernel: enough to cover n, at most 32 waves of SMs."""
    return max(1, min(-(-n // threads), 32 * max(1, num_sms)))


__all__ = [n for n in dir() if not n.startswith("_") and n not in ("glob", "os", "sys", "Path", "annotations")]
