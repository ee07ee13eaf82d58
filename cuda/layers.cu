// Dense per-token layers: RMSNorm (optionally fused with the residual add), rotary embedding (RoPE),
// SiLU-and-mul (SwiGLU) and GeLU-tanh-and-mul (GeGLU). Semantics follow rawpaged/kernels/cpu/elementwise.py (vLLM's csrc/layernorm_kernels.cu,
// csrc/pos_encoding_kernels.cu and csrc/activation_kernels.cu name the same operations).
// Arithmetic in float32; results rounded to the activation dtype T on store.
#include "common.cuh"

// RMSNorm (Zhang & Sennrich 2019): out = x / sqrt(mean(x^2) + eps) * weight.
// With has_residual (vLLM's fused_add_rms_norm): residual += x first (stored in T), and the norm of the
// stored sum is written to out.
// grid: (num_tokens), block: multiple of 32, at most 1024 (host: min(1024, round_up(hidden, 32))).
// x, out, residual: [num_tokens, hidden] with row strides (elements); out may alias x. weight: [hidden].
template <typename T, typename W>
__global__ void rms_norm_kernel(T* out, long long out_stride, const T* x, long long x_stride, T* residual,
                                long long residual_stride, const W* __restrict__ weight, float eps,
                                int hidden, int has_residual) {
    __shared__ float scratch[32];
    const rp::i64 t = blockIdx.x;
    const T* xr = x + t * x_stride;
    T* outr = out + t * out_stride;
    T* resr = has_residual ? residual + t * residual_stride : nullptr;
    float ss = 0.f;
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) {
        float v = rp::to_float<T>(xr[i]);
        if (has_residual) {
            const T stored = rp::from_float<T>(v + rp::to_float<T>(resr[i]));
            resr[i] = stored;
            v = rp::to_float<T>(stored);
        }
        ss += v * v;
    }
    const float inv_rms = rsqrtf(rp::block_sum(ss, scratch) / (float)hidden + eps);
    const T* src = has_residual ? resr : xr;  // same thread re-reads what it wrote: no sync needed
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) {
        outr[i] = rp::from_float<T>(rp::to_float<T>(src[i]) * inv_rms * rp::to_float<W>(weight[i]));
    }
}

// RoPE (Su et al. 2021), HF/NeoX "rotate_half" layout, in place on query and key:
//   x[j] <- x[j] cos - x[j + D/2] sin,  x[j + D/2] <- x[j + D/2] cos + x[j] sin,  j < D/2,
// with cos/sin = cos_sin_cache[positions[t], :D/2] / [D/2:].
// grid: (num_tokens), block: multiple of 32 (host: min(512, round_up((H + Hkv) * D/2, 32))).
// query: [num_tokens, num_heads, D] (token stride q_stride), key: [num_tokens, num_kv_heads, D]
// (token stride k_stride), positions: int64 [num_tokens], cos_sin_cache: float32 [max_position, D].
template <typename T>
__global__ void rotary_embedding_kernel(const long long* __restrict__ positions, T* __restrict__ query,
                                        long long q_stride, T* __restrict__ key, long long k_stride,
                                        const float* __restrict__ cos_sin_cache, int num_heads,
                                        int num_kv_heads, int head_dim) {
    const rp::i64 t = blockIdx.x;
    const int half = head_dim / 2;
    const float* __restrict__ cs = cos_sin_cache + positions[t] * (rp::i64)head_dim;
    const int pairs = (num_heads + num_kv_heads) * half;
    for (int i = threadIdx.x; i < pairs; i += blockDim.x) {
        const int h = i / half;
        const int j = i - h * half;
        T* row = h < num_heads ? query + t * q_stride + (rp::i64)h * head_dim
                               : key + t * k_stride + (rp::i64)(h - num_heads) * head_dim;
        const float x1 = rp::to_float<T>(row[j]);
        const float x2 = rp::to_float<T>(row[j + half]);
        const float c = cs[j];
        const float s = cs[j + half];
        row[j] = rp::from_float<T>(x1 * c - x2 * s);
        row[j + half] = rp::from_float<T>(x2 * c + x1 * s);
    }
}

// SwiGLU (Shazeer 2020): out[t, j] = silu(x[t, j]) * x[t, inter + j], silu(g) = g / (1 + exp(-g)).
// x: [num_tokens, 2 * inter], out: [num_tokens, inter], both contiguous. Grid-stride loop over
// num_tokens * inter elements (64-bit index); any grid/block size works.
template <typename T>
__global__ void silu_and_mul_kernel(T* __restrict__ out, const T* __restrict__ x, long long num_tokens,
                                    int inter) {
    const rp::i64 n = num_tokens * inter;
    const rp::i64 stride = (rp::i64)gridDim.x * blockDim.x;
    for (rp::i64 i = (rp::i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        const rp::i64 t = i / inter;
        const rp::i64 j = i - t * inter;
        const float g = rp::to_float<T>(x[t * 2 * inter + j]);
        const float u = rp::to_float<T>(x[t * 2 * inter + inter + j]);
        out[i] = rp::from_float<T>(g / (1.f + expf(-g)) * u);
    }
}

// GeGLU with PyTorch's tanh GeLU (HF's gelu_pytorch_tanh; Gemma's MLP): out[t, j] = gelu(x[t, j]) *
// x[t, inter + j], gelu(g) = 0.5 g (1 + tanh(sqrt(2 / pi) (g + 0.044715 g^3))).
// Layout and launch as silu_and_mul_kernel.
template <typename T>
__global__ void gelu_tanh_and_mul_kernel(T* __restrict__ out, const T* __restrict__ x, long long num_tokens,
                                         int inter) {
    const rp::i64 n = num_tokens * inter;
    const rp::i64 stride = (rp::i64)gridDim.x * blockDim.x;
    for (rp::i64 i = (rp::i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        const rp::i64 t = i / inter;
        const rp::i64 j = i - t * inter;
        const float g = rp::to_float<T>(x[t * 2 * inter + j]);
        const float u = rp::to_float<T>(x[t * 2 * inter + inter + j]);
        const float inner = 0.7978845608028654f * (g + 0.044715f * g * g * g);
        out[i] = rp::from_float<T>(0.5f * g * (1.f + tanhf(inner)) * u);
    }
}
