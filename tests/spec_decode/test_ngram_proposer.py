"""Prompt-lookup drafts against a brute-force reference: the longest suffix of min..max tokens found
earlier, its latest occurrence, continued as an overlapping copy."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rawpaged.spec_decode.ngram_proposer import NgramProposer


def reference(tokens: list, min_n: int, max_n: int, k: int) -> list:
    for n in range(max_n, min_n - 1, -1):
        if n >= len(tokens):
            continue
        suffix = tokens[-n:]
        starts = [i for i in range(len(tokens) - n) if tokens[i : i + n] == suffix]
        if starts:
            out = list(tokens)
            pos = starts[-1] + n
            for _ in range(k):
                out.append(out[pos])
                pos += 1
            return out[len(tokens) :]
    return []


def test_the_longest_match_wins_and_its_latest_occurrence_is_copied():
    p = NgramProposer(1, 3)
    # suffix [2, 3] occurs at 1 and 6; [1, 2, 3] only at 0 -> the 3-gram wins: tokens after index 3
    assert p.propose([1, 2, 3, 7, 8, 4, 2, 3, 9, 1, 2, 3], 3) == [7, 8, 4]
    # only the 1-gram [5] matches; its latest occurrence is at 3
    assert p.propose([5, 1, 1, 5, 6, 2, 5], 2) == [6, 2]


def test_a_match_just_behind_the_suffix_continues_the_pattern():
    assert NgramProposer(2, 4).propose([9, 4, 5, 4, 5, 4, 5], 5) == [4, 5, 4, 5, 4]


def test_no_match_no_drafts():
    p = NgramProposer(2, 4)
    assert p.propose([1, 2, 3, 4, 5], 4) == []
    assert p.propose([1], 4) == []
    assert p.propose([1, 2, 1, 2], 0) == []


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        NgramProposer(3, 2)
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        NgramProposer(0, 2)


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.integers(0, 4), min_size=0, max_size=40),
    st.integers(1, 3),
    st.integers(0, 3),
    st.integers(0, 6),
)
def test_matches_the_brute_force_reference(tokens, min_n, extra, k):
    max_n = min_n + extra
    assert NgramProposer(min_n, max_n).propose(tokens, k) == reference(tokens, min_n, max_n, k)


def test_only_the_last_max_search_tokens_are_searched():
    tokens = [1, 2, 3, 4] + [9] * 20 + [1, 2]
    assert NgramProposer(2, 2).propose(tokens, 2) == [3, 4]
    assert NgramProposer(2, 2, max_search_tokens=10).propose(tokens, 2) == []
