"""The CPU backend's sampler: ``rawpaged.kernels.cpu.sample``'s semantics (temperature, top-k, top-p,
min-p, then an inverse-CDF draw in token-id order) compiled with Numba, one sample per task.

The NumPy reference sorts the whole vocabulary for top-p (a stable argsort of 49k float64 values: about
6 ms per row on this project's 2-core host, 0.37 s per step at batch 64). Here only the candidates are
sorted: the tokens whose probability is at least a threshold ``t`` whose set already holds ``top_p`` of
the mass. Every token of the nucleus has a probability of at least ``t`` (the nucleus is the shortest
descending prefix reaching ``top_p``), so the candidates, sorted stably by descending probability, are a
prefix of the reference's order and give the same cut. ``t`` starts at the largest probability and is
divided by 16 until its set holds ``top_p`` (one pass over the row each; a peaked distribution needs one
or two). Sums run in float64 in the same orders as the reference, up to NumPy's pairwise summation of
whole rows, so draws agree except where a uniform falls within rounding of a token's CDF boundary.
"""

from __future__ import annotations

import numba as nb
import numpy as np

_JIT = dict(cache=True, nogil=True)  # no fastmath: sums and comparisons as written
#: the candidate threshold shrinks by this factor per pass
_THRESHOLD_STEP = 1.0 / 16.0


@nb.njit(**_JIT)
def _sample_row(row, temperature, top_k, top_p, min_p, uniform):
    vocab = row.shape[0]
    if not temperature > 0.0:  # greedy: the first maximum
        return np.argmax(row)
    x = np.empty(vocab, dtype=np.float64)
    for i in range(vocab):
        x[i] = np.float64(row[i]) / temperature
    if 0 < top_k < vocab:
        kth = np.partition(x.copy(), vocab - top_k)[vocab - top_k]
        for i in range(vocab):
            if not x[i] >= kth:
                x[i] = -np.inf
    m = np.max(x)
    p = np.empty(vocab, dtype=np.float64)
    total = 0.0
    for i in range(vocab):
        p[i] = np.exp(x[i] - m)
        total += p[i]
    pmax = 0.0
    for i in range(vocab):
        p[i] /= total
        pmax = max(pmax, p[i])
    if top_p < 1.0:
        t = pmax
        while True:
            mass = 0.0
            for i in range(vocab):
                if p[i] >= t:
                    mass += p[i]
            if mass >= top_p or t == 0.0:
                break
            t *= _THRESHOLD_STEP
        n = 0
        for i in range(vocab):
            if p[i] >= t:
                n += 1
        cand = np.empty(n, dtype=np.int64)
        neg = np.empty(n, dtype=np.float64)
        j = 0
        for i in range(vocab):
            if p[i] >= t:
                cand[j] = i
                neg[j] = -p[i]
                j += 1
        order = np.argsort(neg, kind="mergesort")  # stable: equal probabilities keep token-id order
        cum = 0.0
        cut = n
        for j in range(n):
            cum += p[cand[order[j]]]
            if cum >= top_p:
                cut = j + 1
                break
        keep = np.zeros(vocab, dtype=np.bool_)
        for j in range(cut):
            keep[cand[order[j]]] = True
        total = 0.0
        for i in range(vocab):
            if not keep[i]:
                p[i] = 0.0
            total += p[i]
        pmax = 0.0
        for i in range(vocab):
            p[i] /= total
            pmax = max(pmax, p[i])
    if min_p > 0.0:
        floor = min_p * pmax
        total = 0.0
        for i in range(vocab):
            if not p[i] >= floor:
                p[i] = 0.0
            total += p[i]
        for i in range(vocab):
            p[i] /= total
    cdf_total = 0.0
    for i in range(vocab):
        cdf_total += p[i]
    target = uniform * cdf_total
    cum = 0.0
    for i in range(vocab):
        cum += p[i]
        if cum > target:
            return i
    return vocab - 1


def _sample_kernel(logits, sample_rows, temperature, top_k, top_p, min_p, uniforms, out):
    for j in nb.prange(sample_rows.shape[0]):
        out[j] = _sample_row(logits[sample_rows[j]], temperature[j], top_k[j], top_p[j], min_p[j], uniforms[j])


_sample_serial = nb.njit(**_JIT)(_sample_kernel)
_sample_parallel = nb.njit(parallel=True, **_JIT)(_sample_kernel)


def sample(logits, sample_rows, temperature, top_k, top_p, min_p, uniforms):
    """Token ids drawn from rows of ``logits``, as ``rawpaged.kernels.cpu.sample`` draws them (see the
    module doc for where they may differ).

    logits: float32 ``[num_rows, vocab]``; sample_rows (int), temperature (``<= 0``: greedy), top_k,
    top_p, min_p, uniforms (in [0, 1)): ``[num_samples]`` each. Returns int64 ``[num_samples]``.
    Samples run in parallel on Numba's threads when there are several.
    """
    n = len(sample_rows)
    out = np.empty(n, dtype=np.int64)
    if n == 0:
        return out
    kernel = _sample_parallel if n > 1 else _sample_serial
    kernel(
        np.ascontiguousarray(logits, dtype=np.float32),
        np.asarray(sample_rows, dtype=np.int64),
        np.asarray(temperature, dtype=np.float64),
        np.asarray(top_k, dtype=np.int64),
        np.asarray(top_p, dtype=np.float64),
        np.asarray(min_p, dtype=np.float64),
        np.asarray(uniforms, dtype=np.float64),
        out,
    )
    return out
