// Attention over the paged KV cache: decode (paged_attention + split-K reduce) and causal prefill.
//
// Math: out = softmax(scale * q K^T) V (Vaswani et al. 2017) with the streaming ("online") softmax of
// Milakov & Gimelshein 2018 as used by FlashAttention (Dao et al. 2022): a running max m and running sum l
// per query row, the accumulator rescaled by exp(m_old - m_new) whenever the max grows. Decode splits long
// contexts into partitions processed by separate thread blocks and merges them in a second kernel
// ("flash-decoding", Dao et al. 2023; vLLM's paged_attention_v2 does the same with fixed partitions):
//   M = max_p m_p,  L = sum_p l_p e^(m_p - M),  out = sum_p l_p e^(m_p - M) o_p / L.
// K/V rows are found through the block table as in vLLM's paged attention (Kwon et al. 2023):
// position t of sequence s lives in block block_tables[s, t / block_size], row t % block_size.
// GQA: query head h reads KV head h / (num_heads / num_kv_heads); a thread block serves a whole group
// (up to GMAX query heads) so every K/V row is loaded once for all of them.
// Sliding window (Mistral; sliding_window > 0): the query at position p sees positions p - W + 1 .. p only,
// and positions before the window are never read.
// Logit soft-cap (Gemma 2; soft_cap > 0): each scaled score s becomes soft_cap * tanh(s / soft_cap) before
// the softmax.
//
// Caches: [num_blocks, block_size, num_kv_heads, HEAD_DIM] in C (float, __half, __nv_bfloat16), or a quantized
// C (rp::KVQuant: signed char, fp8_e4m3) with float32 scales [num_blocks, block_size, num_kv_heads] beside
// it: a row is dequantized as it is read (a key's dot products and a value row times the row's scale).
// Queries/outputs: T (same set); token stride given in elements, heads and dims contiguous.
// Accumulation in float32; every offset 64-bit.
#include "common.cuh"

namespace rp {

constexpr int DEC_THREADS = 128;               // 4 warps
constexpr int DEC_WARPS = DEC_THREADS / 32;
constexpr int DEC_TPK = 4;                     // threads cooperating on one key's dot products
constexpr int DEC_CHUNK = 128;                 // keys per softmax chunk (scores held in shared memory)

// Dynamic shared memory of paged_attention_kernel, in floats (the host mirrors this formula in
// rawpaged/kernels/cuda/launch_config.py: decode_smem_floats).
template <int D, int GMAX> struct DecodeSmem {
    static constexpr int STATS = GMAX * D;                        // q_s: [GMAX][D] scaled queries
    static constexpr int WORK = STATS + ((3 * GMAX + 3) / 4) * 4;  // m_s, l_s, corr_s: [GMAX] each
    static constexpr int SCORES = GMAX * DEC_CHUNK;                // [GMAX][DEC_CHUNK] scores / probs
    static constexpr int PARTIALS = DEC_WARPS * GMAX * D;          // [DEC_WARPS][GMAX][D] final merge
    static constexpr int TOTAL = WORK + (SCORES > PARTIALS ? SCORES : PARTIALS);
};

// log2 of a power-of-two block size (the host checks that it is one): positions split into block and row
// with a shift and a mask instead of an integer division in the inner loops.
__device__ __forceinline__ int log2_pow2(int n) {
    int s = 0;
    while ((1 << s) < n) ++s;
    return s;
}

// Element offset of (position t, kv head) in a cache, through the sequence's block-table row.
__device__ __forceinline__ i64 kv_offset(const int* __restrict__ bt_row, int t, int block_shift,
                                         int num_kv_heads, int kv_head, int head_dim) {
    const i64 blk = bt_row[t >> block_shift];
    return (((blk << block_shift) + (t & ((1 << block_shift) - 1))) * num_kv_heads + kv_head) * (i64)head_dim;
}

}  // namespace rp

