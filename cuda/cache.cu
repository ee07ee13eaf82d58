// Paged KV-cache maintenance: reshape_and_cache (scatter new K/V rows into their slots) and copy_blocks
// (copy-on-write block copies for every layer in one launch). Semantics follow vLLM's
// csrc/cache_kernels.cu and rawpaged/kernels/cpu/cache.py.
//
// Cache layout: [num_blocks, block_size, num_kv_heads, head_dim], contiguous. A quantized cache
// (rp::KVQuant<C>: int8, fp8 E4M3) has beside it float32 scales [num_blocks, block_size, num_kv_heads]: each
// row is quantized as it is written, one warp per row (scale = max|row| / QMAX); float caches pass null
// scale pointers, never read.
#include "common.cuh"

namespace rp {

// Upper bound on values per lane of a quantized row (head_dim <= 32 * KV_ROW_LANES).
constexpr int KV_ROW_LANES = 8;

// The rows (head h of K or V) of token t written to slot `slot`, quantized: warp w of the block takes rows
// w, w + num_warps, ... of the 2 * num_kv_heads (K rows first). krot: the key rotated by RoPE before it is
// stored (cos_sin a row of cos_sin_cache), or null for the key as it is.
template <typename T, typename C>
__device__ __forceinline__ void write_quantized_rows(const T* __restrict__ ksrc, const T* __restrict__ vsrc,
                                                     C* __restrict__ key_cache, C* __restrict__ value_cache,
                                                     float* __restrict__ key_scales, float* __restrict__ value_scales,
                                                     i64 slot, int num_kv_heads, int head_dim,
                                                     const float* __restrict__ cos_sin) {
    const int lane = threadIdx.x & 31;
    const int per_lane = head_dim / 32;
    const int half = head_dim / 2;
    for (int r = threadIdx.x >> 5; r < 2 * num_kv_heads; r += blockDim.x >> 5) {
        const bool is_key = r < num_kv_heads;
        const int h = is_key ? r : r - num_kv_heads;
        const T* src = (is_key ? ksrc : vsrc) + (i64)h * head_dim;
        float x[KV_ROW_LANES];
        for (int e = 0; e < per_lane; ++e) {
            const int d = lane + 32 * e;
            if (is_key && cos_sin != nullptr) {  // RoPE, rounded through T as the unfused kernels round it
                const int j = d < half ? d : d - half;
                const float x1 = to_float<T>(src[j]);
                const float x2 = to_float<T>(src[j + half]);
                const float c = cos_sin[j];
                const float sn = cos_sin[j + half];
                x[e] = to_float<T>(from_float<T>(d < half ? x1 * c - x2 * sn : x2 * c + x1 * sn));
            } else {
                x[e] = to_float<T>(src[d]);
            }
        }
        const i64 row = slot * num_kv_heads + h;
        const float scale = quantize_row_warp<C, KV_ROW_LANES>(x, per_lane, (is_key ? key_cache : value_cache) + row * head_dim, lane);
        if (lane == 0) (is_key ? key_scales : value_scales)[row] = scale;
    }
}

}  // namespace rp

// grid: (num_tokens), block: any multiple of 32 (the host uses min(1024, round_up(H * D, 32)); for a
// quantized C, 32 per row: min(512, 64 * H)).
// key/value: [num_tokens, num_kv_heads, head_dim] with token stride key_stride/value_stride (elements; the
// last two dims contiguous, so views into a fused QKV projection work). slot_mapping: int64 [num_tokens],
// slot = block * block_size + offset; a negative slot skips the token (padding).
// T: activation dtype; C: cache dtype (float32 -> bf16/fp16 rounds to nearest even).
template <typename T, typename C>
__global__ void reshape_and_cache_kernel(const T* __restrict__ key, const T* __restrict__ value,
                                         C* __restrict__ key_cache, C* __restrict__ value_cache,
                                         float* __restrict__ key_scales, float* __restrict__ value_scales,
                                         const long long* __restrict__ slot_mapping, long long key_stride,
                                         long long value_stride, int num_kv_heads, int head_dim,
                                         int block_size) {
    const rp::i64 t = blockIdx.x;
    const rp::i64 slot = slot_mapping[t];
    if (slot < 0) return;
    if constexpr (rp::KVQuant<C>::value) {
        rp::write_quantized_rows<T, C>(key + t * key_stride, value + t * value_stride, key_cache, value_cache,
                                       key_scales, value_scales, slot, num_kv_heads, head_dim, nullptr);
    } else {
        const rp::i64 row_elems = (rp::i64)num_kv_heads * head_dim;
        C* __restrict__ kdst = key_cache + slot * row_elems;
        C* __restrict__ vdst = value_cache + slot * row_elems;
        const T* __restrict__ ksrc = key + t * key_stride;
        const T* __restrict__ vsrc = value + t * value_stride;
        for (rp::i64 i = threadIdx.x; i < row_elems; i += blockDim.x) {
            kdst[i] = rp::Convert<C, T>::apply(ksrc[i]);
            vdst[i] = rp::Convert<C, T>::apply(vsrc[i]);
        }
    }
}

