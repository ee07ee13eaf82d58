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
// The 5-bit formats and the K-quants (FMT 3 = Q5_0, 4 = Q5_1, 5 = Q4_K, 6 = Q5_K, 7 = Q6_K) are read in their
// GGUF blocks as they are: qs is uint8 [rows, K / block values * block bytes] and scales/mins are not read
// (ggml's block_q5_0, block_q5_1, block_q4_K, block_q5_K, block_q6_K; dequantize_row_* in ggml-quants.c;
// the layouts are spelled out in rawpaged/kernels/quantization.py).
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

__device__ __forceinline__ float half_at(const unsigned char* p) {
    return half_bits_to_float((unsigned short)(p[0] | (p[1] << 8)));
}

// Q4_K/Q5_K: the 6-bit scale and min of sub-block j (0-7) from the 12 packed bytes (get_scale_min_k4).
__device__ __forceinline__ void scale_min_k4(int j, const unsigned char* q, int& sc, int& m) {
    if (j < 4) {
        sc = q[j] & 63;
        m = q[j + 4] & 63;
    } else {
        sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
        m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

// Value k of a row of sub-block-format blocks (FMT 3-7) starting at row.
template <int FMT>
__device__ __forceinline__ float dequant_block_format(const unsigned char* __restrict__ row, int k) {
    constexpr int PER = FMT <= 4 ? 32 : 256;
    constexpr int SIZE = FMT == 3 ? 22 : FMT == 4 ? 24 : FMT == 5 ? 144 : FMT == 6 ? 176 : 210;
    const unsigned char* blk = row + (i64)(k / PER) * SIZE;
    const int j = k % PER;
    if constexpr (FMT == 3 || FMT == 4) {
        const int head = FMT == 3 ? 2 : 4;
        const unsigned qh = blk[head] | (blk[head + 1] << 8) | (blk[head + 2] << 16) | ((unsigned)blk[head + 3] << 24);
        const unsigned byte = blk[head + 4 + (j & 15)];
        const int q = (int)((j < 16 ? byte & 15u : byte >> 4) | (((qh >> j) & 1u) << 4));
        const float d = half_at(blk);
        return FMT == 3 ? d * (float)(q - 16) : d * (float)q + half_at(blk + 2);
    } else if constexpr (FMT == 5 || FMT == 6) {
        const int s = j / 32, l = j % 32;
        int sc, m;
        scale_min_k4(s, blk + 4, sc, m);
        const unsigned char* q4 = blk + (FMT == 5 ? 16 : 48);
        const unsigned byte = q4[32 * (s / 2) + l];
        unsigned q = (s & 1) ? byte >> 4 : byte & 15u;
        if constexpr (FMT == 6) q |= ((blk[16 + l] >> s) & 1u) << 4;
        return half_at(blk) * (float)sc * (float)q - half_at(blk + 2) * (float)m;
    } else {  // Q6_K: ql[128], qh[64], int8 scales[16], d
        const int half = j / 128, r = j % 128, quarter = r / 32, l = r % 32;
        const unsigned ql = blk[64 * half + l + 32 * (quarter & 1)];
        const unsigned nib = quarter < 2 ? ql & 15u : ql >> 4;
        const unsigned h = (blk[128 + 32 * half + l] >> (2 * quarter)) & 3u;
        const int q = (int)(nib | (h << 4)) - 32;
        const float sc = (float)(signed char)blk[192 + 8 * half + l / 16 + 2 * quarter];
        return half_at(blk + 208) * sc * (float)q;
    }
}

// Value k of row n (see the file comment). Q4 rows hold K / 2 bytes.
template <int FMT>
__device__ __forceinline__ float dequant(const unsigned char* __restrict__ qs, const unsigned short* __restrict__ scales,
                                         const unsigned short* __restrict__ mins, i64 n, int K, int k) {
    if constexpr (FMT >= 3) {
        constexpr int PER = FMT <= 4 ? 32 : 256;
        constexpr int SIZE = FMT == 3 ? 22 : FMT == 4 ? 24 : FMT == 5 ? 144 : FMT == 6 ? 176 : 210;
        return dequant_block_format<FMT>(qs + n * (i64)(K / PER) * SIZE, k);
    }
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

// Weight rows as the product bodies below read them: value k of row n, float32. BlockWeights<FMT> reads
// GGUF blocks (K a multiple of the block, no bound checks); FloatWeights<W> a dense [rows, K] array of W
// (any K: values past K read as 0, so the bodies need no multiple of 32).
template <int FMT> struct BlockWeights {
    const unsigned char* __restrict__ qs;
    const unsigned short* __restrict__ scales;
    const unsigned short* __restrict__ mins;
    static constexpr bool ANY_K = false;
    __device__ __forceinline__ float at(i64 n, int K, int k) const { return dequant<FMT>(qs, scales, mins, n, K, k); }
};
template <typename W> struct FloatWeights {
    const W* __restrict__ w;
    static constexpr bool ANY_K = true;
    __device__ __forceinline__ float at(i64 n, int K, int k) const { return k < K ? to_float<W>(w[n * K + k]) : 0.f; }
};

}  // namespace rp

// The GEMV body: one warp computes out[m * out_stride] = sum_k x[m, k] * W[w_row, k] + b for m < M <= 8,
// each lane taking 8 consecutive values of a block per step, so a warp reads 256 values of the row at a time
// and every weight byte is read once for all M rows. out points at column n of row 0; every lane calls it.
constexpr int QUANT_GEMV_MAX_M = 8;
template <typename T, typename Wt>
__device__ __forceinline__ void gemv_warp_rows(T* __restrict__ out, rp::i64 out_stride, const T* __restrict__ x,
                                               rp::i64 x_stride, const Wt& w, rp::i64 w_row, float b, int M, int K,
                                               int lane) {
    float acc[QUANT_GEMV_MAX_M];
#pragma unroll
    for (int m = 0; m < QUANT_GEMV_MAX_M; ++m) acc[m] = 0.f;
    for (int k0 = lane * 8; k0 < K; k0 += 256) {
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            if (Wt::ANY_K && k0 + i >= K) break;
            const float wv = w.at(w_row, K, k0 + i);
#pragma unroll
            for (int m = 0; m < QUANT_GEMV_MAX_M; ++m) {
                if (m < M) acc[m] += wv * rp::to_float<T>(x[m * x_stride + k0 + i]);
            }
        }
    }
#pragma unroll
    for (int m = 0; m < QUANT_GEMV_MAX_M; ++m) {
        if (m < M) {  // M is uniform: every lane takes part in the shuffles
            const float s = rp::warp_sum(acc[m]) + b;
            if (lane == 0) out[(rp::i64)m * out_stride] = rp::from_float<T>(s);
        }
    }
}

// The tiled GEMM body: a block computes the QG_BM x QG_BN tile (rows m0.., columns n0..) of out[m, n] =
// sum_k x[m, k] * W[w_row0 + n, k] (+ bias[n] when has_bias), m < M, n < N; per step it stages QG_BM x 32
// of x and 32 values of QG_BN weight rows, dequantized, in shared memory. Each of the 256 threads owns one
// column and QG_BM / 4 rows. out: row stride N.
constexpr int QG_BM = 32, QG_BN = 64, QG_THREADS = 256, QG_ROWS = QG_BM / (QG_THREADS / QG_BN);
template <typename T, typename Wt>
__device__ __forceinline__ void gemm_tile(T* __restrict__ out, const T* __restrict__ x, rp::i64 x_stride, const Wt& w,
                                          rp::i64 w_row0, const T* __restrict__ bias, int has_bias, int M, int N,
                                          int K, int n0, rp::i64 m0) {
    __shared__ float xs[QG_BM][rp::QK + 1];
    __shared__ float ws[QG_BN][rp::QK + 1];
    const int col = threadIdx.x % QG_BN;
    const int row0 = (threadIdx.x / QG_BN) * QG_ROWS;
    float acc[QG_ROWS];
#pragma unroll
    for (int r = 0; r < QG_ROWS; ++r) acc[r] = 0.f;
    for (int k0 = 0; k0 < K; k0 += rp::QK) {
        for (int i = threadIdx.x; i < QG_BM * rp::QK; i += QG_THREADS) {
            const int r = i / rp::QK, c = i % rp::QK;
            const bool in = m0 + r < M && (!Wt::ANY_K || k0 + c < K);
            xs[r][c] = in ? rp::to_float<T>(x[(m0 + r) * x_stride + k0 + c]) : 0.f;
        }
        for (int i = threadIdx.x; i < QG_BN * rp::QK; i += QG_THREADS) {
            const int r = i / rp::QK, c = i % rp::QK;
            ws[r][c] = n0 + r < N ? w.at(w_row0 + n0 + r, K, k0 + c) : 0.f;
        }
        __syncthreads();
#pragma unroll 8
        for (int c = 0; c < rp::QK; ++c) {
            const float wv = ws[col][c];
#pragma unroll
            for (int r = 0; r < QG_ROWS; ++r) acc[r] += xs[row0 + r][c] * wv;
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

// out[m, n] = sum_k x[m, k] * W[n, k] (+ bias[n] when has_bias; bias: [N] of T, any array otherwise)
// for M <= QUANT_GEMV_MAX_M rows of x (decode): one warp per weight row (gemv_warp_rows).
// grid: (ceil(N / warps per block)), block: multiple of 32. x: [M, K] (row stride x_stride), out: [M, N]
// contiguous. K a multiple of 32.
template <typename T, int FMT>
__global__ void quant_gemv_kernel(T* __restrict__ out, const T* __restrict__ x, long long x_stride,
                                  const unsigned char* __restrict__ qs, const unsigned short* __restrict__ scales,
                                  const unsigned short* __restrict__ mins, const T* __restrict__ bias,
                                  int has_bias, int M, int N, int K) {
    const int warps = blockDim.x >> 5;
    const rp::i64 n = (rp::i64)blockIdx.x * warps + (threadIdx.x >> 5);
    if (n >= N) return;  // whole warp: the row index is warp-uniform
    const float b = has_bias ? rp::to_float<T>(bias[n]) : 0.f;
    gemv_warp_rows<T>(out + n, N, x, x_stride, rp::BlockWeights<FMT>{qs, scales, mins}, n, b, M, K, threadIdx.x & 31);
}

// out[m, n] = sum_k x[m, k] * W[n, k] (+ bias[n] when has_bias), tiled for any M (prefill, large batches):
// one QG_BM x QG_BN tile of out per block (gemm_tile).
// grid: (ceil(N / QG_BN), ceil(M / QG_BM)), block: (256). x: [M, K] (row stride x_stride), out: [M, N]
// contiguous. K a multiple of 32.
template <typename T, int FMT>
__global__ void quant_gemm_kernel(T* __restrict__ out, const T* __restrict__ x, long long x_stride,
                                  const unsigned char* __restrict__ qs, const unsigned short* __restrict__ scales,
                                  const unsigned short* __restrict__ mins, const T* __restrict__ bias,
                                  int has_bias, int M, int N, int K) {
    gemm_tile<T>(out, x, x_stride, rp::BlockWeights<FMT>{qs, scales, mins}, 0, bias, has_bias, M, N, K,
                 blockIdx.x * QG_BN, (rp::i64)blockIdx.y * QG_BM);
}

// ------------------------------------------------------------------------------ mixture of experts
// Grouped products of a mixture of experts (rawpaged/kernels/cpu/moe.py's grouped_linear): x's rows are
// sorted by expert, expert e's rows are offsets[e] .. offsets[e + 1] (int64 [E + 1]), and out[r] = x[r] @
// W_e.T with W_e rows e * N .. e * N + N - 1 of the stacked weight ([E * N, K]: float W, or the GGUF planes
// of the E experts one after another). One launch covers every expert: grid.y runs over the row tiles that
// cuda/moe.cu's moe_tiles_kernel lists (tiles[0] the count, tiles[1 + 2 t], tiles[2 + 2 t] tile t's expert
// and first row within the expert's rows; grid.y is an upper bound, blocks past the count return), grid.x
// over the weight rows. An expert with no rows has no tile, so its weights are never read. The same bodies
// as the dense products: per weight row and tile of QUANT_GEMV_MAX_M rows (moe_*gemv_kernel, decode: one
// warp per weight row, grid.x = ceil(N / warps)), or QG_BM x QG_BN tiles (moe_*gemm_kernel, grid.x =
// ceil(N / QG_BN), block 256). x: [M, K] (row stride x_stride), out: [M, N] contiguous; no bias.
template <typename T, typename Wt>
__device__ __forceinline__ void moe_gemv_tile(T* __restrict__ out, const T* __restrict__ x, long long x_stride,
                                              const Wt& w, const long long* __restrict__ offsets,
                                              const int* __restrict__ tiles, int N, int K) {
    if ((int)blockIdx.y >= tiles[0]) return;
    const int e = tiles[1 + 2 * blockIdx.y];
    const rp::i64 r0 = offsets[e] + tiles[2 + 2 * blockIdx.y];
    const rp::i64 left = offsets[e + 1] - r0;
    const int rows = left < QUANT_GEMV_MAX_M ? (int)left : QUANT_GEMV_MAX_M;
    const rp::i64 n = (rp::i64)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (n >= N) return;  // whole warp
    gemv_warp_rows<T>(out + r0 * N + n, N, x + r0 * x_stride, x_stride, w, (rp::i64)e * N + n, 0.f, rows, K,
                      threadIdx.x & 31);
}

template <typename T, typename Wt>
__device__ __forceinline__ void moe_gemm_tile(T* __restrict__ out, const T* __restrict__ x, long long x_stride,
                                              const Wt& w, const long long* __restrict__ offsets,
                                              const int* __restrict__ tiles, int N, int K) {
    if ((int)blockIdx.y >= tiles[0]) return;  // the whole block: no barrier is skipped by some threads only
    const int e = tiles[1 + 2 * blockIdx.y];
    const rp::i64 r0 = offsets[e] + tiles[2 + 2 * blockIdx.y];
    const rp::i64 left = offsets[e + 1] - r0;
    const int rows = left < QG_BM ? (int)left : QG_BM;
    gemm_tile<T>(out + r0 * N, x + r0 * x_stride, x_stride, w, (rp::i64)e * N, out, 0, rows, N, K,
                 blockIdx.x * QG_BN, 0);
}

// Float experts of the activation dtype T ([E * N, K], as the dense CUDA path stores float weights).
template <typename T>
__global__ void moe_gemv_kernel(T* __restrict__ out, const T* __restrict__ x, long long x_stride,
                                const T* __restrict__ w, const long long* __restrict__ offsets,
                                const int* __restrict__ tiles, int N, int K) {
    moe_gemv_tile<T>(out, x, x_stride, rp::FloatWeights<T>{w}, offsets, tiles, N, K);
}

template <typename T>
__global__ void moe_gemm_kernel(T* __restrict__ out, const T* __restrict__ x, long long x_stride,
                                const T* __restrict__ w, const long long* __restrict__ offsets,
                                const int* __restrict__ tiles, int N, int K) {
    moe_gemm_tile<T>(out, x, x_stride, rp::FloatWeights<T>{w}, offsets, tiles, N, K);
}

// GGUF-quantized experts of format FMT, read in their blocks as the dense quant_* kernels read them.
template <typename T, int FMT>
__global__ void moe_quant_gemv_kernel(T* __restrict__ out, const T* __restrict__ x, long long x_stride,
                                      const unsigned char* __restrict__ qs, const unsigned short* __restrict__ scales,
                                      const unsigned short* __restrict__ mins, const long long* __restrict__ offsets,
                                      const int* __restrict__ tiles, int N, int K) {
    moe_gemv_tile<T>(out, x, x_stride, rp::BlockWeights<FMT>{qs, scales, mins}, offsets, tiles, N, K);
}

template <typename T, int FMT>
__global__ void moe_quant_gemm_kernel(T* __restrict__ out, const T* __restrict__ x, long long x_stride,
                                      const unsigned char* __restrict__ qs, const unsigned short* __restrict__ scales,
                                      const unsigned short* __restrict__ mins, const long long* __restrict__ offsets,
                                      const int* __restrict__ tiles, int N, int K) {
    moe_gemm_tile<T>(out, x, x_stride, rp::BlockWeights<FMT>{qs, scales, mins}, offsets, tiles, N, K);
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