// Decode attention, one query token per sequence.
// grid: (num_kv_heads * ceil(group / GMAX), num_seqs, num_splits), block: DEC_THREADS,
// dynamic shared memory: DecodeSmem<HEAD_DIM, GMAX>::TOTAL floats.
// Block (x, s, p) handles query heads [kvh*group + c*GMAX, +min(GMAX, group - c*GMAX)) of sequence s over
// positions [lo + p*split_len, min(ctx, lo + (p+1)*split_len)), lo = max(0, ctx - W) with a window, else 0. With num_splits == 1 it writes out directly;
// otherwise it writes the partition's normalized output to part_out [num_seqs, num_heads, num_splits, D]
// and (max, sum) to part_ml [num_seqs, num_heads, num_splits, 2] for paged_attention_reduce_kernel.
// Work split inside the block:
//   scores: DEC_TPK threads per key (16-byte loads), DEC_THREADS / DEC_TPK keys at a time, the GMAX dot
//           products reduced with shuffles inside each group of DEC_TPK lanes;
//   softmax: one warp per query head over the chunk's scores;
//   P.V:   one warp per key (each lane owns HEAD_DIM / 32 dims, all GMAX heads), merged across warps at
//          the end through shared memory.
// __launch_bounds__(128, 3): at most 168 registers; without a minimum ptxas spilled a few bytes in the
// small-GMAX instantiations (checked by tests/test_cuda_compile.py, which fails on any spill).
template <typename T, typename C, int HEAD_DIM, int GMAX>
__global__ void __launch_bounds__(rp::DEC_THREADS, 3)
    paged_attention_kernel(T* __restrict__ out, long long out_stride, float* __restrict__ part_out,
                           float* __restrict__ part_ml, const T* __restrict__ query, long long q_stride,
                           const C* __restrict__ key_cache, const C* __restrict__ value_cache,
                           const float* __restrict__ key_scales, const float* __restrict__ value_scales,
                           const int* __restrict__ block_tables, int max_blocks_per_seq,
                           const int* __restrict__ context_lens, int num_heads, int num_kv_heads,
                           int block_size, float scale, int split_len, int num_splits, int sliding_window,
                           float soft_cap) {
    using namespace rp;
    constexpr int VK = 16 / (int)sizeof(C);                // cache elements per 16-byte load
    constexpr int KCH = HEAD_DIM / (VK * DEC_TPK);         // 16-byte chunks per lane per key
    constexpr int DPL = HEAD_DIM / 32;                     // value dims per lane
    // value rows a warp loads before it accumulates them: 4 while the GMAX x DPL accumulators leave room
    // in registers, fewer for the largest head groups (no spills: tests/kernels/test_cuda_compile.py)
    constexpr int PV_ROWS = GMAX * DPL >= 64 ? 1 : (GMAX * DPL >= 32 ? 2 : 4);
    constexpr int KEYS_PER_ITER = DEC_THREADS / DEC_TPK;
    static_assert(HEAD_DIM % (VK * DEC_TPK) == 0 && HEAD_DIM % 32 == 0, "unsupported head_dim");
    static_assert(VK % 4 == 0, "query reads use float4");
    using Smem = DecodeSmem<HEAD_DIM, GMAX>;

    RP_DYNAMIC_SMEM(smem);
    float* q_s = smem;
    float* m_s = smem + Smem::STATS;
    float* l_s = m_s + GMAX;
    float* corr_s = l_s + GMAX;
    float* work = smem + Smem::WORK;

    const int tid = threadIdx.x;
    const int lane = tid & 31;
    const int warp = tid >> 5;
    const int group = num_heads / num_kv_heads;
    const int gchunks = (group + GMAX - 1) / GMAX;
    const int kv_head = blockIdx.x / gchunks;
    const int g0 = (blockIdx.x % gchunks) * GMAX;
    const int ng = min(GMAX, group - g0);
    const int h0 = kv_head * group + g0;
    const i64 seq = blockIdx.y;
    const int split = blockIdx.z;
    const int ctx = context_lens[seq];
    const int lo = sliding_window > 0 ? max(0, ctx - sliding_window) : 0;
    const int start = lo + split * split_len;
    const int end = min(ctx, start + split_len);

    if (start >= end) {
        // Nothing to attend: an empty context (CPU semantics: zeros) or a partition past this sequence's
        // end (the reduce kernel never reads those).
        if (num_splits == 1) {
            for (int i = tid; i < ng * HEAD_DIM; i += DEC_THREADS)
                out[seq * out_stride + (i64)h0 * HEAD_DIM + i] = from_float<T>(0.f);
        }
        return;
    }

    for (int i = tid; i < GMAX * HEAD_DIM; i += DEC_THREADS) {
        const int g = i / HEAD_DIM;
        const float q = g < ng ? to_float<T>(query[seq * q_stride + (i64)h0 * HEAD_DIM + i]) : 0.f;
        q_s[i] = q * scale;
    }
    if (tid < GMAX) {
        m_s[tid] = NEG_BIG;
        l_s[tid] = 0.f;
        corr_s[tid] = 1.f;
    }
    const int* __restrict__ bt_row = block_tables + seq * max_blocks_per_seq;
    const int block_shift = log2_pow2(block_size);
    float acc[GMAX][DPL];
#pragma unroll
    for (int g = 0; g < GMAX; ++g)
#pragma unroll
        for (int e = 0; e < DPL; ++e) acc[g][e] = 0.f;
    __syncthreads();

    const int kslot = tid / DEC_TPK;
    const int klane = tid % DEC_TPK;
    for (int c0 = start; c0 < end; c0 += DEC_CHUNK) {
        const int clen = min(DEC_CHUNK, end - c0);

        // 1) scores s[g][i] = q_g . k_i (q already scaled). Trip count is block-uniform so the shuffles
        //    below always see all 32 lanes, also in the last, partially filled iteration.
        for (int base = 0; base < clen; base += KEYS_PER_ITER) {
            const int i = base + kslot;
            float dot[GMAX];
#pragma unroll
            for (int g = 0; g < GMAX; ++g) dot[g] = 0.f;
            if (i < clen) {
                const i64 koff = kv_offset(bt_row, c0 + i, block_shift, num_kv_heads, kv_head, HEAD_DIM);
                const C* __restrict__ krow = key_cache + koff;
#pragma unroll
                for (int c = 0; c < KCH; ++c) {
                    const int d0 = (c * DEC_TPK + klane) * VK;
                    float k[VK];
                    load_floats<C, VK>(krow + d0, k);
#pragma unroll
                    for (int g = 0; g < GMAX; ++g) {
#pragma unroll
                        for (int e = 0; e < VK; e += 4) {
                            const float4 q = *reinterpret_cast<const float4*>(q_s + g * HEAD_DIM + d0 + e);
                            dot[g] += q.x * k[e] + q.y * k[e + 1] + q.z * k[e + 2] + q.w * k[e + 3];
                        }
                    }
                }
                if constexpr (KVQuant<C>::value) {
                    const float ks = key_scales[koff / HEAD_DIM];
#pragma unroll
                    for (int g = 0; g < GMAX; ++g) dot[g] *= ks;
                }
            }
#pragma unroll
            for (int g = 0; g < GMAX; ++g)
#pragma unroll
                for (int o = DEC_TPK / 2; o > 0; o >>= 1) dot[g] += __shfl_xor_sync(FULL_MASK, dot[g], o);
            if (i < clen) {
#pragma unroll
                for (int g = 0; g < GMAX; ++g)
                    if (g % DEC_TPK == klane) work[g * DEC_CHUNK + i] = dot[g];
            }
        }
        __syncthreads();

        // 2) per head: soft-cap (in place; each lane reads back only what it wrote), chunk max, new running
        //    max, probabilities (in place), running sum.
        for (int g = warp; g < GMAX; g += DEC_WARPS) {
            float* s = work + g * DEC_CHUNK;
            if (soft_cap > 0.f) {
                for (int i = lane; i < clen; i += 32) s[i] = soft_cap * tanhf(s[i] / soft_cap);
            }
            float mx = NEG_BIG;
            for (int i = lane; i < clen; i += 32) mx = fmaxf(mx, s[i]);
            mx = warp_max(mx);
            const float m_old = m_s[g];
            const float m_new = fmaxf(m_old, mx);
            float sum = 0.f;
            for (int i = lane; i < clen; i += 32) {
                const float p = __expf(s[i] - m_new);
                s[i] = p;
                sum += p;
            }
            sum = warp_sum(sum);
            if (lane == 0) {
                const float corr = __expf(m_old - m_new);
                corr_s[g] = corr;
                l_s[g] = l_s[g] * corr + sum;
                m_s[g] = m_new;
            }
        }
        __syncthreads();

        // 3) acc = acc * corr + P V over this chunk; warp w takes keys w, w + DEC_WARPS, ...
#pragma unroll
        for (int g = 0; g < GMAX; ++g) {
            const float corr = corr_s[g];
#pragma unroll
            for (int e = 0; e < DPL; ++e) acc[g][e] *= corr;
        }
        // PV_ROWS value rows in flight per warp: their loads are issued before any is used
        for (int i0 = warp; i0 < clen; i0 += DEC_WARPS * PV_ROWS) {
            float v[PV_ROWS][DPL];
#pragma unroll
            for (int r = 0; r < PV_ROWS; ++r) {
                const int i = i0 + r * DEC_WARPS;
                if (i < clen) {
                    const i64 voff = kv_offset(bt_row, c0 + i, block_shift, num_kv_heads, kv_head, HEAD_DIM);
                    load_floats<C, DPL>(value_cache + voff + lane * DPL, v[r]);
                    if constexpr (KVQuant<C>::value) {
                        const float vs = value_scales[voff / HEAD_DIM];
#pragma unroll
                        for (int e = 0; e < DPL; ++e) v[r][e] *= vs;
                    }
                }
            }
#pragma unroll
            for (int r = 0; r < PV_ROWS; ++r) {
                const int i = i0 + r * DEC_WARPS;
                if (i < clen) {
#pragma unroll
                    for (int g = 0; g < GMAX; ++g) {
                        const float p = work[g * DEC_CHUNK + i];
#pragma unroll
                        for (int e = 0; e < DPL; ++e) acc[g][e] += p * v[r][e];
                    }
                }
            }
        }
        __syncthreads();
    }

    // Merge the per-warp accumulators and normalize.
    float* partials = work;
#pragma unroll
    for (int g = 0; g < GMAX; ++g)
#pragma unroll
        for (int e = 0; e < DPL; ++e) partials[(warp * GMAX + g) * HEAD_DIM + lane * DPL + e] = acc[g][e];
    __syncthreads();
    for (int i = tid; i < ng * HEAD_DIM; i += DEC_THREADS) {
        const int g = i / HEAD_DIM;
        float sum = 0.f;
#pragma unroll
        for (int w = 0; w < DEC_WARPS; ++w) sum += partials[w * GMAX * HEAD_DIM + i];
        const float o = __fdividef(sum, l_s[g]);  // l >= 1: the fast division is exact to 2 ulp
        if (num_splits == 1) {
            out[seq * out_stride + (i64)h0 * HEAD_DIM + i] = from_float<T>(o);
        } else {
            const int d = i - g * HEAD_DIM;
            part_out[((seq * num_heads + h0 + g) * num_splits + split) * HEAD_DIM + d] = o;
        }
    }
    if (num_splits > 1 && tid < ng) {
        const i64 idx = (seq * num_heads + h0 + tid) * num_splits + split;
        part_ml[2 * idx] = m_s[tid];
        part_ml[2 * idx + 1] = l_s[tid];
    }
}