// grid: (num_pairs, num_layers), block: 256 threads.
// key_cache_ptrs/value_cache_ptrs: uint64 [num_layers], each the base address of one layer's cache.
// block_mapping: int64 [num_pairs, 2] of (src, dst) block ids. words_per_block: bytes per block / BYTES.
// BYTES (2, 4, 8 or 16) is the copy word; the host picks the widest that divides the block's byte size.
template <int BYTES>
__global__ void copy_blocks_kernel(const unsigned long long* __restrict__ key_cache_ptrs,
                                   const unsigned long long* __restrict__ value_cache_ptrs,
                                   const long long* __restrict__ block_mapping, long long words_per_block) {
    typedef typename rp::RawWord<BYTES>::type Word;
    const rp::i64 pair = blockIdx.x;
    const int layer = blockIdx.y;
    const rp::i64 src = block_mapping[2 * pair] * words_per_block;
    const rp::i64 dst = block_mapping[2 * pair + 1] * words_per_block;
    Word* __restrict__ kc = reinterpret_cast<Word*>(key_cache_ptrs[layer]);
    Word* __restrict__ vc = reinterpret_cast<Word*>(value_cache_ptrs[layer]);
    for (rp::i64 i = threadIdx.x; i < words_per_block; i += blockDim.x) {
        kc[dst + i] = kc[src + i];
        vc[dst + i] = vc[src + i];
    }
}

// Elementwise dtype conversion, used once per weight tensor at load time (a float32 checkpoint kept in
// bf16/fp16 on the device): out[i] = D(in[i]) through float32, rounded to nearest even.
// in/out: n contiguous elements (64-bit count). Grid-stride loop: any grid/block size works.
template <typename D, typename S>
__global__ void convert_kernel(D* __restrict__ out, const S* __restrict__ in, long long n) {
    const rp::i64 stride = (rp::i64)gridDim.x * blockDim.x;
    for (rp::i64 i = (rp::i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        out[i] = rp::Convert<D, S>::apply(in[i]);
    }
}

// RoPE (HF rotate-half, as rotary_embedding_kernel in layers.cu) fused with the cache write of
// reshape_and_cache_kernel: the query heads are rotated in place; the key heads are rotated in registers
// and stored straight into slot slot_mapping[t] (key itself is not written); the value row is copied there.
// A negative slot rotates the query only. Each key element is read once and written once, where the two
// kernels read it, write it back rotated and read it again.
// grid: (num_tokens), block: multiple of 32 (host: min(512, round_up(max((H + Hkv) * D/2, Hkv * D), 32))).
// A quantized C: the key and value rows are quantized by warps (write_quantized_rows; scales as in
// reshape_and_cache_kernel), after the query.
// query: [num_tokens, num_heads, D] (token stride q_stride); key/value: [num_tokens, num_kv_heads, D]
// (token strides k_stride/v_stride); positions: int64 [num_tokens]; cos_sin_cache: float32
// [max_position, D]; caches [num_blocks, block_size, num_kv_heads, D] (slot = block * block_size + offset).
template <typename T, typename C>
__global__ void rotary_embedding_and_cache_kernel(const long long* __restrict__ positions, T* __restrict__ query,
                                                  long long q_stride, const T* __restrict__ key, long long k_stride,
                                                  const T* __restrict__ value, long long v_stride,
                                                  C* __restrict__ key_cache, C* __restrict__ value_cache,
                                                  float* __restrict__ key_scales, float* __restrict__ value_scales,
                                                  const long long* __restrict__ slot_mapping,
                                                  const float* __restrict__ cos_sin_cache, int num_heads,
                                                  int num_kv_heads, int head_dim) {
    const rp::i64 t = blockIdx.x;
    const int half = head_dim / 2;
    const float* __restrict__ cs = cos_sin_cache + positions[t] * (rp::i64)head_dim;
    const rp::i64 slot = slot_mapping[t];
    const rp::i64 row_elems = (rp::i64)num_kv_heads * head_dim;
    constexpr bool quantized = rp::KVQuant<C>::value;
    const int pairs = (num_heads + (slot >= 0 && !quantized ? num_kv_heads : 0)) * half;
    for (int i = threadIdx.x; i < pairs; i += blockDim.x) {
        const int h = i / half;
        const int j = i - h * half;
        const float c = cs[j];
        const float s = cs[j + half];
        if (h < num_heads) {
            T* row = query + t * q_stride + (rp::i64)h * head_dim;
            const float x1 = rp::to_float<T>(row[j]);
            const float x2 = rp::to_float<T>(row[j + half]);
            row[j] = rp::from_float<T>(x1 * c - x2 * s);
            row[j + half] = rp::from_float<T>(x2 * c + x1 * s);
        } else if constexpr (!quantized) {
            const rp::i64 off = (rp::i64)(h - num_heads) * head_dim;
            const T* src = key + t * k_stride + off;
            C* dst = key_cache + slot * row_elems + off;
            const float x1 = rp::to_float<T>(src[j]);
            const float x2 = rp::to_float<T>(src[j + half]);
            // through T first, as the unfused kernels round the rotated key into the activation dtype
            dst[j] = rp::Convert<C, T>::apply(rp::from_float<T>(x1 * c - x2 * s));
            dst[j + half] = rp::Convert<C, T>::apply(rp::from_float<T>(x2 * c + x1 * s));
        }
    }
    if (slot < 0) return;
    if constexpr (quantized) {
        rp::write_quantized_rows<T, C>(key + t * k_stride, value + t * v_stride, key_cache, value_cache, key_scales,
                                       value_scales, slot, num_kv_heads, head_dim, cs);
    } else {
        const T* __restrict__ vsrc = value + t * v_stride;
        C* __restrict__ vdst = value_cache + slot * row_elems;
        for (rp::i64 i = threadIdx.x; i < row_elems; i += blockDim.x) vdst[i] = rp::Convert<C, T>::apply(vsrc[i]);
    }
}
