// Token sampling on the device: greedy, temperature, top-k, top-p (nucleus, Holtzman et al. 2020) and
// min-p (Nguyen et al. 2024), one block per sample, so only the sampled ids leave the GPU.
//
// Semantics are those of rawpaged/testing/reference_sampler.py `sample` (float64 NumPy), in this order on the tempered
// distribution p_i = exp((x_i - max x) / temperature):
//   top-k  keep x_i >= the k-th largest logit (ties at the threshold all kept, as np.partition);
//   top-p  keep the smallest prefix of tokens sorted by descending p whose mass reaches top_p * sum(p),
//          ties in that order broken by lower token id first (a stable sort);
//   min-p  keep p_i >= min_p * max(p) (max(p) = 1 before normalisation);
//   draw   the first token id whose running sum over the kept p_i, in token-id order, exceeds
//          uniform * sum(kept p) (inverse CDF; `uniform` in [0, 1) is drawn on the host from the request's
//          seeded generator, so a seed gives the same tokens on both backends up to float32 rounding).
// temperature <= 0 is greedy: the first index of the largest logit. NaN logits are never chosen.
//
// No sort: thresholds come from the bits of an order-preserving 32-bit key. Top-k: radix select, a byte per
// pass (4 passes, integer histograms). Top-p: bisection on the bits of p (31 passes), with block reductions
// in a fixed order (deterministic; sums of non-negative floats over nested subsets in the same order are
// monotone, so the bisection is consistent).
//
// grid: (num_samples), block: a multiple of 32, at most 512 (host: see launch_config.sample_threads).
// logits: [num_rows, vocab] of T, row stride logits_stride (elements).
// sample_ints: int32 [num_samples, 2] = (logits row, top_k; top_k <= 0 or >= vocab keeps all).
// sample_floats: float32 [num_samples, 4] = (temperature, top_p, min_p, uniform).
// probs: float32 [num_samples, vocab] workspace, unused (may be null) with stage_in_smem, where the launch
// gives vocab floats of dynamic shared memory instead. out_ids: int32 [num_samples].
#include "common.cuh"

namespace rp {

constexpr int NO_INDEX = 0x7fffffff;

// Larger float -> larger key; NaN -> 0 (below every number).
__device__ __forceinline__ unsigned ordered_key(float x) {
    if (x != x) return 0u;
    const unsigned u = __float_as_uint(x);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// Exclusive prefix sum of v in thread order; *total gets the sum over the block.
__device__ __forceinline__ float block_exclusive_scan(float v, float* scratch, float* total) {
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    float incl = v;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const float n = __shfl_up_sync(FULL_MASK, incl, o);
        if (lane >= o) incl += n;
    }
    float excl = __shfl_up_sync(FULL_MASK, incl, 1);
    if (lane == 0) excl = 0.f;
    if (lane == 31) scratch[warp] = incl;
    __syncthreads();
    float before = 0.f, all = 0.f;
    for (int w = 0; w < (int)(blockDim.x >> 5); ++w) {
        if (w < warp) before += scratch[w];
        all += scratch[w];
    }
    __syncthreads();
    *total = all;
    return before + excl;
}

}  // namespace rp

