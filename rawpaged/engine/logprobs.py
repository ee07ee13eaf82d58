"""Logprobs as the engine reports them: of the model's raw distribution (``log_softmax`` of the logits,
before temperature and filtering), as vLLM does; per generated token, the chosen token's and the ``k``
most likely ones'."""

from __future__ import annotations

import numpy as np


def top_logprobs(logprobs_row: np.ndarray, token_id: int, k: int) -> dict:
    """``{token_id: logprob}``: the chosen token first, then the ``k`` most likely ones in descending
    order, equal values by lower id (the chosen one not repeated; ``k`` at most the vocabulary), from a
    float32 ``log_softmax`` row."""
    out = {int(token_id): float(logprobs_row[token_id])}
    k = min(k, len(logprobs_row))
    if k > 0:
        top = np.sort(np.argpartition(-logprobs_row, k - 1)[:k])  # in id order, so equal values keep it
        for t in top[np.argsort(-logprobs_row[top], kind="stable")]:
            out.setdefault(int(t), float(logprobs_row[t]))
    return out
