// Paged KV-cache maintenance: reshape_and_cache (scatter new K/V rows into their slots) and copy_blocks
// (copy-on-write block copies for every layer in one launch). Semantics follow vLLM's
// csrc/cache_kernels.cu and rawpaged/kernels/cpu.py.
//
// Cache layout: [num_blocks, block_size, num_kv_heads, head_dim], contiguous.
#include "common.cuh"

// grid: (num_tokens), block: any multiple of 32 (the host uses min(1024, round_up(H * D, 32))).
// key/value: [num_tokens, num_kv_heads, head_dim] with token stride key_stride/value_stride (elements; the
// last two dims contiguous, so views into a fused QKV projection work). slot_mapping: int64 [num_tokens],
// slot = block * block_size + offset; a negative slot skips the token (padding).
// T: activation dtype; C: cache dtype (float32 -> bf16/fp16 rounds to nearest even).
template <typename T, typename C>
__global__ void reshape_and_cache_kernel(const T* __restrict__ key, const T* __restrict__ value,
                                         C* __restrict__ key_cache, C* __restrict__ value_cache,
                                         const long long* __restrict__ slot_mapping, long long key_stride,
                                         long long value_stride, int num_kv_heads, int head_dim,
                                         int block_size) {
    const rp::i64 t = blockIdx.x;
    const rp::i64 slot = slot_mapping[t];
    if (slot < 0) return;
    const rp::i64 row_elems = (rp::i64)num_kv_heads * head_dim;
    const rp::i64 blk = slot / block_size;
    const rp::i64 off = slot % block_size;
    C* __restrict__ kdst = key_cache + (blk * block_size + off) * row_elems;
    C* __restrict__ vdst = value_cache + (blk * block_size + off) * row_elems;
    const T* __restrict__ ksrc = key + t * key_stride;
    const T* __restrict__ vsrc = value + t * value_stride;
    for (rp::i64 i = threadIdx.x; i < row_elems; i += blockDim.x) {
        kdst[i] = rp::Convert<C, T>::apply(ksrc[i]);
        vdst[i] = rp::Convert<C, T>::apply(vsrc[i]);
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
