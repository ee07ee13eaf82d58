"""The CUDA backend's log-softmax reductions of logits rows (prompt logprobs, ``cuda/logprobs.cu``): the
logits stay on the device, a few numbers per row come back (see ``rawpaged.kernels.cpu.logprobs`` for the
semantics)."""

from __future__ import annotations

import numpy as np

from rawpaged.kernels.cuda.launch import ctype, i32, i64, row_stride

#: threads per row's block
THREADS = 256


def logprob_rows(ctx, logits, targets, k: int) -> tuple:
    """``logits [m, vocab]`` on the device (float32, float16 or bfloat16; not changed), host int ``targets
    [m]``, ``k >= 0``. Returns host arrays ``(target_logprobs float64 [m], target_ranks int64 [m], top_ids
    int64 [m, k], top_logprobs float64 [m, k])``; the log-sum-exp is finished on the host in float64 from
    the device's float32 max and sum.

    Raises:
        ValueError on a target outside the vocabulary or a negative ``k``.
    """
    act = ctype(logits, "logits")
    m, vocab = logits.shape
    targets = np.asarray(targets, dtype=np.int64)
    if targets.shape != (m,):
        raise ValueError(f"targets must be [{m}], got {targets.shape}")
    if m and (targets.min() < 0 or targets.max() >= vocab):
        raise ValueError(f"targets must be token ids below the vocabulary size {vocab}")
    if k < 0:
        raise ValueError(f"k must be >= 0, got {k}")
    if m == 0:
        empty = np.zeros((0, k))
        return np.zeros(0), np.zeros(0, np.int64), empty.astype(np.int64), empty
    xp = ctx.xp
    stats = xp.empty((m, 3), dtype=np.float32)
    ranks = xp.empty(m, dtype=np.int32)
    top_ids = xp.empty((m, max(k, 1)), dtype=np.int32)
    top_values = xp.empty((m, max(k, 1)), dtype=np.float32)
    ctx.kernel(
        act,
        act,
        f"logprobs_kernel<{act}>",
        (m, 1, 1),
        (THREADS, 1, 1),
        (
            logits,
            i64(row_stride(logits, "logits", 1)),
            ctx.to_device(targets, np.int32),
            i32(vocab),
            i32(k),
            stats,
            ranks,
            top_ids,
            top_values,
        ),
    )
    stats, ranks, top_ids, top_values = (_host(a) for a in (stats, ranks, top_ids, top_values))
    lse = stats[:, 0].astype(np.float64) + np.log(stats[:, 1].astype(np.float64))
    target_lp = stats[:, 2].astype(np.float64) - lse
    top_lp = top_values[:, :k].astype(np.float64) - lse[:, None]
    return target_lp, ranks.astype(np.int64), top_ids[:, :k].astype(np.int64), top_lp


def _host(a) -> np.ndarray:
    return a.get() if hasattr(a, "get") else np.asarray(a)
