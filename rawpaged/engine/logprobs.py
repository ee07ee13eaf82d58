"""Logprobs as the engine reports them: of the model's raw distribution (``log_softmax`` of the logits,
before temperature and filtering), as vLLM does; per generated token, the chosen token's and the ``k``
most likely ones'."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Logprob:
    """One prompt token's (or top candidate's) logprob as vLLM's ``Logprob``: ``rank`` 1 for the most likely
    id; ``decoded_token`` its text (special tokens included)."""

    logprob: float
    rank: int
    decoded_token: str | None = None


def prompt_logprob_entries(scored: list, tokenizer) -> list:
    """The runner's ``{token_id: (logprob, rank)}`` entries as ``{token_id: Logprob}`` with their texts."""
    return [
        {t: Logprob(lp, rank, tokenizer.decode([t], skip_special_tokens=False)) for t, (lp, rank) in e.items()}
        for e in scored
    ]


def top_logprobs(logprobs_row: np.ndarray, token_id: int, k: int) -> dict:
    """``{token_id: logprob}``: the chosen token first, then the ``k`` most likely ones in descending
    order, equal values by lower id (the chosen one not repeated; ``k`` at most the vocabulary, -1 all of
    it), from a float32 ``log_softmax`` row."""
    out = {int(token_id): float(logprobs_row[token_id])}
    n = len(logprobs_row)
    k = n if k < 0 else min(k, n)
    if k > 0:
        kth = np.partition(logprobs_row, n - k)[n - k]  # the k-th largest value
        above = np.flatnonzero(logprobs_row > kth)
        top = np.concatenate([above, np.flatnonzero(logprobs_row == kth)[: k - len(above)]])  # ids ascending
        for t in top[np.argsort(-logprobs_row[top], kind="stable")]:
            out.setdefault(int(t), float(logprobs_row[t]))
    return out
