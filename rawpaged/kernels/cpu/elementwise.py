"""The CPU's dense per-token ops in Numba: RMSNorm (with the residual add fused), RoPE, SwiGLU and the
gated GeLU-tanh (GeGLU, Gemma's MLP).

float32 activations ``[num_tokens, ...]``; the ``*_rows`` kernels are also called from compiled code
(``fused_decode``).
"""

from __future__ import annotations

import numba as nb
import numpy as np

from rawpaged.kernels.cpu.intrinsics import exp_f32
from rawpaged.kernels.cpu.jit import JIT


@nb.njit(**JIT)  # serial: one row is 0.5-4k values; a parallel region costs more than it saves
def rms_norm_rows(x, weight, eps, out):
    T, H = x.shape
    for t in range(T):
        row = x[t]
        ss = np.float32(0.0)
        for i in range(H):
            ss += row[i] * row[i]
        r = np.float32(1.0) / np.sqrt(ss / np.float32(H) + eps)
        for i in range(H):
            out[t, i] = row[i] * r * weight[i]


@nb.njit(**JIT)
def add_rms_norm_rows(x, residual, weight, eps, out):
    T, H = x.shape
    for t in range(T):
        res = residual[t]
        ss = np.float32(0.0)
        for i in range(H):
            v = res[i] + x[t, i]
            res[i] = v
            ss += v * v
        r = np.float32(1.0) / np.sqrt(ss / np.float32(H) + eps)
        for i in range(H):
            out[t, i] = res[i] * r * weight[i]


def rms_norm(x, weight, eps, residual=None):
    """RMSNorm (Zhang & Sennrich 2019): ``x / sqrt(mean(x^2) + eps) * weight``.

    With ``residual`` (vLLM's fused_add_rms_norm): ``residual += x`` in place first, and the norm of
    the sum is returned. x, residual: float32 ``[num_tokens, hidden]``; weight ``[hidden]``. Returns a
    new float32 ``[num_tokens, hidden]``. One Numba pass per row (sum of squares in float32).
    """
    out = np.empty(x.shape, np.float32)
    if residual is None:
        rms_norm_rows(x, weight, np.float32(eps), out)
    else:
        add_rms_norm_rows(x, residual, weight, np.float32(eps), out)
    return out


@nb.njit(**JIT)
def rotate_half(positions, x, cos_sin_cache):
    T, H, D = x.shape
    half = D // 2
    for t in range(T):
        cs = cos_sin_cache[positions[t]]
        for h in range(H):
            v = x[t, h]
            for i in range(half):
                x1 = v[i]
                x2 = v[half + i]
                v[i] = x1 * cs[i] - x2 * cs[half + i]
                v[half + i] = x2 * cs[i] + x1 * cs[half + i]


def rotary_embedding(positions, query, key, cos_sin_cache):
    """Apply RoPE (Su et al. 2021) in place, HF/NeoX "rotate_half" layout.

    positions: int64 ``[num_tokens]``; query ``[num_tokens, num_heads, head_dim]``,
    key ``[num_tokens, num_kv_heads, head_dim]`` float32; cos_sin_cache float32
    ``[max_position, head_dim]`` = concat(cos, sin) of ``pos * theta^(-2i/head_dim)``, i < head_dim/2.
    """
    positions = np.asarray(positions, dtype=np.int64)
    rotate_half(positions, query, cos_sin_cache)
    rotate_half(positions, key, cos_sin_cache)


# serial: with the vector exp, a 32-token decode step's rows take ~20 us; NumPy's division semantics
# (no ZeroDivisionError check, whose branch keeps the loop scalar)
@nb.njit(error_model="numpy", **JIT)
def silu_and_mul_rows(x, out):
    inter = out.shape[1]
    for t in range(x.shape[0]):
        gate = x[t, :inter]
        up = x[t, inter:]
        o = out[t]
        for i in range(inter):
            o[i] = gate[i] / (np.float32(1.0) + exp_f32(-gate[i])) * up[i]


def silu_and_mul(x):
    """SwiGLU (Shazeer 2020): x float32 ``[num_tokens, 2 * inter]`` -> a new float32 ``[num_tokens,
    inter]`` = ``silu(x[:, :inter]) * x[:, inter:]``, ``silu(g) = g / (1 + exp(-g))``, in one Numba pass
    with the vectorized ``intrinsics.exp_f32`` (~1 ulp; ``exp`` clamped to [-87, 88], where silu is g or 0 to
    float32 precision)."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    out = np.empty((x.shape[0], x.shape[1] // 2), np.float32)
    silu_and_mul_rows(x, out)
    return out


#: sqrt(2 / pi), the tanh approximation's constant (Hendrycks & Gimpel 2016)
GELU_TANH_K = np.float32(0.7978845608028654)


@nb.njit(error_model="numpy", **JIT)
def gelu_tanh_and_mul_rows(x, out):
    inter = out.shape[1]
    for t in range(x.shape[0]):
        gate = x[t, :inter]
        up = x[t, inter:]
        o = out[t]
        for i in range(inter):
            g = gate[i]
            inner = GELU_TANH_K * (g + np.float32(0.044715) * g * g * g)
            o[i] = g / (np.float32(1.0) + exp_f32(np.float32(-2.0) * inner)) * up[i]


def gelu_tanh_and_mul(x):
    """GeGLU with the tanh GeLU (Shazeer 2020; PyTorch's ``gelu(approximate="tanh")``, HF's
    ``gelu_pytorch_tanh``; vLLM's ``gelu_tanh_and_mul``): x float32 ``[num_tokens, 2 * inter]`` -> a new
    float32 ``[num_tokens, inter]`` = ``gelu(x[:, :inter]) * x[:, inter:]`` with ``gelu(g) = 0.5 g (1 +
    tanh(sqrt(2 / pi) (g + 0.044715 g^3)))``, in one Numba pass (float32 math). It is computed as ``g /
    (1 + exp(-2 u))`` (``0.5 (1 + tanh(u)) = sigmoid(2 u)``) with the vectorized ``intrinsics.exp_f32``:
    libm's ``tanh`` is scalar, and the sigmoid form has no cancellation where ``tanh(u)`` nears -1."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    out = np.empty((x.shape[0], x.shape[1] // 2), np.float32)
    gelu_tanh_and_mul_rows(x, out)
    return out
