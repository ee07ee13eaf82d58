// Shared helpers for the rawpaged CUDA kernels (cache.cu, attention.cu, layers.cu).
//
// Compiled by NVRTC through cupy.RawModule (the runtime concatenates this header with the .cu files, see
// rawpaged/kernels/cuda/program.py) and by g++ through the CPU emulation in tests/cuda_emu/.
// NVRTC rules followed here: no <stdint.h>/<cmath>, no INFINITY macro, templates instantiated only through
// name expressions (so every instantiation the runtime uses is listed in program.py).
//
// Element types: float, __half, __nv_bfloat16. Arithmetic is always float32 (convert on load, round on
// store with round-to-nearest-even). All offsets into activations and caches are 64-bit (long long).
#pragma once

#ifndef RP_EMULATION
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#endif

namespace rp {

typedef long long i64;

constexpr unsigned FULL_MASK = 0xffffffffu;
constexpr float NEG_BIG = -3.0e38f;  // "minus infinity" that stays finite (no INFINITY under NVRTC)

// ------------------------------------------------------------------------------ conversions
template <typename T> __device__ __forceinline__ float to_float(T x);
template <> __device__ __forceinline__ float to_float<float>(float x) { return x; }
template <> __device__ __forceinline__ float to_float<__half>(__half x) { return __half2float(x); }
template <> __device__ __forceinline__ float to_float<__nv_bfloat16>(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
    return __float2bfloat16_rn(x);
}

// Dtype conversion for copies: identity when the types match (bit-exact), else through float32.
template <typename D, typename S> struct Convert {
    static __device__ __forceinline__ D apply(S x) { return from_float<D>(to_float<S>(x)); }
};
template <typename T> struct Convert<T, T> {
    static __device__ __forceinline__ T apply(T x) { return x; }
};

// ------------------------------------------------------------------------------ vector loads
// N contiguous elements of T loaded with the widest aligned vector access (at most 16 bytes per access)
// and widened to float. The caller guarantees alignment to min(16, N * sizeof(T)) bytes.
template <int BYTES> struct RawWord;
template <> struct RawWord<2> { typedef unsigned short type; };
template <> struct RawWord<4> { typedef unsigned int type; };
template <> struct RawWord<8> { typedef uint2 type; };
template <> struct RawWord<16> { typedef uint4 type; };

template <typename T, int N> struct alignas(N * sizeof(T)) Pack {
    T v[N];
};

template <typename T, int N>
__device__ __forceinline__ void load_floats(const T* __restrict__ src, float* dst) {
    constexpr int BYTES = N * (int)sizeof(T);
    if constexpr (BYTES <= 16 && (BYTES & (BYTES - 1)) == 0) {
        const Pack<T, N> p = *reinterpret_cast<const Pack<T, N>*>(src);
#pragma unroll
        for (int i = 0; i < N; ++i) dst[i] = to_float<T>(p.v[i]);
    } else if constexpr (BYTES % 16 == 0) {
        constexpr int M = 16 / (int)sizeof(T);
#pragma unroll
        for (int c = 0; c < N / M; ++c) {
            const Pack<T, M> p = *reinterpret_cast<const Pack<T, M>*>(src + c * M);
#pragma unroll
            for (int i = 0; i < M; ++i) dst[c * M + i] = to_float<T>(p.v[i]);
        }
    } else {
#pragma unroll
        for (int i = 0; i < N; ++i) dst[i] = to_float<T>(src[i]);
    }
}

// ------------------------------------------------------------------------------ warp / block reductions
// All 32 lanes of the warp must call these (callers keep loop trip counts warp-uniform).
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL_MASK, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(FULL_MASK, v, o));
    return v;
}

// Sum over the whole block (blockDim.x a multiple of 32, at most 1024); every thread gets the result.
// `scratch` is >= 32 floats of shared memory; the function syncs before returning and before reuse.
__device__ __forceinline__ float block_sum(float v, float* scratch) {
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int num_warps = blockDim.x >> 5;
    v = warp_sum(v);
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    float total = 0.f;
    for (int w = 0; w < num_warps; ++w) total += scratch[w];
    __syncthreads();  // scratch may be reused right after
    return total;
}

}  // namespace rp

// Dynamic shared memory as a float array (size set at launch; 16-byte aligned).
#ifdef RP_EMULATION
#define RP_DYNAMIC_SMEM(name) float* name = reinterpret_cast<float*>(::emu::dynamic_smem())
#else
#define RP_DYNAMIC_SMEM(name)                  \
    extern __shared__ float4 rp_dynamic_smem_[]; \
    float* name = reinterpret_cast<float*>(rp_dynamic_smem_)
#endif