// Merge of the decode partitions (flash-decoding's second step).
// grid: (num_heads, num_seqs), block: any multiple of 32 (host: min(head_dim, 256) rounded up to 32).
// Sequence s uses its first ceil(visible / split_len) partitions, visible = context_lens[s] (at most W with a
// sliding window); an empty context gives zeros.
template <typename T>
__global__ void paged_attention_reduce_kernel(T* __restrict__ out, long long out_stride,
                                              const float* __restrict__ part_out,
                                              const float* __restrict__ part_ml,
                                              const int* __restrict__ context_lens, int num_heads,
                                              int head_dim, int num_splits, int split_len,
                                              int sliding_window) {
    using namespace rp;
    const int h = blockIdx.x;
    const i64 seq = blockIdx.y;
    const int ctx = context_lens[seq];
    const int visible = sliding_window > 0 ? min(ctx, sliding_window) : ctx;
    const int n = min(num_splits, (visible + split_len - 1) / split_len);
    const i64 base = (seq * num_heads + h) * num_splits;
    float M = NEG_BIG;
    for (int p = 0; p < n; ++p) M = fmaxf(M, part_ml[2 * (base + p)]);
    float L = 0.f;
    for (int p = 0; p < n; ++p) L += part_ml[2 * (base + p) + 1] * __expf(part_ml[2 * (base + p)] - M);
    const float inv = L > 0.f ? 1.f / L : 0.f;
    T* __restrict__ o = out + seq * out_stride + (i64)h * head_dim;
    for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
        float acc = 0.f;
        for (int p = 0; p < n; ++p) {
            const float w = part_ml[2 * (base + p) + 1] * __expf(part_ml[2 * (base + p)] - M);
            acc += w * part_out[(base + p) * head_dim + d];
        }
        o[d] = from_float<T>(acc * inv);
    }
}

