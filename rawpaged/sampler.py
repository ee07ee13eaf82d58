"""Token selection from logits: greedy, temperature, top-k, top-p, min-p, per-request seeds, logprobs.

Order of the filters follows vLLM/HF: temperature scaling, then top-k, top-p (Holtzman et al. 2020,
nucleus sampling) and min-p (Nguyen et al. 2024) on the tempered distribution. Returned logprobs are
of the model's raw distribution (``log_softmax(logits)``, before temperature), as vLLM reports them.
"""

from __future__ import annotations

import numpy as np


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """float32 ``log_softmax`` over the last axis, computed stably in float64."""
    x = logits.astype(np.float64)
    x = x - x.max(axis=-1, keepdims=True)
    return (x - np.log(np.exp(x).sum(axis=-1, keepdims=True))).astype(np.float32)


def filtered_probs(logits_row: np.ndarray, temperature: float, top_k: int, top_p: float, min_p: float):
    """Probabilities (float64, sums to 1) after temperature, top-k, top-p and min-p."""
    x = logits_row.astype(np.float64) / temperature
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
        # Keep the smallest prefix whose mass reaches top_p (always at least one token).
        cut = int(np.searchsorted(cum, top_p)) + 1
        mask = np.zeros_like(p, dtype=bool)
        mask[order[:cut]] = True
        p = np.where(mask, p, 0.0)
        p /= p.sum()
    if min_p > 0.0:
        p = np.where(p >= min_p * p.max(), p, 0.0)
        p /= p.sum()
    return p


def sample_row(logits_row: np.ndarray, params, rng: np.random.Generator, num_samples: int = 1) -> list:
    """``num_samples`` token ids for one row of logits under ``params`` (SamplingParams)."""
    if params.greedy:
        return [int(np.argmax(logits_row))] * num_samples
    p = filtered_probs(logits_row, params.temperature, params.top_k, params.top_p, params.min_p)
    # Inverse-CDF sampling with one uniform draw per sample: reproducible for a given rng state.
    cdf = np.cumsum(p)
    u = rng.random(num_samples) * cdf[-1]
    return [int(min(np.searchsorted(cdf, ui, side="right"), len(p) - 1)) for ui in u]


def top_logprobs(logprobs_row: np.ndarray, token_id: int, k: int) -> dict:
    """``{token_id: logprob}`` for the chosen token plus the ``k`` most likely ones."""
    out = {int(token_id): float(logprobs_row[token_id])}
    if k > 0:
        top = np.argpartition(-logprobs_row, k)[:k]
        for t in top[np.argsort(-logprobs_row[top], kind="stable")]:
            out.setdefault(int(t), float(logprobs_row[t]))
    return out
