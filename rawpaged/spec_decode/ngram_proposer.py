"""Prompt-lookup drafts (``method: "ngram"``): the tokens that followed an earlier occurrence of the
sequence's last n tokens, in its prompt or its output so far.

The idea is prompt lookup decoding (Saxena, 2023) and vLLM's ``NgramProposer``: for n from
``prompt_lookup_max`` down to ``prompt_lookup_min``, find the suffix of n tokens earlier in the sequence;
the first n with a match proposes the (up to k) tokens after it. Where vLLM takes the earliest occurrence
of the longest match, this takes the latest: in edits, summaries with quotes and repeated turns, the most
recent copy of a phrase is the one the output is following. A match that ends near the sequence's end
continues as an overlapping copy (``_copy_forward``), so a repeating pattern still gets k drafts.
"""

from __future__ import annotations

import numpy as np


class NgramProposer:
    """Args:
    prompt_lookup_min, prompt_lookup_max: the shortest and longest suffix matched (1 <= min <= max).
    max_search_tokens: only the last this many tokens are searched (bounds the cost per step on
        very long sequences).
    """

    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int, max_search_tokens: int = 8192):
        if not 1 <= prompt_lookup_min <= prompt_lookup_max:
            raise ValueError(
                f"need 1 <= prompt_lookup_min <= prompt_lookup_max, got {prompt_lookup_min}, {prompt_lookup_max}"
            )
        self.min_n = prompt_lookup_min
        self.max_n = prompt_lookup_max
        self.max_search_tokens = max_search_tokens

    def propose(self, token_ids, k: int) -> list:
        """Up to ``k`` draft token ids to follow ``token_ids`` (a sequence of ints; its last token is the
        newest), or ``[]`` when no suffix of ``min_n..max_n`` tokens occurs earlier (or ``k < 1``).

        Cost: one vectorized comparison pass per n over the searched window (O(n * window))."""
        if k < 1:
            return []
        tokens = np.asarray(token_ids[-self.max_search_tokens :], dtype=np.int64)
        total = len(tokens)
        for n in range(min(self.max_n, total - 1), self.min_n - 1, -1):
            suffix = tokens[total - n :]
            # Candidate starts i with tokens[i:i+n] == suffix and at least one token after the match
            # inside the sequence (i + n < total), i.e. i <= total - n - 1.
            num_starts = total - n
            match = tokens[:num_starts] == suffix[0]
            for j in range(1, n):
                match &= tokens[j : num_starts + j] == suffix[j]
            hits = np.flatnonzero(match)
            if hits.size:
                return _copy_forward(tokens.tolist(), int(hits[-1]) + n, k)
        return []


def _copy_forward(tokens: list, start: int, k: int) -> list:
    """``k`` tokens copied from ``start`` on, where the copy may run on into its own output (an
    overlapping copy, as in LZ77): a match just behind the suffix continues a repeating pattern for all
    ``k`` tokens instead of stopping at the sequence's end."""
    ext = list(tokens)
    for j in range(k):
        ext.append(ext[start + j])
    return ext[len(tokens) :]