namespace rp {

constexpr int PF_THREADS = 128;  // 16 row groups x 8 key/dim groups
constexpr int PF_KT = 32;        // keys per tile

// Tile geometry and dynamic shared memory (floats) of prefill_attention_kernel; mirrored by
// rawpaged/kernels/cuda/launch_config.py: prefill_rows / prefill_smem_floats.
template <int D> struct PrefillCfg {
    static constexpr int RPT = D <= 128 ? 4 : 2;  // query rows per thread
    static constexpr int ROWS = 16 * RPT;         // query rows (token, head) per block
    static constexpr int DPT = D / 8;             // output dims per thread
    static constexpr int QS = D + 1;              // padded pitch of Q/K/V rows (no bank conflicts)
    static constexpr int PS = PF_KT + 1;          // padded pitch of P rows
    static constexpr int K_OFF = ROWS * QS;
    static constexpr int V_OFF = K_OFF + PF_KT * QS;
    static constexpr int P_OFF = V_OFF + PF_KT * QS;
    static constexpr int TOTAL = P_OFF + ROWS * PS;
};

}  // namespace rp

// Causal prefill / chunked prefill / prefill after a cached prefix (FlashAttention-2 style tiling on CUDA
// cores): each block takes a tile of query rows, row = (new token, query head of one KV head's group),
// ROWS = PrefillCfg::ROWS rows = (ROWS / heads_per_block) tokens x heads_per_block heads, and streams
// the keys 0 .. (last position of the tile) through shared memory in tiles of PF_KT, reading K/V through
// the block table. New tokens are the last n_new = query_start_loc[s+1] - query_start_loc[s] positions of
// sequence s (length seq_lens[s]); the token at absolute position p attends positions 0 .. p (p - W + 1 .. p
// with a sliding window W, and the tile loop starts at the first row's window).
// grid: (max query tiles per sequence, num_kv_heads * ceil(group / heads_per_block), num_seqs),
// block: PF_THREADS, dynamic shared memory: PrefillCfg<HEAD_DIM>::TOTAL floats.
// Tiles are visited in reverse (blockIdx.x 0 = last tile) so the longest causal tiles start first.
template <typename T, typename C, int HEAD_DIM>
__global__ void __launch_bounds__(rp::PF_THREADS)
    prefill_attention_kernel(T* __restrict__ out, long long out_stride, const T* __restrict__ query,
                             long long q_stride, const C* __restrict__ key_cache,
                             const C* __restrict__ value_cache, const float* __restrict__ key_scales,
                             const float* __restrict__ value_scales, const int* __restrict__ block_tables,
                             int max_blocks_per_seq, const int* __restrict__ query_start_loc,
                             const int* __restrict__ seq_lens, int num_heads, int num_kv_heads,
                             int block_size, float scale, int heads_per_block, int sliding_window,
                             float soft_cap) {
    using namespace rp;
    using Cfg = PrefillCfg<HEAD_DIM>;
    constexpr int RPT = Cfg::RPT;
    constexpr int DPT = Cfg::DPT;
    constexpr int QS = Cfg::QS;
    constexpr int PS = Cfg::PS;
    constexpr int VK = 16 / (int)sizeof(C);
    constexpr int CPR = HEAD_DIM / VK;  // 16-byte chunks per K/V row
    static_assert(HEAD_DIM % 8 == 0 && HEAD_DIM % VK == 0, "unsupported head_dim");

    const int block_shift = log2_pow2(block_size);
    RP_DYNAMIC_SMEM(smem);
    float* Qs = smem;
    float* Ks = smem + Cfg::K_OFF;
    float* Vs = smem + Cfg::V_OFF;
    float* Ps = smem + Cfg::P_OFF;

    const int tid = threadIdx.x;
    const int rg = tid >> 3;  // row group: rows rg + 16 * i
    const int kg = tid & 7;   // key group (keys kg + 8 * jj) / dim group (dims kg + 8 * dd)
    const i64 seq = blockIdx.z;
    const int group = num_heads / num_kv_heads;
    const int gh = heads_per_block;
    const int hchunks = (group + gh - 1) / gh;
    const int kv_head = blockIdx.y / hchunks;
    const int gbase = (blockIdx.y % hchunks) * gh;
    const int qt_per_tile = Cfg::ROWS / gh;
    const int q_begin = query_start_loc[seq];
    const int n_new = query_start_loc[seq + 1] - q_begin;
    const int seq_len = seq_lens[seq];
    const int tq0 = (gridDim.x - 1 - blockIdx.x) * qt_per_tile;
    if (tq0 >= n_new) return;
    const int first_pos = seq_len - n_new;  // absolute position of this sequence's first new token
    const int last_pos = first_pos + min(n_new, tq0 + qt_per_tile) - 1;
    const int* __restrict__ bt_row = block_tables + seq * max_blocks_per_seq;

    for (int i = tid; i < Cfg::ROWS * HEAD_DIM; i += PF_THREADS) {
        const int r = i / HEAD_DIM;
        const int d = i - r * HEAD_DIM;
        const int qt = r / gh;
        const int g = r - qt * gh;
        float q = 0.f;
        if (qt < qt_per_tile && tq0 + qt < n_new && gbase + g < group)
            q = to_float<T>(query[(i64)(q_begin + tq0 + qt) * q_stride +
                                  (i64)(kv_head * group + gbase + g) * HEAD_DIM + d]) * scale;
        Qs[r * QS + d] = q;
    }

    int pos[RPT];  // absolute position of each of this thread's rows; -1 masks a padding row entirely
    float m[RPT], l[RPT], acc[RPT][DPT];
#pragma unroll
    for (int i = 0; i < RPT; ++i) {
        const int r = rg + 16 * i;
        const int qt = r / gh;
        const bool valid = qt < qt_per_tile && tq0 + qt < n_new && gbase + (r - qt * gh) < group;
        pos[i] = valid ? first_pos + tq0 + qt : -1;
        m[i] = NEG_BIG;
        l[i] = 0.f;
#pragma unroll
        for (int dd = 0; dd < DPT; ++dd) acc[i][dd] = 0.f;
    }

    // A key position is visible to row i when it is causal and inside the row's window.
    const int wnd = sliding_window > 0 ? sliding_window : (1 << 30);
    const int first_key = max(0, first_pos + tq0 - wnd + 1);
    for (int kt0 = first_key; kt0 <= last_pos; kt0 += PF_KT) {
        // K/V tile -> shared memory (float); keys past last_pos are zero (and masked below).
        for (int i = tid; i < PF_KT * CPR; i += PF_THREADS) {
            const int j = i / CPR;
            const int c = i - j * CPR;
            float kf[VK], vf[VK];
            if (kt0 + j <= last_pos) {
                const i64 row = kv_offset(bt_row, kt0 + j, block_shift, num_kv_heads, kv_head, HEAD_DIM);
                load_floats<C, VK>(key_cache + row + c * VK, kf);
                load_floats<C, VK>(value_cache + row + c * VK, vf);
                if constexpr (KVQuant<C>::value) {
                    const float ks = key_scales[row / HEAD_DIM];
                    const float vs = value_scales[row / HEAD_DIM];
#pragma unroll
                    for (int e = 0; e < VK; ++e) {
                        kf[e] *= ks;
                        vf[e] *= vs;
                    }
                }
            } else {
#pragma unroll
                for (int e = 0; e < VK; ++e) kf[e] = vf[e] = 0.f;
            }
#pragma unroll
            for (int e = 0; e < VK; ++e) {
                Ks[j * QS + c * VK + e] = kf[e];
                Vs[j * QS + c * VK + e] = vf[e];
            }
        }
        __syncthreads();

        // S = Q K^T for this thread's RPT rows x 4 keys.
        float s[RPT][4];
#pragma unroll
        for (int i = 0; i < RPT; ++i)
#pragma unroll
            for (int jj = 0; jj < 4; ++jj) s[i][jj] = 0.f;
        for (int d = 0; d < HEAD_DIM; ++d) {
            float q[RPT], k[4];
#pragma unroll
            for (int i = 0; i < RPT; ++i) q[i] = Qs[(rg + 16 * i) * QS + d];
#pragma unroll
            for (int jj = 0; jj < 4; ++jj) k[jj] = Ks[(kg + 8 * jj) * QS + d];
#pragma unroll
            for (int i = 0; i < RPT; ++i)
#pragma unroll
                for (int jj = 0; jj < 4; ++jj) s[i][jj] += q[i] * k[jj];
        }
        if (soft_cap > 0.f) {
#pragma unroll
            for (int i = 0; i < RPT; ++i)
#pragma unroll
                for (int jj = 0; jj < 4; ++jj) s[i][jj] = soft_cap * tanhf(s[i][jj] / soft_cap);
        }

        // Online softmax per row; the 8 lanes of a row group (consecutive lanes) hold its 32 keys.
#pragma unroll
        for (int i = 0; i < RPT; ++i) {
            float mx = NEG_BIG;
#pragma unroll
            for (int jj = 0; jj < 4; ++jj)
                if (kt0 + kg + 8 * jj <= pos[i] && kt0 + kg + 8 * jj > pos[i] - wnd) mx = fmaxf(mx, s[i][jj]);
#pragma unroll
            for (int o = 1; o < 8; o <<= 1) mx = fmaxf(mx, __shfl_xor_sync(FULL_MASK, mx, o));
            const float m_new = fmaxf(m[i], mx);
            const float corr = __expf(m[i] - m_new);
            float sum = 0.f;
#pragma unroll
            for (int jj = 0; jj < 4; ++jj) {
                const int key = kt0 + kg + 8 * jj;
                const float p = key <= pos[i] && key > pos[i] - wnd ? __expf(s[i][jj] - m_new) : 0.f;
                Ps[(rg + 16 * i) * PS + kg + 8 * jj] = p;
                sum += p;
            }
#pragma unroll
            for (int o = 1; o < 8; o <<= 1) sum += __shfl_xor_sync(FULL_MASK, sum, o);
            l[i] = l[i] * corr + sum;
            m[i] = m_new;
#pragma unroll
            for (int dd = 0; dd < DPT; ++dd) acc[i][dd] *= corr;
        }
        __syncthreads();

        // acc += P V for this thread's RPT rows x DPT dims.
        for (int j = 0; j < PF_KT; ++j) {
            float p[RPT];
#pragma unroll
            for (int i = 0; i < RPT; ++i) p[i] = Ps[(rg + 16 * i) * PS + j];
#pragma unroll
            for (int dd = 0; dd < DPT; ++dd) {
                const float v = Vs[j * QS + kg + 8 * dd];
#pragma unroll
                for (int i = 0; i < RPT; ++i) acc[i][dd] += p[i] * v;
            }
        }
        __syncthreads();
    }

#pragma unroll
    for (int i = 0; i < RPT; ++i) {
        if (pos[i] < 0) continue;
        const int r = rg + 16 * i;
        const int qt = r / gh;
        const int head = kv_head * group + gbase + (r - qt * gh);
        T* __restrict__ o = out + (i64)(q_begin + tq0 + qt) * out_stride + (i64)head * HEAD_DIM;
        const float inv = 1.f / l[i];
#pragma unroll
        for (int dd = 0; dd < DPT; ++dd) o[kg + 8 * dd] = from_float<T>(acc[i][dd] * inv);
    }
}
