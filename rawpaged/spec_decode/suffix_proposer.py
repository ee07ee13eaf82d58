"""Suffix drafts (``method: "suffix"``): SuffixDecoding (Oliaro et al., 2024, arXiv:2411.04975; Arctic
Inference's implementation) on a single chain of draft tokens.

Two sources are searched: the sequence's own tokens (prompt and output so far) and the outputs of the
last ``max_cached_requests`` finished requests. In each, the longest suffix of the sequence (at most
``max_tree_depth`` tokens) that occurs there is found, with all its occurrences; the draft then grows
one token at a time by the most frequent next token over the occurrences still matching, while that
token's frequency among them is at least ``min_token_prob``, and for at most ``max_spec_factor`` x the
match length tokens (the paper's adaptive speculation length: a long, frequent match earns a long
draft, a short or ambiguous one a short draft or none). The source whose draft scores higher (the sum of
its tokens' frequencies, the paper's score) is proposed.

Where the paper walks suffix trees, this keeps the tokens in arrays and narrows the occurrence set with
vectorized comparisons: finding the match costs O(source length + occurrences x match length), with no
index to build or update as tokens arrive.
"""

from __future__ import annotations

from collections import deque

import numpy as np


class SuffixProposer:
    """Args:
    max_tree_depth: the longest suffix matched (tokens).
    max_spec_factor: a draft has at most this many tokens per matched token.
    min_token_prob: a draft stops at a token whose frequency among the matching occurrences is lower.
    max_cached_requests: finished requests whose outputs are searched (0: only the sequence's own).
    """

    def __init__(
        self,
        max_tree_depth: int = 32,
        max_spec_factor: float = 1.0,
        min_token_prob: float = 0.1,
        max_cached_requests: int = 100,
        max_search_tokens: int = 8192,
    ):
        if max_tree_depth < 1 or max_spec_factor <= 0 or not 0 <= min_token_prob <= 1 or max_cached_requests < 0:
            raise ValueError(
                "need max_tree_depth >= 1, max_spec_factor > 0, 0 <= min_token_prob <= 1, max_cached_requests >= 0"
            )
        self.max_tree_depth = max_tree_depth
        self.max_spec_factor = max_spec_factor
        self.min_token_prob = min_token_prob
        self.max_search_tokens = max_search_tokens  # the sequence's own tokens searched: its last this many
        self._cached: deque = deque(maxlen=max_cached_requests)
        self._corpus = np.zeros(0, dtype=np.int64)  # cached outputs, each followed by a -1 separator

    def add_finished(self, output_token_ids) -> None:
        """Remember a finished request's output for later requests (the oldest is forgotten past
        ``max_cached_requests``)."""
        if self._cached.maxlen == 0 or not len(output_token_ids):
            return
        self._cached.append(np.append(np.asarray(output_token_ids, dtype=np.int64), -1))
        self._corpus = np.concatenate(self._cached)

    def propose(self, token_ids, k: int) -> list:
        """Up to ``k`` draft tokens to follow ``token_ids`` (ints, newest last); ``[]`` when nothing matches
        well enough."""
        if k < 1 or not len(token_ids):
            return []
        own = np.asarray(token_ids[-self.max_search_tokens :], dtype=np.int64)
        context = own[-self.max_tree_depth :]
        best, best_score = [], 0.0
        for source, exclude_tail in ((own, True), (self._corpus, False)):
            draft, score = self._draft(source, context, k, exclude_tail)
            if score > best_score:
                best, best_score = draft, score
        return best

    def _draft(self, source: np.ndarray, context: np.ndarray, k: int, exclude_tail: bool) -> tuple:
        """``(draft, score)`` from one source; ``exclude_tail``: ``source`` ends with ``context`` itself."""
        # hits: indices of the last token of each occurrence of the suffix matched so far (in the own
        # tokens, not the newest token itself).
        end = len(source) - 1 if exclude_tail else len(source)
        hits = np.flatnonzero(source[:end] == context[-1])
        m = 1
        while m < len(context) and hits.size:
            keep = hits[hits >= m]
            keep = keep[source[keep - m] == context[-1 - m]]
            if not keep.size:
                break
            hits, m = keep, m + 1
        if not hits.size:
            return [], 0.0
        limit = min(k, int(self.max_spec_factor * m))
        draft, score = [], 0.0
        while len(draft) < limit:
            hits = hits[hits + 1 < len(source)]
            nxt = source[hits + 1] if hits.size else hits
            nxt = nxt[nxt >= 0]  # a separator ends an output
            if not nxt.size:
                break
            values, counts = np.unique(nxt, return_counts=True)
            top = int(np.argmax(counts))
            prob = counts[top] / len(hits)
            if prob < self.min_token_prob:
                break
            token = int(values[top])
            draft.append(token)
            score += prob
            hits = hits[source[hits + 1] == token] + 1
        return draft, score
