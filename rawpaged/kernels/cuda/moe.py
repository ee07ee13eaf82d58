"""The CUDA backend's mixture-of-experts ops (``cuda/moe.cu`` and the grouped products of ``cuda/quant.cu``),
with the semantics of the CPU's (``rawpaged.kernels.cpu.moe``, ``moe_quant``; ``docs/moe.md``):

1. ``moe_route``: ``moe_route_kernel``, one thread per token (ties to the lower expert index, float64 sums).
2. ``moe_align``: ``moe_align_kernel``, one block, a stable counting sort by expert with offsets.
3. ``grouped_linear``: ``moe_tiles_kernel`` lists the row tiles of the experts that have rows, then one launch
   of ``moe_gemv_kernel``/``moe_gemm_kernel`` (float experts in the activation dtype, ``[E, N, K]``) or
   ``moe_quant_gemv_kernel``/``moe_quant_gemm_kernel`` (GGUF experts in their blocks, the dense quantized
   products' bodies) covers them all: an expert with no rows is never read.
4. ``moe_combine``: ``moe_invert_kernel`` then ``moe_combine_kernel`` (slot order, float32 sums, the
   shared expert's gated output added in the same pass).

Differences from the CPU, all additive: activations (x, y, the outputs) may be float32, float16 or bfloat16
(uint16 bits), outputs in the input's dtype; ids outside ``[0, E)`` are not checked on the device (the router
never gives any).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from rawpaged.dtypes import float_type
from rawpaged.kernels.cuda import launch_config, program
from rawpaged.kernels.cuda.launch import ctype, i32, i64, row_stride
from rawpaged.kernels.cuda.weights import DeviceQuantized, upload_into, upload_quantized
from rawpaged.kernels.quantization import QuantizedExperts, StackedExpertParts, concat_rows, runs_of_one_format

#: a grid's y extent (the row tiles of a grouped product) is at most this
MAX_GRID_Y = 65535


@dataclass(frozen=True)
class DeviceQuantizedExperts:
    """E GGUF-quantized ``[N, K]`` experts of one format on the device: ``planes`` is the stack's
    ``[E * N, K]`` :class:`~rawpaged.kernels.cuda.weights.DeviceQuantized` (expert e is rows ``e * N ..
    (e + 1) * N``), never dequantized. ``shape == (E, N, K)``."""

    planes: DeviceQuantized
    shape: tuple

    @property
    def qtype(self) -> str:
        return self.planes.qtype

    @property
    def dtype(self) -> np.dtype:
        return self.planes.dtype

    @property
    def nbytes(self) -> int:
        return self.planes.nbytes


@dataclass(frozen=True)
class DeviceStackedExperts(StackedExpertParts):
    """Fused expert parts of different formats (gate in one, up in another): each a
    :class:`DeviceQuantizedExperts`, its rows the next columns of the product."""

    parts: tuple

    @property
    def dtype(self) -> np.dtype:
        return self.parts[0].dtype


def load_experts(ctx, parts: list, dtype: str):
    """Stacks ``[E, N_i, K]`` fused along N -> the handle ``grouped_linear`` takes: ``QuantizedExperts``
    parts stay in their blocks (adjacent parts of a format concatenated: a :class:`DeviceQuantizedExperts`,
    or a :class:`DeviceStackedExperts` for several formats); float parts (quantized ones beside them
    dequantized) become one device array ``[E, sum N_i, K]`` of ``dtype``, uploaded expert by expert in
    the checkpoint's dtype and converted on the device. Raises ValueError for stacks that disagree in E or
    K."""
    shapes = [tuple(p.shape) for p in parts]
    if not shapes or any(len(s) != 3 or s[0] != shapes[0][0] or s[2] != shapes[0][2] for s in shapes):
        raise ValueError(f"load_experts: expert stacks {shapes} must be [E, N_i, K] with one E and one K")
    E, K = shapes[0][0], shapes[0][2]
    if all(isinstance(p, QuantizedExperts) for p in parts):
        packed = tuple(
            DeviceQuantizedExperts(upload_quantized(ctx, stack.flat(), dtype), tuple(stack.shape))
            for stack in (concat_rows(run) for run in runs_of_one_format(parts))
        )
        return packed[0] if len(packed) == 1 else DeviceStackedExperts(packed)
    parts = [p.dequantize() if isinstance(p, QuantizedExperts) else p for p in parts]
    out = ctx.xp.empty((E, sum(s[1] for s in shapes), K), dtype=float_type(dtype).device)
    if len(parts) == 1:
        upload_into(ctx, out, parts[0], dtype)
        return out
    for e in range(E):  # each expert's rows of a part are contiguous on both sides
        n0 = 0
        for p in parts:
            upload_into(ctx, out[e, n0 : n0 + p.shape[1]], p[e], dtype)
            n0 += p.shape[1]
    return out


def moe_route(ctx, router_logits, top_k: int, softmax_before_topk: bool, renormalize: bool) -> tuple:
    """float32 ``router_logits [T, E]`` -> ``(topk_ids int32 [T, k], topk_weights float32 [T, k])`` on the
    device (``moe_route_kernel``; the CPU's ``moe.moe_route``). Raises ValueError for ``top_k`` outside
    ``[1, E]``."""
    logits = ctx.to_device(router_logits, np.float32)
    T, E = logits.shape
    if not 1 <= top_k <= E:
        raise ValueError(f"moe_route: top_k {top_k} must be in [1, {E}] (the number of experts)")
    ids = ctx.xp.empty((T, top_k), dtype=np.int32)
    weights = ctx.xp.empty((T, top_k), dtype=np.float32)
    if T:
        threads = launch_config.MOE_ROUTE_THREADS
        ctx.kernel(
            program.F32,
            program.F32,
            f"moe_route_kernel<{program.F32}>",
            (-(-T // threads), 1, 1),
            (threads, 1, 1),
            (ids, weights, logits, i32(T), i32(E), i32(top_k), i32(softmax_before_topk), i32(renormalize)),
        )
    return ids, weights


def moe_align(ctx, topk_ids, num_experts: int) -> tuple:
    """``(sorted_ids int32 [T * k], expert_offsets int64 [E + 1])`` of ``topk_ids [T, k]`` (``moe_align_kernel``;
    the CPU's ``moe.moe_align``): flat indices ``t * k + j`` in expert order, stable."""
    flat = ctx.to_device(topk_ids, np.int32).reshape(-1)
    sorted_ids = ctx.xp.empty(flat.shape[0], dtype=np.int32)
    offsets = ctx.xp.empty(num_experts + 1, dtype=np.int64)
    chunk = launch_config.MOE_ALIGN_CHUNK
    ctx.kernel(
        program.F32,
        program.F32,
        f"moe_align_kernel<{chunk}>",
        (1, 1, 1),
        (launch_config.round_threads(num_experts, 1024), 1, 1),
        (sorted_ids, offsets, flat, i32(flat.shape[0]), i32(num_experts)),
    )
    return sorted_ids, offsets


def grouped_linear(ctx, x, expert_offsets, experts):
    """``out[r] = x[r] @ W_e.T`` for the rows r of each expert e (``expert_offsets[e] .. [e + 1]``), in x's
    dtype: x ``[M, K]`` rows in expert order (row stride free), experts from :func:`load_experts`. Tiles of
    ``QUANT_GEMV_MAX_M`` rows with one warp per weight row while the experts average at most that many rows
    (decode), ``QG_BM x QG_BN`` tiles above. Raises ValueError for dtypes or shapes that do not fit."""
    if isinstance(experts, DeviceStackedExperts):
        return ctx.xp.concatenate([grouped_linear(ctx, x, expert_offsets, p) for p in experts.parts], axis=1)
    act = ctype(x, "x")
    E, N, K = experts.shape
    if x.ndim != 2 or x.shape[1] != K or x.dtype != experts.dtype:
        raise ValueError(f"grouped_linear: x {x.shape} {x.dtype} does not fit experts {experts.shape} {experts.dtype}")
    offsets = ctx.to_device(expert_offsets, np.int64)
    if offsets.shape != (E + 1,):
        raise ValueError(f"grouped_linear: expert_offsets {offsets.shape} for {E} experts")
    M = x.shape[0]
    out = ctx.xp.empty((M, N), dtype=x.dtype)
    if M == 0 or N == 0:
        return out
    gemv = M <= launch_config.QUANT_GEMV_MAX_M * E
    bm = launch_config.QUANT_GEMV_MAX_M if gemv else launch_config.QG_BM
    max_tiles = -(-M // bm) + min(E, M)
    if max_tiles > MAX_GRID_Y:
        raise ValueError(f"grouped_linear: {M} rows need up to {max_tiles} tiles, more than a grid holds")
    tiles = row_tiles(ctx, act, offsets, bm, max_tiles)
    if isinstance(experts, DeviceQuantizedExperts):
        q = experts.planes
        name = f"moe_quant_{'gemv' if gemv else 'gemm'}_kernel<{act}, {program.QUANT_FORMATS[q.qtype]}>"
        weights = (q.qs, q.scales, q.mins)
    else:
        name = f"moe_{'gemv' if gemv else 'gemm'}_kernel<{act}>"
        weights = (experts,)
    if gemv:
        threads = 128
        grid, block = (-(-N // (threads // 32)), max_tiles, 1), (threads, 1, 1)
    else:
        grid, block = (-(-N // launch_config.QG_BN), max_tiles, 1), (launch_config.QG_THREADS, 1, 1)
    args = (out, x, i64(row_stride(x, "x", 1)), *weights, offsets, tiles, i32(N), i32(K))
    ctx.kernel(act, act, name, grid, block, args)
    return out


def row_tiles(ctx, act: str, offsets, bm: int, max_tiles: int):
    """int32 ``[1 + 2 * max_tiles]``: the count of row tiles of ``bm`` rows of the experts with rows (int64
    device ``offsets [E + 1]``), then each tile's (expert, first row within the expert), in expert order
    (``moe_tiles_kernel``); ``max_tiles`` bounds the count."""
    tiles = ctx.xp.empty(1 + 2 * max_tiles, dtype=np.int32)
    E = offsets.shape[0] - 1
    ctx.kernel(act, act, f"moe_tiles_kernel<{bm}>", (1, 1, 1), (32, 1, 1), (tiles, offsets, i32(E)))
    return tiles


def moe_combine(ctx, y, sorted_ids, topk_weights, num_tokens: int, shared=None, shared_gate=None):
    """``out[t] = sum_j topk_weights[t, j] * y[i]`` where ``sorted_ids[i] == t * k + j`` (slot order), plus
    ``shared[t] * sigmoid(shared_gate[t])`` when given; ``[num_tokens, H]`` in y's dtype
    (``moe_combine_kernel``; the CPU's ``moe.moe_combine``). y ``[T * k, H]``, shared ``[T, H]`` of y's
    dtype; topk_weights, shared_gate float32 ``[T, k]``, ``[T, 1]``. Raises ValueError for shapes that
    disagree."""
    act = ctype(y, "y")
    weights = ctx.to_device(topk_weights, np.float32)
    ids = ctx.to_device(sorted_ids, np.int32)
    n, H = y.shape
    if weights.shape[0] != num_tokens or n != weights.size or ids.shape != (n,):
        raise ValueError(
            f"moe_combine: y {y.shape}, sorted_ids {ids.shape}, topk_weights {weights.shape} "
            f"disagree with {num_tokens} tokens"
        )
    has_shared = shared is not None
    if has_shared and (shared.shape != (num_tokens, H) or shared.dtype != y.dtype or shared_gate is None):
        raise ValueError(f"moe_combine: shared {shared.shape} {shared.dtype} must be [{num_tokens}, {H}] of {y.dtype}")
    y = ctx.xp.ascontiguousarray(y)
    out = ctx.xp.empty((num_tokens, H), dtype=y.dtype)
    if num_tokens == 0 or H == 0:
        return out
    where = ctx.xp.empty(n, dtype=np.int32)
    ctx.kernel(act, act, "moe_invert_kernel<int>", (launch_config.elementwise_blocks(n, 256, ctx.num_sms), 1, 1),
               (256, 1, 1), (where, ids, i32(n)))  # fmt: skip
    gate = ctx.to_device(shared_gate, np.float32).reshape(-1) if has_shared else weights
    ctx.kernel(
        act,
        act,
        f"moe_combine_kernel<{act}>",
        (num_tokens, 1, 1),
        (launch_config.round_threads(H, 1024), 1, 1),
        (out, y, where, weights, ctx.xp.ascontiguousarray(shared) if has_shared else y, gate, i32(has_shared),
         i32(n // num_tokens), i32(H)),
    )  # fmt: skip
    return out
