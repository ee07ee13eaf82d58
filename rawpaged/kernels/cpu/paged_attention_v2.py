"""The CPU's split decode attention (vLLM's paged attention v2): a long context cut into partitions of
``PARTITION_SIZE`` positions, each folded into its own softmax state by its own task, then the states
merged per (sequence, head). It keeps every thread busy where a decode batch has fewer (sequence, KV
heads) tasks than threads, as Gemma 3's one KV head at batch 1 has. ``attention.paged_attention`` picks it
(``decode_partition``); the math is the unsplit kernel's (Vaswani et al. 2017, eq. 1), merged as
FlashDecoding does: ``out = sum_p exp(m_p - m) acc_p / sum_p exp(m_p - m) denom_p``.
"""

from __future__ import annotations

import numba as nb
import numpy as np

from rawpaged.kernels.cpu.attention_span import attend_span, kv_heads_per_task, scaled_queries, span_start
from rawpaged.kernels.cpu.intrinsics import exp_f32
from rawpaged.kernels.cpu.jit import jit_serial_and_parallel

#: positions per partition of a decode context split across tasks (vLLM's paged attention v2, whose
#: CUDA partitions hold 512): small enough that a 512-position sliding window still gives 2 threads work
PARTITION_SIZE = 128


def decode_partition(num_seqs: int, num_kv_heads: int) -> int:
    """The decode kernels' ``partition`` for a batch: ``PARTITION_SIZE`` when its (sequence, KV heads)
    tasks (``kv_heads_per_task``) leave threads idle, as Gemma 3's one KV head at batch 1 does, else 0
    (each task attends its whole context)."""
    tasks = num_seqs * (num_kv_heads // kv_heads_per_task(num_seqs, num_kv_heads))
    return PARTITION_SIZE if tasks < 2 * nb.get_num_threads() else 0


def _paged_attention_v2_kernel(
    out, query, kc, vc, ks, vs, block_tables, context_lens, scale, nkv, window, soft_cap, partition
):
    """``attention.paged_attention``'s arguments (the caches as ``cache.cache_view`` gives them) and
    ``partition`` > 0, the positions per partition."""
    num_seqs = query.shape[0]
    num_heads = query.shape[1]
    head_dim = query.shape[2]
    num_kv_heads = kc.shape[2]
    group = num_heads // num_kv_heads
    chunks = num_kv_heads // nkv
    rows = nkv * group
    # Partition p of a sequence holds its attended positions in the p-th run of ``partition`` absolute
    # positions from its first one's; each task folds one partition into its own softmax state, then one
    # pass per (sequence, head) merges the partitions' states.
    parts = 1
    for s in range(num_seqs):
        ctx = np.int64(context_lens[s])
        if ctx > 0:
            parts = max(parts, (ctx - 1) // partition - span_start(ctx, window) // partition + 1)
    part_acc = np.empty((num_seqs, num_heads, parts, head_dim), dtype=np.float32)
    part_m = np.empty((num_seqs, num_heads, parts), dtype=np.float32)
    part_denom = np.empty((num_seqs, num_heads, parts), dtype=np.float32)
    for task in nb.prange(num_seqs * chunks * parts):
        p = task % parts
        s = task // parts // chunks
        kv0 = (task // parts % chunks) * nkv
        h0 = kv0 * group
        ctx = np.int64(context_lens[s])
        start = span_start(ctx, window)
        first = (start // partition + p) * partition
        lo, hi = max(start, first), min(ctx, first + partition)
        qs, acc, m, denom = scaled_queries(query[s, h0 : h0 + rows], scale)
        if lo < hi:
            attend_span(qs, kc, vc, ks, vs, block_tables[s], kv0, nkv, group, lo, hi, soft_cap, acc, m, denom)
        for r in range(rows):
            part_m[s, h0 + r, p] = m[r]
            part_denom[s, h0 + r, p] = denom[r]
            dst = part_acc[s, h0 + r, p]
            ar = acc[r]
            for d in range(head_dim):
                dst[d] = ar[d]
    for task in nb.prange(num_seqs * num_heads):
        s = task // num_heads
        h = task % num_heads
        ms = part_m[s, h]
        top = np.float32(-1e30)
        for p in range(parts):
            top = max(top, ms[p])
        total = np.float32(0.0)
        o = np.zeros(head_dim, dtype=np.float32)
        for p in range(parts):
            c = exp_f32(ms[p] - top)  # 1 for the top partition; an empty one (m = -1e30) adds 0
            total += part_denom[s, h, p] * c
            pa = part_acc[s, h, p]
            for d in range(head_dim):
                o[d] += pa[d] * c
        inv = np.float32(1.0) / total if total > 0 else np.float32(0.0)
        orow = out[s, h]
        for d in range(head_dim):
            orow[d] = o[d] * inv


paged_attention_v2_serial, paged_attention_v2_parallel = jit_serial_and_parallel(_paged_attention_v2_kernel)