// __launch_bounds__(512, 1): one resident block per SM is enough (a block per sample), so ptxas may use up
// to 128 registers; with (512) alone it aimed at more resident blocks and spilled at 40.
template <typename T>
__global__ void __launch_bounds__(512, 1) sample_kernel(int* __restrict__ out_ids, const T* __restrict__ logits,
                                                      long long logits_stride, const int* __restrict__ sample_ints,
                                                      const float* __restrict__ sample_floats,
                                                      float* __restrict__ probs, int vocab, int stage_in_smem) {
    __shared__ float fscratch[32];
    __shared__ int iscratch[32];
    const int s = blockIdx.x;
    const int tid = threadIdx.x;
    const int nt = blockDim.x;
    const T* __restrict__ x = logits + (rp::i64)sample_ints[2 * s] * logits_stride;
    const int top_k = sample_ints[2 * s + 1];
    const float temperature = sample_floats[4 * s];
    const float top_p = sample_floats[4 * s + 1];
    const float min_p = sample_floats[4 * s + 2];
    const float uniform = sample_floats[4 * s + 3];
    // p: the tempered probabilities, in dynamic shared memory when the row fits (the top-p bisection reads
    // them 32 times), else in the global workspace
    RP_DYNAMIC_SMEM(p_smem);
    float* __restrict__ p = stage_in_smem ? p_smem : probs + (rp::i64)s * vocab;

    // Largest logit and its first index (the greedy answer).
    float best = rp::NEG_BIG;
    int best_i = rp::NO_INDEX;
    for (int i = tid; i < vocab; i += nt) {
        const float v = rp::to_float<T>(x[i]);
        if (v == v && (v > best || best_i == rp::NO_INDEX)) {
            best = v;
            best_i = i;
        }
    }
    const float m = rp::block_reduce(best, fscratch, rp::MaxOp());
    best_i = rp::block_reduce(best == m ? best_i : rp::NO_INDEX, iscratch, rp::MinOp());
    if (!(temperature > 0.f)) {
        if (tid == 0) out_ids[s] = best_i == rp::NO_INDEX ? 0 : best_i;
        return;
    }

    // Top-k: the k-th largest logit's key (the largest t with count(key >= t) >= k), found a byte at a
    // time from the top (radix select): per pass, a 256-bin histogram of the next byte of the keys that
    // share the bytes fixed so far (integer counts: the same in any order), then the bin where the count
    // from the top reaches the k still wanted. 4 passes over the row.
    unsigned kth = 0u;
    if (top_k > 0 && top_k < vocab) {
        __shared__ int hist[256];
        __shared__ int digit_above[2];
        unsigned fixed_mask = 0u;
        int wanted = top_k;
        for (int shift = 24; shift >= 0; shift -= 8) {
            for (int b = tid; b < 256; b += nt) hist[b] = 0;
            __syncthreads();
            for (int i = tid; i < vocab; i += nt) {
                const unsigned key = rp::ordered_key(rp::to_float<T>(x[i]));
                if ((key & fixed_mask) == kth) atomicAdd(&hist[(key >> shift) & 255u], 1);
            }
            __syncthreads();
            if (tid == 0) {
                int above = 0;
                int d = 255;
                for (; d > 0 && above + hist[d] < wanted; --d) above += hist[d];
                digit_above[0] = d;
                digit_above[1] = above;
            }
            __syncthreads();
            kth |= (unsigned)digit_above[0] << shift;
            fixed_mask |= 255u << shift;
            wanted -= digit_above[1];
        }
    }

    float z = 0.f;
    for (int i = tid; i < vocab; i += nt) {
        const float v = rp::to_float<T>(x[i]);
        const float pi = (v == v && rp::ordered_key(v) >= kth) ? expf((v - m) / temperature) : 0.f;
        p[i] = pi;
        z += pi;
    }
    z = rp::block_reduce(z, fscratch, rp::SumOp());  // also orders the writes of p before the reads below

    // Each thread's contiguous chunk, for the passes that need token-id order.
    const int chunk = (vocab + nt - 1) / nt;
    const int c0 = min(vocab, tid * chunk);
    const int c1 = min(vocab, c0 + chunk);

    if (top_p < 1.f) {
        // p >= 0, so its bit pattern is an order-preserving key. tau: the largest key whose tokens at or
        // above it reach the target mass; tokens tied at tau are then kept in token-id order.
        const float target = top_p * z;
        unsigned tau = 0u;
        for (int bit = 30; bit >= 0; --bit) {
            const unsigned cand = tau | (1u << bit);
            float mass = 0.f;
            for (int i = tid; i < vocab; i += nt) mass += __float_as_uint(p[i]) >= cand ? p[i] : 0.f;
            if (rp::block_reduce(mass, fscratch, rp::SumOp()) >= target) tau = cand;
        }
        float above = 0.f;
        for (int i = tid; i < vocab; i += nt) above += __float_as_uint(p[i]) > tau ? p[i] : 0.f;
        above = rp::block_reduce(above, fscratch, rp::SumOp());
        float tied = 0.f;
        for (int i = c0; i < c1; ++i) tied += __float_as_uint(p[i]) == tau ? p[i] : 0.f;
        float unused;
        float acc = above + rp::block_exclusive_scan(tied, fscratch, &unused);
        for (int i = c0; i < c1; ++i) {
            const unsigned key = __float_as_uint(p[i]);
            if (key < tau) {
                p[i] = 0.f;
            } else if (key == tau) {
                if (acc < target) acc += p[i];
                else p[i] = 0.f;
            }
        }
        __syncthreads();
    }
    if (min_p > 0.f) {
        for (int i = tid; i < vocab; i += nt)
            if (p[i] < min_p) p[i] = 0.f;
        __syncthreads();
    }

    // Inverse CDF over the kept mass in token-id order.
    float mine = 0.f;
    for (int i = c0; i < c1; ++i) mine += p[i];
    float total;
    float acc = rp::block_exclusive_scan(mine, fscratch, &total);
    const float threshold = uniform * total;
    int pick = rp::NO_INDEX;
    int last = -1;
    for (int i = c0; i < c1; ++i) {
        const float pi = p[i];
        acc += pi;
        if (pi > 0.f) {
            last = i;
            if (acc > threshold && pick == rp::NO_INDEX) pick = i;
        }
    }
    pick = rp::block_reduce(pick, iscratch, rp::MinOp());
    if (pick == rp::NO_INDEX) pick = rp::block_reduce(last, iscratch, rp::MaxOp());  // rounding at the end
    if (tid == 0) out_ids[s] = pick >= 0 ? pick : (best_i == rp::NO_INDEX ? 0 : best_i);
}

