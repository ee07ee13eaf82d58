"""Which draft tokens a step keeps: speculative sampling's acceptance rule for drafts that are a single
proposed token each (n-gram and suffix proposals: the draft distribution q is one-hot).

Speculative sampling (Leviathan et al., ICML 2023, Algorithm 1; Chen et al., 2023, Algorithm 2) accepts a
draft token x at position i with probability ``min(1, p_i(x) / q_i(x))`` and, on the first rejection,
samples from the residual ``norm(max(p_i - q_i, 0))``; every accepted position is then distributed as the
target ``p_i``, and the step ends with one token from ``p_{a}`` after the ``a`` accepted drafts (the
"bonus" token when all k are accepted). Here ``p_i`` is the target's distribution after all of the
request's sampling parameters (temperature, top-k, top-p, min-p).

With a one-hot ``q_i = delta(x)``: the acceptance probability is ``p_i(x)`` and the residual is ``p_i``
restricted to ``y != x``, renormalized. Drawing ``y ~ p_i`` and accepting iff ``y == x`` realises both at
once: P(accept) = p_i(x), and a rejected position yields ``y``, distributed as p_i given ``y != x``. So
the verifier samples every position with the ordinary sampler, from the same per-position uniform a step
without speculation would have used, and keeps the longest prefix where samples and drafts agree plus the
sample after it. Greedy (temperature 0) is the special case ``y = argmax p_i``. vLLM's rejection sampler
takes the same shortcut for draft-free proposers (no draft probabilities: accept with p_target(x),
recover from p_target with x removed).
"""

from __future__ import annotations


def accepted_tokens(draft_token_ids: list, sampled_token_ids: list) -> list:
    """The tokens a sequence keeps from a verified step.

    Args:
        draft_token_ids: the k drafts that were fed after the sequence's last token.
        sampled_token_ids: the target's sample at each of the k + 1 positions (position i's sample is
            the token after draft i - 1, position 0's the token after the sequence's last token).

    Returns the accepted drafts ``draft[:a]`` (a = the length of the longest prefix on which
    ``sampled[i] == draft[i]``) followed by ``sampled[a]``: between 1 and k + 1 tokens.

    Raises:
        ValueError: ``len(sampled_token_ids) != len(draft_token_ids) + 1``.
    """
    k = len(draft_token_ids)
    if len(sampled_token_ids) != k + 1:
        raise ValueError(f"need k + 1 = {k + 1} sampled tokens for {k} drafts, got {len(sampled_token_ids)}")
    a = 0
    while a < k and sampled_token_ids[a] == draft_token_ids[a]:
        a += 1
    return list(sampled_token_ids[: a + 1])
