"""The CUDA backend's dense per-token ops (``cuda/layers.cu``): RMSNorm (with the residual add fused),
RoPE, SwiGLU, GeGLU (tanh GeLU), and dtype conversion between float32, float16 and bfloat16. Semantics as the CPU's
(``rawpaged.kernels.cpu.elementwise``); math in float32."""

from __future__ import annotations

import numpy as np

from rawpaged.dtypes import BFLOAT16
from rawpaged.kernels.cuda import launch_config, program
from rawpaged.kernels.cuda.launch import ctype, i32, i64, row_stride


def check_rope(query, key, cos_sin_cache) -> None:
    """Raises ValueError unless query ``[T, H, D]`` and key ``[T, Hkv, D]`` share T, D and dtype and
    ``cos_sin_cache`` is float32 ``[max_position, D]``."""
    if key.dtype != query.dtype or key.shape[0] != query.shape[0] or key.shape[2] != query.shape[2]:
        raise ValueError(f"query {query.shape}/{query.dtype} and key {key.shape}/{key.dtype} disagree")
    if cos_sin_cache.dtype != np.float32 or cos_sin_cache.shape[-1] != query.shape[2]:
        raise ValueError("cos_sin_cache must be float32 [max_position, head_dim]")


def rms_norm(ctx, x, weight, eps, residual=None):
    """RMSNorm of ``x [num_tokens, hidden]`` (a new array); with ``residual``: ``residual += x`` in
    place first and the norm of the sum is returned. weight ``[hidden]`` in x's dtype or float32."""
    act = ctype(x, "x")
    wt = ctype(weight, "weight")
    if wt not in (act, program.F32):
        raise ValueError(f"weight dtype {weight.dtype} must be float32 or match x ({x.dtype})")
    if x.ndim != 2 or weight.shape != (x.shape[1],):
        raise ValueError(f"x must be [num_tokens, hidden] and weight [hidden]; got {x.shape}, {weight.shape}")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError("residual must match x in shape and dtype")
    num_tokens, hidden = x.shape
    out = ctx.xp.empty((num_tokens, hidden), dtype=x.dtype)
    if num_tokens == 0:
        return out
    weight = ctx.xp.ascontiguousarray(weight)
    res = residual if residual is not None else np.uint64(0)
    res_stride = row_stride(residual, "residual", 1) if residual is not None else 0
    ctx.kernel(
        act,
        act,
        f"rms_norm_kernel<{act}, {wt}>",
        (num_tokens, 1, 1),
        (launch_config.round_threads(hidden, 1024), 1, 1),
        (
            out,
            i64(hidden),
            x,
            i64(row_stride(x, "x", 1)),
            res,
            i64(res_stride),
            weight,
            np.float32(eps),
            i32(hidden),
            i32(residual is not None),
        ),
    )
    return out


def rotary_embedding(ctx, positions, query, key, cos_sin_cache):
    """RoPE in place, HF rotate-half layout (see ``rawpaged.kernels.cpu.elementwise.rotary_embedding``). positions int64
    ``[num_tokens]``; query ``[num_tokens, num_heads, head_dim]``, key ``[num_tokens, num_kv_heads,
    head_dim]`` (token strides free); cos_sin_cache float32 ``[max_position, head_dim]``."""
    act = ctype(query, "query")
    check_rope(query, key, cos_sin_cache)
    num_tokens, num_heads, head_dim = query.shape
    if num_tokens == 0:
        return
    pos = ctx.to_device(positions, np.int64)
    cs = ctx.xp.ascontiguousarray(cos_sin_cache)
    num_kv_heads = key.shape[1]
    threads = launch_config.round_threads((num_heads + num_kv_heads) * head_dim // 2, 512)
    ctx.kernel(
        act,
        act,
        f"rotary_embedding_kernel<{act}>",
        (num_tokens, 1, 1),
        (threads, 1, 1),
        (
            pos,
            query,
            i64(row_stride(query, "query", 2)),
            key,
            i64(row_stride(key, "key", 2)),
            cs,
            i32(num_heads),
            i32(num_kv_heads),
            i32(head_dim),
        ),
    )


def silu_and_mul(ctx, x):
    """SwiGLU: ``x [num_tokens, 2 * inter]`` -> ``silu(x[:, :inter]) * x[:, inter:]`` (a new array)."""
    return _gated(ctx, x, "silu_and_mul_kernel")


def gelu_tanh_and_mul(ctx, x):
    """GeGLU: ``x [num_tokens, 2 * inter]`` -> ``gelu_tanh(x[:, :inter]) * x[:, inter:]`` (a new array;
    PyTorch's tanh GeLU, see ``rawpaged.kernels.cpu.elementwise.gelu_tanh_and_mul``)."""
    return _gated(ctx, x, "gelu_tanh_and_mul_kernel")


def scale_rows(ctx, x, scale: float):
    """``x * scale`` (a new array of x's dtype), the scale rounded to that dtype first and each product
    rounded to it (PyTorch's product of a tensor and a scalar tensor of its dtype); bfloat16 (uint16 bits)
    goes through float32, where the product of two bfloat16 values is exact."""
    act = ctype(x, "x")
    if act != program.BF16:  # a NumPy scalar of x's dtype: a kernel argument, no copy (graph capture)
        return x * x.dtype.type(scale)
    x = ctx.xp.ascontiguousarray(x)
    wide = ctx.xp.empty(x.shape, dtype=np.float32)
    convert(ctx, wide, x)
    wide *= np.float32(np.float32(scale).astype(BFLOAT16.numpy))
    out = ctx.xp.empty(x.shape, dtype=x.dtype)
    convert(ctx, out, wide)
    return out


def _gated(ctx, x, kernel: str):
    """``kernel``'s gated activation of ``x [num_tokens, 2 * inter]`` (SwiGLU or GeGLU)."""
    act = ctype(x, "x")
    x = ctx.xp.ascontiguousarray(x)
    num_tokens, two_inter = x.shape
    inter = two_inter // 2
    out = ctx.xp.empty((num_tokens, inter), dtype=x.dtype)
    n = num_tokens * inter
    if n == 0:
        return out
    threads = 256
    ctx.kernel(
        act,
        act,
        f"{kernel}<{act}>",
        (launch_config.elementwise_blocks(n, threads, ctx.num_sms), 1, 1),
        (threads, 1, 1),
        (out, x, i64(num_tokens), i32(inter)),
    )
    return out


def convert(ctx, out, x) -> None:
    """``out[...] = x`` between float32, float16 and bfloat16 (uint16 bits) device arrays of equal
    size, both contiguous; through float32, rounding to nearest even."""
    d, s = ctype(out, "out"), ctype(x, "x")
    if out.size != x.size or not (out.flags.c_contiguous and x.flags.c_contiguous):
        raise ValueError(f"convert needs equal-size contiguous arrays, got {out.shape} and {x.shape}")
    if out.size == 0:
        return
    if d == s:
        out[...] = x.reshape(out.shape)
        return
    threads = 256
    ctx.kernel(
        d,
        d,
        f"convert_kernel<{d}, {s}>",
        (launch_config.elementwise_blocks(out.size, threads, ctx.num_sms), 1, 1),
        (threads, 1, 1),
        (out, x, i64(out.size)),
    )
