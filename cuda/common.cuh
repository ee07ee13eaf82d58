// Shared helpers for the rawpaged CUDA kernels (cache.cu, attention.cu, layers.cu).
//
// Compiled by NVRTC through cupy.RawModule (the runtime concatenates this header with the .cu files, see
// rawpaged/kernels/cuda/program.py) and by g++ through the CPU emulation in tests/cuda_emu/.
// NVRTC rules followed here: no <stdint.h>/<cmath>, no INFINITY macro, templates instantiated only through
// name expressions (so every instantiation the runtime uses is listed in program.py).
//
// Element types: float, __half, __nv_bfloat16. Arithmetic is always float32 (convert on load, round on
// store with round-to-nearest-even). All offsets into activations and caches are 64-bit (long long).
// Quantized KV caches (KVQuant below) hold signed char (int8) or fp8_e4m3 values, and beside them one float32
// scale per (slot, KV head) row: x = to_float(q) * scale.
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

// FP8 E4M3 (OCP "e4m3fn": sign, 4 exponent bits biased by 7, 3 mantissa bits, no infinities; 448 the
// largest), held as its bits.
struct fp8_e4m3 {
    unsigned char bits;
};

// Bits -> value, exactly: a normal's exponent and mantissa bits moved into a float32's (exponent rebased
// from 7 to 127: + 120 << 23), a subnormal (exponent 0) is m * 2^-9 (never a float32 denormal, which -ftz
// would flush).
template <> __device__ __forceinline__ float to_float<signed char>(signed char x) { return (float)x; }
template <> __device__ __forceinline__ float to_float<fp8_e4m3>(fp8_e4m3 x) {
    const unsigned b = x.bits;
    const float mag = (b & 0x78u) ? __uint_as_float(((b & 0x7Fu) + 960u) << 20) : (float)(b & 7u) * 0.001953125f;
    return (b & 0x80u) ? -mag : mag;
}

// float -> E4M3 bits, rounded to nearest even, saturating at +-448 (as __nv_cvt_float_to_fp8 with
// __NV_SATFINITE); the CPU's intrinsics.f32_to_fp8_e4m3_bits computes the same.
__device__ __forceinline__ fp8_e4m3 float_to_fp8_e4m3(float x) {
    const unsigned sign = (__float_as_uint(x) >> 24) & 0x80u;
    const float a = fabsf(x);
    fp8_e4m3 r;
    if (!(a < 448.f)) {
        r.bits = (unsigned char)(sign | 0x7Eu);
    } else if (a < 0.015625f) {  // below 2^-6: subnormals in steps of 2^-9
        r.bits = (unsigned char)(sign | (unsigned)rintf(a * 512.f));
    } else {
        const unsigned u = __float_as_uint(a);
        const int e = (int)(u >> 23) - 127;                  // a = 1.m * 2^e, e in [-6, 8]
        const float m = __uint_as_float((u & 0x7FFFFFu) | 0x3F800000u);  // 1.m in [1, 2)
        unsigned mant = (unsigned)rintf((m - 1.f) * 8.f);
        unsigned ex = (unsigned)(e + 7);
        if (mant == 8u) {
            mant = 0u;
            ++ex;
        }
        const unsigned bits = (ex << 3) | mant;
        r.bits = (unsigned char)(sign | (bits > 0x7Eu ? 0x7Eu : bits));
    }
    return r;
}

// Quantized KV-cache element types: value = to_float(q) * scale, scale = max|row| / QMAX (1 for a zero row).
template <typename C> struct KVQuant {
    static constexpr bool value = false;
};
template <> struct KVQuant<signed char> {
    static constexpr bool value = true;
    static constexpr float QMAX = 127.f;
    static __device__ __forceinline__ signed char quantize(float y) {
        return (signed char)fmaxf(-127.f, fminf(127.f, rintf(y)));
    }
};
template <> struct KVQuant<fp8_e4m3> {
    static constexpr bool value = true;
    static constexpr float QMAX = 448.f;
    static __device__ __forceinline__ fp8_e4m3 quantize(float y) { return float_to_fp8_e4m3(y); }
};

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

// One (slot, KV head) row quantized by one warp: lane l holds values l, l + 32, ... (per_lane of them; the
// row is 32 * per_lane long) and writes their quantized values to dst; returns the row's scale. All 32
// lanes call it.
template <typename C, int MAXE>
__device__ __forceinline__ float quantize_row_warp(const float (&x)[MAXE], int per_lane, C* __restrict__ dst,
                                                   int lane) {
    float amax = 0.f;
    for (int e = 0; e < per_lane; ++e) amax = fmaxf(amax, fabsf(x[e]));
    amax = warp_max(amax);
    const float scale = amax > 0.f ? amax / KVQuant<C>::QMAX : 1.f;
    for (int e = 0; e < per_lane; ++e) dst[lane + 32 * e] = KVQuant<C>::quantize(x[e] / scale);
    return scale;
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


struct SumOp {
    template <typename V> __device__ __forceinline__ V operator()(V a, V b) const { return a + b; }
};
struct MinOp {
    template <typename V> __device__ __forceinline__ V operator()(V a, V b) const { return b < a ? b : a; }
};
struct MaxOp {
    template <typename V> __device__ __forceinline__ V operator()(V a, V b) const { return b > a ? b : a; }
};

// Reduction over the block in a fixed order; every thread gets the result. scratch: >= 32 shared V.
template <typename V, typename Op>
__device__ __forceinline__ V block_reduce(V v, V* scratch, Op op) {
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = op(v, __shfl_xor_sync(FULL_MASK, v, o));
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    V r = scratch[0];
    for (int w = 1; w < (int)(blockDim.x >> 5); ++w) r = op(r, scratch[w]);
    __syncthreads();
    return r;
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
