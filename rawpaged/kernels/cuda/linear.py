"""The CUDA backend's products: ``linear`` (float32/float16 through CuPy's matmul, bfloat16 and captured
products through ``cublasGemmEx`` with float32 accumulation; GGUF blocks through ``cuda/quant.cu``) and
``embedding`` (rows of a float table, or rows of a quantized table dequantized on lookup)."""

from __future__ import annotations

import numpy as np

from rawpaged.kernels.cuda import cublas, elementwise, launch_config, program
from rawpaged.kernels.cuda.elementwise import convert
from rawpaged.kernels.cuda.launch import CTYPES, ctype, i32, i64, row_stride
from rawpaged.kernels.cuda.weights import DeviceQuantized, DeviceStacked


def linear(ctx, x, weight, bias=None, float32_out=False):
    """``x @ weight.T (+ bias)``; x ``[n, in]``, weight ``[out, in]`` (HF layout), same dtype.

    float32/float16: CuPy matmul (cuBLAS). bfloat16 (uint16 bits): ``cublasGemmEx`` with
    CUDA_R_16BF A/B/C and CUBLAS_COMPUTE_32F (float32 accumulation, one rounding to bf16 at the end;
    a bias is preloaded into C and added in the float32 epilogue with beta = 1).

    ``float32_out`` (the LM head): the float32 accumulator is written as it is, with a CUDA_R_32F C
    (bfloat16 and float16 inputs through gemmEx; no bias then), so logits keep float32's resolution;
    a quantized weight's product is converted after its kernel.

    Raises:
        ValueError: mismatched dtypes or shapes, or a bias with ``float32_out`` on 16-bit inputs.
    """
    if x.dtype != weight.dtype:
        raise ValueError(f"x {x.dtype} and weight {weight.dtype} must have the same dtype")
    if isinstance(weight, (DeviceQuantized, DeviceStacked)):
        y = quant_linear(ctx, x, weight, bias)
        if not float32_out or y.dtype == np.float32:
            return y
        out = ctx.xp.empty(y.shape, dtype=np.float32)
        convert(ctx, out, y)
        return out
    if ctx.capture_blas is not None:  # CuPy's matmul cannot be captured
        if float32_out and bias is not None and x.dtype != np.float32:
            raise ValueError("a bias with float32_out needs float32 inputs (an LM head has no bias)")
        in_types = {np.dtype(np.float32): cublas.CUDA_R_32F, np.dtype(np.float16): cublas.CUDA_R_16F}
        in_type = in_types.get(x.dtype, cublas.CUDA_R_16BF)
        return gemm_ex(ctx, x, weight, bias, in_type, float32_out)
    if x.dtype == np.float32 or (x.dtype == np.float16 and not float32_out):
        y = x @ weight.T
        if bias is not None:
            y += bias
        return y
    if float32_out and bias is not None:
        raise ValueError("a bias with float32_out needs float32 inputs (an LM head has no bias)")
    if x.dtype == np.float16:
        return gemm_ex(ctx, x, weight, None, cublas.CUDA_R_16F, float32_out=True)
    return linear_bf16(ctx, x, weight, bias, float32_out)


def linear_bf16(ctx, x, weight, bias, float32_out=False):
    return gemm_ex(ctx, x, weight, bias, cublas.CUDA_R_16BF, float32_out)


def gemm_ex(ctx, x, weight, bias, in_type, float32_out):
    """``cublasGemmEx`` of ``x`` and ``weight`` (``in_type``: CUDA_R_16BF, CUDA_R_16F or, while a graph
    captures, CUDA_R_32F) with float32 accumulation, written in the inputs' type or, with
    ``float32_out``, in float32. Through CuPy's handle, or through ``ctx.capture_blas`` (a
    :class:`~rawpaged.kernels.cuda.cublas.CublasHandle` bound to the capturing stream) while one is set."""
    xp = ctx.xp
    x = xp.ascontiguousarray(x)
    weight = xp.ascontiguousarray(weight)
    n, k = x.shape
    m = weight.shape[0]
    if weight.shape[1] != k:
        raise ValueError(f"x {x.shape} and weight {weight.shape} do not chain")
    y = xp.empty((n, m), dtype=np.float32 if float32_out else x.dtype)
    out_type = cublas.CUDA_R_32F if float32_out else in_type
    beta_v = 0.0
    if bias is not None:
        y[...] = bias  # plain copy of the bias bits, broadcast over rows
        beta_v = 1.0
    if n == 0 or m == 0:
        return y
    # host scalars: cuBLAS reads them when the call is made (or captured)
    alpha = np.array(1.0, dtype=np.float32)
    beta = np.array(beta_v, dtype=np.float32)
    if ctx.capture_blas is not None:
        gemm_ex = ctx.capture_blas.gemm_ex
    else:
        try:  # deferred: CuPy, an optional library
            from cupy_backends.cuda.libs import cublas as cupy_cublas
        except ImportError:  # deferred: older CuPy keeps cuBLAS here
            from cupy.cuda import cublas as cupy_cublas
        handle = xp.cuda.device.get_cublas_handle()

        def gemm_ex(*args):
            cupy_cublas.gemmEx(handle, *args, cublas.COMPUTE_32F, cublas.GEMM_DEFAULT)

    address = ctx.address
    cublas.gemm_nt(
        gemm_ex,
        address(x),
        address(weight),
        address(y),
        n,
        m,
        k,
        in_type,
        out_type,
        alpha.ctypes.data,
        beta.ctypes.data,
    )
    return y


