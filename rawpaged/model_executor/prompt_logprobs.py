"""Prompt logprobs (vLLM's ``prompt_logprobs``, OpenAI's ``echo`` with ``logprobs``): for each prompt token
after the first, its logprob under the model given the tokens before it, and the ``k`` most likely tokens
there, from the hidden states a prefill step computes anyway.

The LM head runs over ``CHUNK_ROWS`` positions at a time and each chunk is reduced to a few numbers per
position before the next, so a long prompt never holds its ``[positions, vocab]`` logits at once (a
2K-token prompt with a 49k vocabulary would take 400 MB; a chunk takes 25 MB and a 6 MB mask). Per position
``i`` with logits ``x`` and next prompt token ``t``: ``logprob = x_t - (max x + log sum exp(x - max x))``
(log-softmax of the raw logits, no temperature, as vLLM), and the top ``k`` ids by ``x`` (equal values by
lower id).
"""

from __future__ import annotations

import numba as nb
import numpy as np

#: positions per LM-head chunk: 128 x 49152 float32 logits are 25 MB
CHUNK_ROWS = 128


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


def chunk_logprobs(logits: np.ndarray, targets: np.ndarray, k: int) -> list:
    """Per row of float32 ``logits [m, vocab]`` (overwritten: the exponentials are computed in place, so a
    chunk costs its logits and one byte per logit more): ``{target: (logprob, rank), then the k most likely ids:
    (logprob, rank)}`` (the target first, not repeated). A top id's rank is its place (1..k); the target's
    is how many ids have a logit at least its own (vLLM's ``batched_count_greater_than``)."""
    x = np.asarray(logits, dtype=np.float32)  # overwritten below: the caller's chunk, not kept
    rows = np.arange(x.shape[0])
    target_x = x[rows, targets]
    ranks = (x >= target_x[:, None]).sum(axis=1)
    top = np.empty((x.shape[0], k), dtype=np.int64)
    if k:
        _top_k_rows(x, k, top)
    top_x = np.take_along_axis(x, top, axis=1)
    peak = x.max(axis=1, keepdims=True)
    np.subtract(x, peak, out=x)  # in place: no second [m, vocab] buffer
    np.exp(x, out=x)
    lse = peak[:, 0].astype(np.float64) + np.log(x.sum(axis=1, dtype=np.float64))
    target_lp = target_x.astype(np.float64) - lse
    top_lp = top_x.astype(np.float64) - lse[:, None]
    out = []
    for r in range(x.shape[0]):
        entry = {int(targets[r]): (float(target_lp[r]), int(ranks[r]))}
        for place, t in enumerate(top[r]):
            entry.setdefault(int(t), (float(top_lp[r, place]), place + 1))
        out.append(entry)
    return out


def prompt_logprobs(compute_logits, to_numpy, hidden, targets: list, k: int) -> list:
    """Logprob entries of ``targets`` (``len(targets)`` next-token ids) given ``hidden`` rows (the same
    count, on the backend): the LM head ``compute_logits`` chunk by chunk, each chunk brought to the host
    (``to_numpy``) and reduced by ``chunk_logprobs``."""
    out = []
    targets = np.asarray(targets, dtype=np.int64)
    for a in range(0, len(targets), CHUNK_ROWS):
        b = min(a + CHUNK_ROWS, len(targets))
        logits = to_numpy(compute_logits(hidden[a:b]))
        out += chunk_logprobs(logits, targets[a:b], k)
        del logits
    return out
