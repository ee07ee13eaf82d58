// Products and lookups on GGUF block-quantized weights (llama.cpp's Q8_0, Q4_0, Q4_1; ggml-common.h), kept
// in their blocks on the device and dequantized in registers. Semantics follow rawpaged/kernels/cpu_quant.py
// (the reference); the planes are those of rawpaged/kernels/quantization.py:
//   qs:     uint8 [rows, K] (Q8_0: int8 values) or [rows, K / 2] (4-bit: nibble bytes, 16 per block),
//   scales: uint16 [rows, K / 32], fp16 bit patterns (d),
//   mins:   uint16 [rows, K / 32], fp16 bits of Q4_1's m (not read for Q8_0/Q4_0; pass scales).
// Element k of row n, block b = k / 32, j = k % 32:
//   Q8_0: d * q[k];  Q4_0: d * (nib - 8);  Q4_1: d * nib + m,  nib = j < 16 ? qs[16 b + j] & 15
//                                                                          : qs[16 b + j - 16] >> 4.
// FMT: 0 = Q8_0, 1 = Q4_0, 2 = Q4_1. x/out are activations of type T; arithmetic in float32.
#include "common.cuh"

namespace rp {

constexpr int QK = 32;

// IEEE fp16 bits -> float32, exact for every value (zero, subnormal, normal, inf, NaN).
__device__ __forceinline__ float half_bits_to_float(unsigned short h) {
    const unsigned sign = ((unsigned)h & 0x8000u) << 16;
    const unsigned exp = ((unsigned)h >> 10) & 0x1fu;
    const unsigned man = (unsigned)h & 0x3ffu;
    if (exp == 0) {  // zero or subnormal: man * 2^-24
        const float f = (float)man * 5.9604644775390625e-8f;
        return sign ? -f : f;
    }
    const unsigned bits = exp == 0x1fu ? (sign | 0x7f800000u | (man << 13)) : (sign | ((exp + 112u) << 23) | (man << 13));
    return __uint_as_float(bits);
}

// Value k of row n (see the file comment). Q4 rows hold K / 2 bytes.
template <int FMT>
__device__ __forceinline__ float dequant(const unsigned char* __restrict__ qs, const unsigned short* __restrict__ scales,
                                         const unsigned short* __restrict__ mins, i64 n, int K, int k) {
    const int nblk = K / QK;
    const int b = k / QK;
    const float d = half_bits_to_float(scales[n * nblk + b]);
    if constexpr (FMT == 0) {
        return d * (float)(signed char)qs[n * K + k];
    } else {
        const int j = k - b * QK;
        const unsigned byte = qs[n * (K / 2) + b * 16 + (j & 15)];
        const float nib = (float)(j < 16 ? (byte & 15u) : (byte >> 4));
        const float m = FMT == 2 ? half_bits_to_float(mins[n * nblk + b]) : -8.f * d;
        return d * nib + m;
    }
}

}  // namespace rp

// out[m, n] = sum_k x[m, k] * W[n, k] (+ bias[n] when has_bias; bias: [N] of T, any array otherwise)
// for M <= QUANT_GEMV_MAX_M rows of x (decode): one warp per weight row,
// each lane taking 8 consecutive values of a block per step, so a warp reads 256 values of the row at a time
// and every weight byte is read once for all M rows.
// grid: (ceil(N / warps per block)), block: multiple of 32. x: [M, K] (row stride x_stride), out: [M, N]
// contiguous. K a multiple of 32.
constexpr int QUANT_GEMV_MAX_M = 8;
template <typename T, int FMT>
__global__ void quant_gemv_kernel(T* __restrict__ out, const T* __restrict__ x, long long x_stride,
                                  const unsigned char* __restrict__ qs, const unsigned short* __restrict__ scales,
                                  const unsigned short* __restrict__ mins, const T* __restrict__ bias,
                                  int has_bias, int M, int N, int K) {
    const int warps = blockDim.x >> 5;
    const rp::i64 n = (rp::i64)blockIdx.x * warps + (threadIdx.x >> 5);
    const int lane = threadIdx.x & 31;
    if (n >= N) return;  // whole warp: the row index is warp-uniform
    float acc[QUANT_GEMV_MAX_M];
#pragma unroll
    for (int m = 0; m < QUANT_GEMV_MAX_M; ++m) acc[m] = 0.f;
    for (int k0 = lane * 8; k0 < K; k0 += 256) {
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            const float w = rp::dequant<FMT>(qs, scales, mins, n, K, k0 + i);
#pragma unroll
            for (int m = 0; m < QUANT_GEMV_MAX_M; ++m) {
                if (m < M) acc[m] += w * rp::to_float<T>(x[m * x_stride + k0 + i]);
            }
        }
    }
