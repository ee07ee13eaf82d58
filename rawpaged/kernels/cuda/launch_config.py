"""Launch geometry of the CUDA kernels: grids, blocks, shared memory and split-K partitions, as pure
functions of the shapes and the device's size. They mirror the constants of ``cuda/attention.cu`` and the
other sources; the runtime, the CPU emulation tests and the benchmarks launch with the same numbers.
Needs no GPU and never imports CuPy."""

from __future__ import annotations

import functools
from types import MappingProxyType

from rawpaged.kernels.cuda import program
from rawpaged.kernels.cuda.program import COPY_WORD_BYTES, DECODE_GMAX, gmax_cap

# Kernel geometry (mirrors the constants in cuda/attention.cu).
DEC_THREADS, DEC_WARPS, DEC_CHUNK = 128, 4, 128
PF_THREADS, PF_KT = 128, 32
#: cuda/quant.cu: the GEMV serves up to QUANT_GEMV_MAX_M rows of x, the tiled GEMM (QG_BM x QG_BN tiles,
#: QG_THREADS threads) any number.
QUANT_GEMV_MAX_M = 8
QG_BM, QG_BN, QG_THREADS = 32, 64, 256
#: cuda/moe.cu: the expert ids moe_align_kernel stages in shared memory at a time
MOE_ALIGN_CHUNK = program.MOE_ALIGN_CHUNK
#: cuda/moe.cu: tokens per block of moe_route_kernel (one thread each)
MOE_ROUTE_THREADS = 128
#: Shortest context a decode partition gets (shorter partitions cost more in the merge than they save).
MIN_SPLIT_TOKENS = 128
#: ... unless the grid at MIN_SPLIT_TOKENS leaves SMs idle (batch 1: 3 KV heads x 8 partitions of a
#: 1024-token context are 24 blocks on 132 SMs); then partitions go down to this length
SMALL_GRID_MIN_SPLIT_TOKENS = 32


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
