"""The sampling reference: float64 NumPy, one row at a time, written from the definitions. The CPU
backend's Numba sampler (``rawpaged.kernels.cpu.sampling``) and ``cuda/sampling.cu`` draw the same
tokens; tests and the sampling benchmarks compare them with this.
"""

from __future__ import annotations

import numpy as np


def filtered_probs(logits_row, temperature: float, top_k: int, top_p: float, min_p: float):
    """float64 probabilities (sum 1) of one logits row after temperature, top-k, top-p and min-p.

    Order as in vLLM/HF: the logits are divided by ``temperature``; top-k keeps values >= the k-th
    largest (ties kept); top-p (Holtzman et al. 2020) keeps the smallest prefix of tokens by descending
    probability, stable order, whose mass reaches ``top_p``; min-p (Nguyen et al. 2024) keeps
    ``p >= min_p * max(p)``. ``top_k <= 0`` or ``>= vocab``, ``top_p >= 1`` and ``min_p <= 0`` disable.
    """
    x = np.asarray(logits_row, dtype=np.float64) / temperature
    vocab = x.shape[0]
    if 0 < top_k < vocab:
        kth = np.partition(x, vocab - top_k)[vocab - top_k]
        x = np.where(x >= kth, x, -np.inf)
    x -= x.max()
    p = np.exp(x)
    p /= p.sum()
    if top_p < 1.0:
        order = np.argsort(-p, kind="stable")
        cum = np.cumsum(p[order])
        cut = int(np.searchsorted(cum, top_p)) + 1  # the first prefix whose mass reaches top_p
        mask = np.zeros_like(p, dtype=bool)
        mask[order[:cut]] = True
        p = np.where(mask, p, 0.0)
        p /= p.sum()
    if min_p > 0.0:
        p = np.where(p >= min_p * p.max(), p, 0.0)
        p /= p.sum()
    return p


def sample(logits, sample_rows, temperature, top_k, top_p, min_p, uniforms):
    """Token ids drawn from rows of ``logits`` (the reference the CUDA ``sample_kernel`` follows).

    logits: float ``[num_rows, vocab]``; the others ``[num_samples]``: sample_rows (int, the logits row
    of each sample), temperature (``<= 0`` = greedy: first index of the max), top_k, top_p, min_p,
    uniforms (float in [0, 1), drawn by the caller from the request's generator). Each non-greedy
    sample is the first token whose running sum of :func:`filtered_probs` in token-id order exceeds
    ``uniform`` times the total (inverse CDF). Returns int64 ``[num_samples]``.
    """
    out = np.empty(len(sample_rows), dtype=np.int64)
    greedy = ~(np.asarray(temperature, dtype=np.float64) > 0)
    argmax = np.argmax(logits, axis=1) if greedy.any() else None
    for j, row in enumerate(sample_rows):
        if greedy[j]:
            out[j] = argmax[int(row)]
            continue
        p = filtered_probs(logits[int(row)], float(temperature[j]), int(top_k[j]), float(top_p[j]), float(min_p[j]))
        cdf = np.cumsum(p)
        out[j] = min(int(np.searchsorted(cdf, uniforms[j] * cdf[-1], side="right")), len(cdf) - 1)
    return out
