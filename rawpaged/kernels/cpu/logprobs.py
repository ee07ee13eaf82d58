"""The CPU backend's log-softmax reductions of logits rows (prompt logprobs): per row, the target token's
logprob and rank and the ``k`` most likely tokens with their logprobs, so the caller never keeps the
``[rows, vocab]`` logits (``cuda/logprobs.cu`` is the device's; its header has the definitions).

Per row ``x`` (raw logits, no temperature, as vLLM) and target ``t``: ``logprob_i = x_i - (max x + log sum
exp(x - max x))``, the exponentials in float32 and their sum and the logarithm in float64; the target's
rank is ``#{i: x_i >= x_t}`` (vLLM's ``batched_count_greater_than``); the top ids are in descending
``x``, equal values by lower id.
"""

from __future__ import annotations

import numba as nb
import numpy as np

#: top-k sizes above this sort whole rows instead (``logprobs: -1`` asks for the whole vocabulary)
FULL_SORT_K = 64


@nb.njit(cache=True, nogil=True, parallel=True)
def _top_k_rows(x, k, out):  # the k largest of each row, descending, equal values by lower id
    for r in nb.prange(x.shape[0]):
        row = x[r]
        ids = out[r]
        vals = np.full(k, -np.inf, dtype=np.float32)
        ids[:] = -1
        for t in range(row.shape[0]):
            v = row[t]
            if v > vals[k - 1] or (ids[k - 1] < 0 and v == vals[k - 1]):
                j = k - 1
                while j > 0 and (v > vals[j - 1] or ids[j - 1] < 0):
                    vals[j] = vals[j - 1]
                    ids[j] = ids[j - 1]
                    j -= 1
                vals[j] = v
                ids[j] = t


def logprob_rows(logits: np.ndarray, targets: np.ndarray, k: int) -> tuple:
    """Log-softmax reductions of float32 ``logits [m, vocab]`` (overwritten: the exponentials are computed in
    place, so a chunk costs its logits and one byte per logit more) for int ``targets [m]`` and ``k >= 0``.

    Returns host arrays ``(target_logprobs float64 [m], target_ranks int64 [m], top_ids int64 [m, k],
    top_logprobs float64 [m, k])``.
    """
    x = np.asarray(logits, dtype=np.float32)  # overwritten below: the caller's chunk, not kept
    targets = np.asarray(targets, dtype=np.int64)
    rows = np.arange(x.shape[0])
    target_x = x[rows, targets]
    ranks = (x >= target_x[:, None]).sum(axis=1).astype(np.int64)
    if k > FULL_SORT_K:  # ``_top_k_rows`` costs k per candidate: a sort of the row is cheaper
        top = np.argsort(-x, axis=1, kind="stable")[:, :k].astype(np.int64)
    else:
        top = np.empty((x.shape[0], k), dtype=np.int64)
        if k:
            _top_k_rows(x, k, top)
    top_x = np.take_along_axis(x, top, axis=1)
    peak = x.max(axis=1, keepdims=True)
    np.subtract(x, peak, out=x)  # in place: no second [m, vocab] buffer
    np.exp(x, out=x)
    lse = peak[:, 0].astype(np.float64) + np.log(x.sum(axis=1, dtype=np.float64))
    return target_x.astype(np.float64) - lse, ranks, top, top_x.astype(np.float64) - lse[:, None]
