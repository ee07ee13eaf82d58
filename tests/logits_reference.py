"""A float64 NumPy reference of the sampling parameters that edit logits, written densely (whole-vocabulary
masks and counts, as the peers write them) and independent of ``rawpaged.model_executor.logits_processors``'
sparse form.

Sources, in the order applied (vLLM v1 ``vllm/v1/sample/sampler.py``, ``Sampler.apply_logits_processors``):
- ``allowed_token_ids``: a mask filled with ``-inf`` (vLLM ``allowed_token_ids_mask``);
- ``bad_words``: ``vllm/v1/sample/ops/bad_words.py`` ``_apply_bad_words_single_batch``: a word of
  ``k + 1`` tokens bans its last token when the last ``k`` output tokens are its first ``k``;
- ``min_tokens``: vLLM's ``MinTokensLogitsProcessor``: every stop token id (EOS included) at ``-inf``
  while fewer than ``min_tokens`` tokens were generated;
- ``logit_bias``: vLLM's ``LogitBiasLogitsProcessor``: ``logits[t] += bias``;
- penalties: vLLM ``model_executor/layers/utils.py`` ``apply_penalties`` (``get_token_bin_counts_and_mask``
  over prompt and output) with ``vllm/_custom_ops.py`` ``apply_repetition_penalties_torch``
  (``where(prompt_mask | output_mask, r, 1)``; ``logits > 0`` divided, else multiplied), which is
  transformers' ``RepetitionPenaltyLogitsProcessor`` (``torch.where(score < 0, score * penalty,
  score / penalty)`` over the ids of prompt and output); then ``logits -= frequency * counts`` and
  ``logits -= presence * (counts > 0)`` (OpenAI's parameter details).
"""

from __future__ import annotations

import numpy as np


def process_logits(
    logits,
    prompt_ids,
    output_ids,
    *,
    repetition_penalty=1.0,
    frequency_penalty=0.0,
    presence_penalty=0.0,
    logit_bias=None,
    min_tokens=0,
    stop_ids=(),
    bad_words_ids=(),
    allowed_token_ids=None,
):
    """float64 ``[vocab]``: one row of logits after the parameters above, in that order."""
    x = np.array(logits, dtype=np.float64)
    vocab = x.shape[0]
    if allowed_token_ids is not None:
        keep = np.zeros(vocab, dtype=bool)
        keep[list(allowed_token_ids)] = True
        x[~keep] = -np.inf
    for word in bad_words_ids:
        k = len(word) - 1
        if k > len(output_ids):
            continue
        if list(output_ids[len(output_ids) - k :]) == list(word[:k]) or k == 0:
            x[word[-1]] = -np.inf
    if len(output_ids) < min_tokens:
        x[list(stop_ids)] = -np.inf
    for t, b in (logit_bias or {}).items():
        x[t] += b
    counts = np.bincount(np.asarray(output_ids, dtype=np.int64), minlength=vocab)[:vocab].astype(np.float64)
    seen = counts > 0
    seen[np.asarray(prompt_ids, dtype=np.int64)] = True
    penalties = np.where(seen, repetition_penalty, 1.0)
    x = np.where(x > 0, x / penalties, x * penalties)
    x -= frequency_penalty * counts
    x -= presence_penalty * (counts > 0)
    return x