#pragma unroll
    for (int m = 0; m < QUANT_GEMV_MAX_M; ++m) {
        if (m < M) {  // M is uniform: every lane takes part in the shuffles
            const float s = rp::warp_sum(acc[m]) + (has_bias ? rp::to_float<T>(bias[n]) : 0.f);
            if (lane == 0) out[(rp::i64)m * N + n] = rp::from_float<T>(s);
        }
    }
}

// out[m, n] = sum_k x[m, k] * W[n, k] (+ bias[n] when has_bias), tiled for any M (prefill, large batches): a block computes a
// QG_BM x QG_BN tile of out; per step it stages QG_BM x 32 of x and one quant block (32 values) of QG_BN
// weight rows, dequantized, in shared memory. Each of the 256 threads owns one column and QG_BM / 4 rows.
// grid: (ceil(N / QG_BN), ceil(M / QG_BM)), block: (256). x: [M, K] (row stride x_stride), out: [M, N]
// contiguous. K a multiple of 32.
constexpr int QG_BM = 32, QG_BN = 64, QG_THREADS = 256, QG_ROWS = QG_BM / (QG_THREADS / QG_BN);
template <typename T, int FMT>
__global__ void quant_gemm_kernel(T* __restrict__ out, const T* __restrict__ x, long long x_stride,
                                  const unsigned char* __restrict__ qs, const unsigned short* __restrict__ scales,
                                  const unsigned short* __restrict__ mins, const T* __restrict__ bias,
                                  int has_bias, int M, int N, int K) {
    __shared__ float xs[QG_BM][rp::QK + 1];
    __shared__ float ws[QG_BN][rp::QK + 1];
    const int n0 = blockIdx.x * QG_BN;
    const rp::i64 m0 = (rp::i64)blockIdx.y * QG_BM;
    const int col = threadIdx.x % QG_BN;
    const int row0 = (threadIdx.x / QG_BN) * QG_ROWS;
    float acc[QG_ROWS];
#pragma unroll
    for (int r = 0; r < QG_ROWS; ++r) acc[r] = 0.f;
    for (int k0 = 0; k0 < K; k0 += rp::QK) {
        for (int i = threadIdx.x; i < QG_BM * rp::QK; i += QG_THREADS) {
            const int r = i / rp::QK, c = i % rp::QK;
            xs[r][c] = m0 + r < M ? rp::to_float<T>(x[(m0 + r) * x_stride + k0 + c]) : 0.f;
        }
        for (int i = threadIdx.x; i < QG_BN * rp::QK; i += QG_THREADS) {
            const int r = i / rp::QK, c = i % rp::QK;
            ws[r][c] = n0 + r < N ? rp::dequant<FMT>(qs, scales, mins, n0 + r, K, k0 + c) : 0.f;
        }
        __syncthreads();
#pragma unroll 8
        for (int c = 0; c < rp::QK; ++c) {
            const float w = ws[col][c];
#pragma unroll
            for (int r = 0; r < QG_ROWS; ++r) acc[r] += xs[row0 + r][c] * w;
        }
        __syncthreads();  // the tiles are refilled next step
    }
    if (n0 + col < N) {
        const float b = has_bias ? rp::to_float<T>(bias[n0 + col]) : 0.f;
#pragma unroll
        for (int r = 0; r < QG_ROWS; ++r) {
            if (m0 + row0 + r < M) out[(m0 + row0 + r) * N + n0 + col] = rp::from_float<T>(acc[r] + b);
        }
    }
}

// out[t, :] = row token_ids[t] of a quantized [vocab, K] table, dequantized (the embedding lookup).
// grid: (num_tokens), block: any. out: [num_tokens, K] contiguous; token_ids: int64, each in [0, vocab).
template <typename T, int FMT>
__global__ void quant_embedding_kernel(T* __restrict__ out, const long long* __restrict__ token_ids,
                                       const unsigned char* __restrict__ qs, const unsigned short* __restrict__ scales,
                                       const unsigned short* __restrict__ mins, int K) {
    const rp::i64 t = blockIdx.x;
    const rp::i64 n = token_ids[t];
    for (int k = threadIdx.x; k < K; k += blockDim.x) {
        out[t * K + k] = rp::from_float<T>(rp::dequant<FMT>(qs, scales, mins, n, K, k));
    }
}
