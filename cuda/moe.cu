// Mixture-of-experts routing and scatter (rawpaged/kernels/cpu/moe.py is the reference; docs/moe.md): the
// router's top-k with the architecture's normalization, tokens grouped by expert (vLLM's
// moe_align_block_size without padding), the tile list of the grouped products (cuda/quant.cu's moe_*_kernel)
// and the weighted combine back to token order. A step of a sparse block over T tokens, E experts, k each:
//   moe_route_kernel -> ids int32 [T, k], weights float32 [T, k]
//   moe_align_kernel -> sorted_ids int32 [T * k] (flat indices t * k + j in expert order, stable), offsets int64 [E + 1]
//   moe_tiles_kernel -> the row tiles of the experts that have rows (per grouped product)
//   moe_invert_kernel + moe_combine_kernel -> out [T, H] = sum_j weights[t, j] * y[row of (t, j)] (+ shared expert)
#include "common.cuh"

// Each token's k experts and their weights; one thread per token, so every sum runs in the CPU kernel's order.
// The experts are the k largest logits, in the order of their values, the lower index first among equal ones
// (the j-th pick is the largest of those after pick j - 1 in that order, so no state beyond it is kept).
// softmax_first (Qwen2-MoE, Qwen3-MoE): w_j = p_j, p = softmax over all E (float64), divided by sum_j p_j when
// renormalize. Else (Mixtral): w = softmax over the k selected logits. Exponentials and sums in float64,
// weights rounded to float32. Picks are compared on float64(logit) - max (softmax_first) or float64(logit),
// exactly the values whose order the CPU compares.
// grid: (ceil(T / block)), block: any. logits: [T, E] contiguous (L = float); ids, weights: [T, k].
template <typename L>
__global__ void moe_route_kernel(int* __restrict__ ids, float* __restrict__ weights, const L* __restrict__ logits,
                                 int num_tokens, int E, int k, int softmax_first, int renormalize) {
    const rp::i64 t = (rp::i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= num_tokens) return;
    const L* row = logits + t * E;
    int* out_ids = ids + t * k;
    float* out_w = weights + t * k;
    double m = 0.0;
    if (softmax_first) {
        float mf = rp::to_float<L>(row[0]);
        for (int e = 1; e < E; ++e) mf = rp::to_float<L>(row[e]) > mf ? rp::to_float<L>(row[e]) : mf;
        m = (double)mf;
    }
    int prev = -1;
    double pv = 0.0;
    for (int j = 0; j < k; ++j) {
        int best = -1;
        double bv = 0.0;
        for (int e = 0; e < E; ++e) {
            const double v = (double)rp::to_float<L>(row[e]) - m;
            const bool after = prev < 0 || v < pv || (v == pv && e > prev);
            if (after && (best < 0 || v > bv)) {  // strictly greater: the lower index wins a tie
                best = e;
                bv = v;
            }
        }
        out_ids[j] = best;
        prev = best;
        pv = bv;
    }
    if (softmax_first) {
        double s = 0.0;
        for (int e = 0; e < E; ++e) s += exp((double)rp::to_float<L>(row[e]) - m);
        double sel = 0.0;
        for (int j = 0; j < k; ++j) sel += exp((double)rp::to_float<L>(row[out_ids[j]]) - m) / s;
        for (int j = 0; j < k; ++j) {
            const double p = exp((double)rp::to_float<L>(row[out_ids[j]]) - m) / s;
            out_w[j] = (float)(renormalize ? p / sel : p);
        }
    } else {  // the first pick is the largest selected logit
        const double top = (double)rp::to_float<L>(row[out_ids[0]]);
        double s = 0.0;
        for (int j = 0; j < k; ++j) s += exp((double)rp::to_float<L>(row[out_ids[j]]) - top);
        for (int j = 0; j < k; ++j) out_w[j] = (float)(exp((double)rp::to_float<L>(row[out_ids[j]]) - top) / s);
    }
}

