// Log-softmax reductions of logits rows on the device, for prompt logprobs (vLLM's `prompt_logprobs`,
// OpenAI's `echo` with `logprobs`), so that a chunk's [rows, vocab] logits never leave the GPU: per row, a
// few numbers come back.
//
// Per row x (raw logits, no temperature) and target token t (the next prompt token):
//   max      m = max_i x_i
//   sum      s = sum_i exp(x_i - m), so log-softmax(x)_i = x_i - (m + log s)   (computed on the host in float64)
//   rank     #{i : x_i >= x_t}  (vLLM's batched_count_greater_than: the target counts itself)
//   top-k    the k ids of largest x, descending, equal values by lower id (the order of
//            rawpaged/kernels/cpu/logprobs.py `_top_k_rows`); NaN logits never enter.
// The same numbers as the CPU kernel up to float32 summation order (the sum here is a block reduction).
//
// Top-k runs k rounds over the row: round r takes the largest (x, -id) pair below the pair round r - 1
// took, by a block max of x then a block min of the ids holding it (k <= 20 in practice: OpenAI's and
// vLLM's limit on logprobs; MAX_LOGPROBS on the host).
//
// grid: (num_rows), block: a multiple of 32, at most 1024.
// logits: [num_rows, vocab] of T, row stride logits_stride (elements); targets: int32 [num_rows].
// stats: float32 [num_rows, 3] = (m, s, x_t); ranks: int32 [num_rows];
// top_ids: int32 [num_rows, k], top_values: float32 [num_rows, k] (k may be 0: both unused).
#include "common.cuh"

template <typename T>
__global__ void logprobs_kernel(const T* __restrict__ logits, long long logits_stride,
                                const int* __restrict__ targets, int vocab, int k, float* __restrict__ stats,
                                int* __restrict__ ranks, int* __restrict__ top_ids,
                                float* __restrict__ top_values) {
    __shared__ float fscratch[32];
    __shared__ int iscratch[32];
    const int r = blockIdx.x;
    const int tid = threadIdx.x;
    const int nt = blockDim.x;
    const T* __restrict__ x = logits + (rp::i64)r * logits_stride;
    constexpr int NO_ID = 0x7fffffff;
    const float inf = __uint_as_float(0x7f800000u);

    float m = rp::NEG_BIG;
    for (int i = tid; i < vocab; i += nt) {
        const float v = rp::to_float<T>(x[i]);
        if (v > m) m = v;
    }
    m = rp::block_reduce(m, fscratch, rp::MaxOp());

    const float xt = rp::to_float<T>(x[targets[r]]);
    float s = 0.f;
    int rank = 0;
    for (int i = tid; i < vocab; i += nt) {
        const float v = rp::to_float<T>(x[i]);
        if (v == v) s += expf(v - m);
        rank += v >= xt;
    }
    s = rp::block_reduce(s, fscratch, rp::SumOp());
    rank = rp::block_reduce(rank, iscratch, rp::SumOp());

    // the pair taken by the previous round: candidates are below it in (x descending, id ascending) order
    float bound_v = inf;
    int bound_i = -1;
    for (int j = 0; j < k; ++j) {
        float best = -inf;
        int best_i = NO_ID;
        for (int i = tid; i < vocab; i += nt) {
            const float v = rp::to_float<T>(x[i]);
            const bool below = v < bound_v || (v == bound_v && i > bound_i);
            if (v == v && below && (v > best || best_i == NO_ID)) {
                best = v;
                best_i = i;
            }
        }
        const float top = rp::block_reduce(best, fscratch, rp::MaxOp());
        const int top_i = rp::block_reduce(best_i != NO_ID && best == top ? best_i : NO_ID, iscratch, rp::MinOp());
        if (tid == 0) {
            top_ids[(rp::i64)r * k + j] = top_i == NO_ID ? -1 : top_i;
            top_values[(rp::i64)r * k + j] = top;
        }
        bound_v = top;
        bound_i = top_i;
    }
    if (tid == 0) {
        stats[3 * (rp::i64)r] = m;
        stats[3 * (rp::i64)r + 1] = s;
        stats[3 * (rp::i64)r + 2] = xt;
        ranks[r] = rank;
    }
}
