"""Prompt logprobs (vLLM's ``prompt_logprobs``, OpenAI's ``echo`` with ``logprobs``): for each prompt token
after the first, its logprob under the model given the tokens before it, and the ``k`` most likely tokens
there, from the hidden states a prefill step computes anyway.

The LM head runs over ``CHUNK_ROWS`` positions at a time and the backend reduces each chunk to a few numbers
per position (``Backend.logprob_rows``: the CPU's in place, CUDA's on the device) before the next, so a long
prompt never holds its ``[positions, vocab]`` logits at once (a 2K-token prompt with a 49k vocabulary would
take 400 MB; a chunk takes 25 MB) and on CUDA they never leave the GPU.
"""

from __future__ import annotations

import numpy as np

#: positions per LM-head chunk: 128 x 49152 float32 logits are 25 MB
CHUNK_ROWS = 128


def entries(target_ids, target_lp, ranks, top_ids, top_lp) -> list:
    """Per position ``{target: (logprob, rank), then the k most likely ids: (logprob, rank)}`` (the target
    first, not repeated) from ``Backend.logprob_rows``'s arrays. A top id's rank is its place (1..k); the
    target's is how many ids have a logit at least its own."""
    out = []
    for r in range(len(target_ids)):
        entry = {int(target_ids[r]): (float(target_lp[r]), int(ranks[r]))}
        for place, t in enumerate(top_ids[r]):
            entry.setdefault(int(t), (float(top_lp[r, place]), place + 1))
        out.append(entry)
    return out


def prompt_logprobs(compute_logits, logprob_rows, hidden, targets: list, k: int) -> list:
    """Logprob entries (see :func:`entries`) of ``targets`` (``len(targets)`` next-token ids) given ``hidden``
    rows (the same count, on the backend): the LM head ``compute_logits`` chunk by chunk, each chunk reduced by
    the backend's ``logprob_rows(logits, targets, k)`` (``k`` -1: the whole vocabulary)."""
    out = []
    targets = np.asarray(targets, dtype=np.int64)
    for a in range(0, len(targets), CHUNK_ROWS):
        b = min(a + CHUNK_ROWS, len(targets))
        logits = compute_logits(hidden[a:b])
        out += entries(targets[a:b], *logprob_rows(logits, targets[a:b], logits.shape[1] if k < 0 else k))
        del logits
    return out