// The n = T * k flat ids grouped by expert, stably: one block; thread e (and e + blockDim, ...) counts, then
// places, expert e's entries, scanning topk_ids in chunks of CHUNK staged in shared memory (every thread reads
// every entry of a chunk: broadcasts). offsets[e + 1] - offsets[e] = expert e's count, offsets[0] = 0.
// Ids outside [0, E) are not placed (the router never gives any).
// grid: (1), block: multiple of 32 (host: min(1024, round_up(E, 32))). topk_ids: int32 [n].
template <int CHUNK>
__global__ void moe_align_kernel(int* __restrict__ sorted_ids, long long* __restrict__ offsets,
                                 const int* __restrict__ topk_ids, int n, int E) {
    __shared__ int chunk[CHUNK];
    for (int pass = 0; pass < 2; ++pass) {
        for (int e0 = 0; e0 < E; e0 += blockDim.x) {  // uniform trip counts: every thread reaches the barriers
            const int e = e0 + threadIdx.x;
            long long pos = pass == 1 && e < E ? offsets[e] : 0;
            for (int base = 0; base < n; base += CHUNK) {
                const int len = n - base < CHUNK ? n - base : CHUNK;
                __syncthreads();  // the previous chunk is read by everyone
                for (int c = threadIdx.x; c < len; c += blockDim.x) chunk[c] = topk_ids[base + c];
                __syncthreads();
                for (int c = 0; c < len; ++c) {
                    if (chunk[c] == e) {
                        if (pass == 1) sorted_ids[pos] = base + c;
                        ++pos;
                    }
                }
            }
            if (pass == 0 && e < E) offsets[e + 1] = pos;
        }
        __syncthreads();  // the counts are in global memory, visible to the block after the barrier
        if (pass == 0 && threadIdx.x == 0) {
            offsets[0] = 0;
            for (int e = 0; e < E; ++e) offsets[e + 1] += offsets[e];
        }
        __syncthreads();
    }
}

// The row tiles of a grouped product (cuda/quant.cu's moe_*_kernel): for each expert with rows, in expert
// order, ceil(rows / BM) tiles (expert, first row within the expert's rows). tiles[0] = their count, tile t at
// tiles[1 + 2 t], tiles[2 + 2 t]; tiles holds 1 + 2 * (ceil(M / BM) + min(E, M)) ints, an upper bound.
// grid: (1), block: any (thread 0 writes the list; E and the tiles are few).
template <int BM>
__global__ void moe_tiles_kernel(int* __restrict__ tiles, const long long* __restrict__ offsets, int E) {
    if (threadIdx.x != 0) return;
    int count = 0;
    for (int e = 0; e < E; ++e) {
        const long long rows = offsets[e + 1] - offsets[e];
        for (long long r = 0; r < rows; r += BM) {
            tiles[1 + 2 * count] = e;
            tiles[2 + 2 * count] = (int)r;
            ++count;
        }
    }
    tiles[0] = count;
}

// where[sorted_ids[i]] = i: the row of y each flat (token, slot) index went to. Grid-stride over n; any
// grid/block. I: the index type (int32).
template <typename I>
__global__ void moe_invert_kernel(I* __restrict__ where, const I* __restrict__ sorted_ids, int n) {
    const rp::i64 stride = (rp::i64)gridDim.x * blockDim.x;
    for (rp::i64 i = (rp::i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) where[sorted_ids[i]] = (I)i;
}

// out[t, h] = sum_j weights[t, j] * y[where[t * k + j], h], in slot order j = 0 .. k - 1 (float32), plus with
// has_shared Qwen2-MoE's shared expert, shared[t, h] * sigmoid(shared_gate[t]); rounded to T once.
// grid: (T), block: multiple of 32 (host: min(1024, round_up(H, 32))). y: [T * k, H], shared, out: [T, H]
// contiguous; weights, shared_gate: float32 [T, k], [T].
template <typename T>
__global__ void moe_combine_kernel(T* __restrict__ out, const T* __restrict__ y, const int* __restrict__ where,
                                   const float* __restrict__ weights, const T* __restrict__ shared,
                                   const float* __restrict__ shared_gate, int has_shared, int k, int H) {
    const rp::i64 t = blockIdx.x;
    const float gate = has_shared ? 1.f / (1.f + expf(-shared_gate[t])) : 0.f;
    for (int h = threadIdx.x; h < H; h += blockDim.x) {
        float acc = 0.f;
        for (int j = 0; j < k; ++j) acc += weights[t * k + j] * rp::to_float<T>(y[(rp::i64)where[t * k + j] * H + h]);
        if (has_shared) acc += rp::to_float<T>(shared[t * H + h]) * gate;
        out[t * H + h] = rp::from_float<T>(acc);
    }
}