// Structured outputs: the logits of the tokens a packed bitmask forbids set to -inf (before sampling).
// Token t is allowed by mask m when bit (t % 32) of int32 word (t / 32) of row m is set (the layout of
// vLLM, xgrammar and llguidance); tokens past 32 * words are forbidden. Rows without a mask are untouched.
//
// grid: (ceil(vocab / blockDim.x), num_masks), block: any size.
// logits: [num_rows, vocab] of T, row stride logits_stride (elements); bitmask: int32 [num_masks, words];
// rows: int32 [num_masks], the logits row of each mask.
template <typename T>
__global__ void apply_token_bitmask_kernel(T* __restrict__ logits, long long logits_stride,
                                           const int* __restrict__ bitmask, int words,
                                           const int* __restrict__ rows, int vocab) {
    const int m = blockIdx.y;
    const int t = blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= vocab) return;
    const int w = t >> 5;
    const bool allowed = w < words && ((((unsigned)bitmask[(rp::i64)m * words + w]) >> (t & 31)) & 1u);
    if (!allowed) logits[(rp::i64)rows[m] * logits_stride + t] = rp::from_float<T>(__uint_as_float(0xff800000u));
}

// Sampling parameters' sparse logits edits (rawpaged/model_executor/logits_processors.py), in vLLM v1's
// order, on float32 values: per edited row i, first x_t += add_values[e] for its additive entries (-inf
// forbids t: allowed-ids aside, bad words, min_tokens, logit_bias), then the repetition penalty
// (x / r if x > 0 else x * r) on its repetition entries, then x_t -= frequency * c_t and x_t -= presence on
// its count entries. A row's token ids are unique within each of its three segments, so each thread owns
// its entries; the block syncs between segments.
//
// grid: (num_edited_rows), block: any multiple of 32.
// logits: [num_rows, vocab] of T, row stride logits_stride (elements). rows: int32 [R].
// *_start: int32 [R + 1] (CSR offsets into the segment's entries); *_ids: int32 token ids; add_values,
// counts: float32 per entry; repetition, frequency, presence: float32 [R].
template <typename T>
__global__ void apply_logits_edits_kernel(T* __restrict__ logits, long long logits_stride,
                                          const int* __restrict__ rows, const int* __restrict__ add_start,
                                          const int* __restrict__ add_ids, const float* __restrict__ add_values,
                                          const int* __restrict__ rep_start, const int* __restrict__ rep_ids,
                                          const float* __restrict__ repetition,
                                          const int* __restrict__ count_start, const int* __restrict__ count_ids,
                                          const float* __restrict__ counts, const float* __restrict__ frequency,
                                          const float* __restrict__ presence) {
    const int i = blockIdx.x;
    T* row = logits + (rp::i64)rows[i] * logits_stride;
    for (int e = add_start[i] + threadIdx.x; e < add_start[i + 1]; e += blockDim.x) {
        const int t = add_ids[e];
        row[t] = rp::from_float<T>(rp::to_float(row[t]) + add_values[e]);
    }
    __syncthreads();
    const float r = repetition[i];
    for (int e = rep_start[i] + threadIdx.x; e < rep_start[i + 1]; e += blockDim.x) {
        const int t = rep_ids[e];
        const float x = rp::to_float(row[t]);
        row[t] = rp::from_float<T>(x > 0.0f ? x / r : x * r);
    }
    __syncthreads();
    const float f = frequency[i];
    const float p = presence[i];
    for (int e = count_start[i] + threadIdx.x; e < count_start[i + 1]; e += blockDim.x) {
        const int t = count_ids[e];
        row[t] = rp::from_float<T>((rp::to_float(row[t]) - f * counts[e]) - p);
    }
}