def quant_linear(ctx, x, w: DeviceQuantized | DeviceStacked, bias):
    """``x [M, K] @ dequantize(w).T (+ bias)`` on the blocks: ``quant_gemv_kernel`` for M up to
    ``QUANT_GEMV_MAX_M`` (decode), ``quant_gemm_kernel`` tiles above; a :class:`DeviceStacked` weight
    part by part, the outputs concatenated."""
    if isinstance(w, DeviceStacked):
        outs, row = [], 0
        for p in w.parts:
            n = p.shape[0]
            outs.append(quant_linear(ctx, x, p, None if bias is None else bias[row : row + n]))
            row += n
        return ctx.xp.concatenate(outs, axis=1)
    act = ctype(x, "x")
    if x.ndim != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"x {x.shape} and the {w.qtype} weight {w.shape} do not chain")
    M, K = x.shape
    N = w.shape[0]
    out = ctx.xp.empty((M, N), dtype=x.dtype)
    if M == 0 or N == 0:
        return out
    x_stride = row_stride(x, "x", 1)
    has_bias = bias is not None
    if has_bias and (bias.dtype != x.dtype or bias.shape != (N,)):
        raise ValueError(f"bias {bias.shape} {bias.dtype} must be [{N}] of {x.dtype}")
    fmt = program.QUANT_FORMATS[w.qtype]
    args = (out, x, i64(x_stride), w.qs, w.scales, w.mins, bias if has_bias else out, i32(has_bias))
    args += (i32(M), i32(N), i32(K))
    if M <= launch_config.QUANT_GEMV_MAX_M:
        threads = 128
        grid = (-(-N // (threads // 32)), 1, 1)
        ctx.kernel(act, act, f"quant_gemv_kernel<{act}, {fmt}>", grid, (threads, 1, 1), args)
    else:
        grid = (-(-N // launch_config.QG_BN), -(-M // launch_config.QG_BM), 1)
        ctx.kernel(act, act, f"quant_gemm_kernel<{act}, {fmt}>", grid, (launch_config.QG_THREADS, 1, 1), args)
    return out


def embedding(ctx, token_ids, table, scale=None):
    """Rows of ``table [vocab, hidden]`` for ``token_ids [n]``, in the table's dtype (a
    :class:`DeviceQuantized` table's rows are dequantized on lookup, into its activation dtype); with
    ``scale``, times it (``elementwise.scale_rows``: the scale rounded to that dtype, as HF's Gemma)."""
    rows = _embedding_rows(ctx, token_ids, table)
    return rows if scale is None else elementwise.scale_rows(ctx, rows, scale)


def _embedding_rows(ctx, token_ids, table):
    ids = ctx.to_device(token_ids, np.int64)
    if not isinstance(table, DeviceQuantized):
        return ctx.xp.take(table, ids, axis=0)
    act = CTYPES[table.dtype]
    out = ctx.xp.empty((ids.shape[0], table.shape[1]), dtype=table.dtype)
    if ids.shape[0]:
        ctx.kernel(
            act,
            act,
            f"quant_embedding_kernel<{act}, {program.QUANT_FORMATS[table.qtype]}>",
            (ids.shape[0], 1, 1),
            (128, 1, 1),
            (out, ids, table.qs, table.scales, table.mins, i32(table.shape[1])),
        )
    return out
