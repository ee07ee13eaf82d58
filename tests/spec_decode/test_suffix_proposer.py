"""Suffix drafts against a brute-force reference of the same rule: the longest suffix (<= depth) found in
a source with all its occurrences, the draft grown by the most frequent next token while its frequency
is >= min_token_prob, up to max_spec_factor x the match length; the better-scoring source wins."""

from __future__ import annotations

from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from rawpaged.spec_decode.suffix_proposer import SuffixProposer


def reference_draft(source, context, k, depth, factor, min_prob, own):
    n = len(source) - 1 if own else len(source)  # occurrences end before the newest own token
    best_m, best_hits = 0, []
    for m in range(1, min(depth, len(context)) + 1):
        suffix = context[-m:]
        hits = [i for i in range(m - 1, n) if source[i - m + 1 : i + 1] == suffix]
        if not hits:
            break
        best_m, best_hits = m, hits
    if not best_hits:
        return [], 0.0
    hits, draft, score = best_hits, [], 0.0
    while len(draft) < min(k, int(factor * best_m)):
        hits = [i for i in hits if i + 1 < len(source)]
        nxt = [source[i + 1] for i in hits if source[i + 1] >= 0]
        if not nxt:
            break
        counts = Counter(nxt)
        token = min(counts, key=lambda t: (-counts[t], t))  # most frequent, smallest id on a tie
        prob = counts[token] / len(hits)
        if prob < min_prob:
            break
        draft.append(token)
        score += prob
        hits = [i + 1 for i in hits if source[i + 1] == token]
    return draft, score


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.integers(0, 3), min_size=1, max_size=30),
    st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=10), max_size=3),
    st.integers(1, 6),
    st.integers(1, 8),
    st.sampled_from([0.5, 1.0, 2.0]),
    st.sampled_from([0.0, 0.3, 0.6]),
)
def test_matches_the_brute_force_reference(tokens, finished, k, depth, factor, min_prob):
    p = SuffixProposer(max_tree_depth=depth, max_spec_factor=factor, min_token_prob=min_prob, max_cached_requests=2)
    for out in finished:
        p.add_finished(out)
    corpus = [t for out in finished[-2:] for t in (*out, -1)]
    context = tokens[-depth:]
    own = reference_draft(tokens, context, k, depth, factor, min_prob, True)
    other = reference_draft(corpus, context, k, depth, factor, min_prob, False)
    want = other[0] if other[1] > own[1] else own[0]
    if not (own[1] > 0 or other[1] > 0):
        want = []
    assert p.propose(tokens, k) == want


def test_a_frequent_long_match_earns_a_long_draft_and_an_ambiguous_one_none():
    p = SuffixProposer(max_spec_factor=1.0, min_token_prob=0.5)
    for _ in range(3):
        p.add_finished([5, 6, 7, 8, 9, 10])
    assert p.propose([1, 5, 6, 7], 8) == [8, 9, 10]  # match of 3: up to 3 tokens, then the output ends
    assert p.propose([1, 7], 8) == [8]  # match of 1: one token
    q = SuffixProposer(min_token_prob=0.5)
    for nxt in (1, 2, 3):
        q.add_finished([4, nxt])
    assert q.propose([4], 3) == []  # three continuations at 1/3 each


def test_the_own_tokens_count_but_not_the_newest_as_its_own_match():
    p = SuffixProposer(max_cached_requests=0)
    assert p.propose([1, 2, 3, 1, 2], 2) == [3, 1]
    assert p.propose([1, 2, 3], 2) == []
