"""The acceptance rule for one-token drafts: the longest agreeing prefix plus the next sample; and, in
distribution, sampling every position and keeping what agrees gives exactly the target's distribution,
while a plausible wrong rule (accept the draft with probability p(x), else resample from p without the
residual) is caught by the same test."""

from __future__ import annotations

import numpy as np
import pytest

from rawpaged.spec_decode.rejection_sampler import accepted_tokens


def test_keeps_the_agreeing_prefix_and_the_sample_after_it():
    assert accepted_tokens([5, 6, 7], [5, 6, 7, 8]) == [5, 6, 7, 8]  # all accepted + bonus
    assert accepted_tokens([5, 6, 7], [5, 9, 7, 8]) == [5, 9]  # second rejected: its sample replaces it
    assert accepted_tokens([5, 6, 7], [4, 6, 7, 8]) == [4]
    assert accepted_tokens([], [3]) == [3]


def test_needs_one_sample_more_than_drafts():
    with pytest.raises(ValueError, match="k \\+ 1"):
        accepted_tokens([1, 2], [1, 2])


def chi_square_homogeneity(a: np.ndarray, b: np.ndarray) -> tuple:
    """(statistic, degrees of freedom) of a two-sample chi-square test on count vectors ``a``, ``b``."""
    keep = (a + b) > 0
    a, b = a[keep].astype(np.float64), b[keep].astype(np.float64)
    total = a + b
    ea, eb = total * a.sum() / total.sum(), total * b.sum() / total.sum()
    return float(((a - ea) ** 2 / ea + (b - eb) ** 2 / eb).sum()), int(keep.sum()) - 1


def chi_square_critical(df: int, z: float = 3.719) -> float:
    """Upper quantile of chi-square(df) by Wilson-Hilferty (z = 3.719: one-sided 1e-4)."""
    c = 2.0 / (9.0 * df)
    return df * (1.0 - c + z * np.sqrt(c)) ** 3


def inverse_cdf(p: np.ndarray, u: np.ndarray) -> np.ndarray:
    return np.minimum(np.searchsorted(np.cumsum(p), u, side="right"), len(p) - 1)


def two_position_samples(rule, p0, p1, draft, n, rng):
    """Tokens of positions 0 and 1 (joint, encoded t0 * V + t1) when ``rule`` verifies a fixed one-token
    draft at position 0; a position the step does not produce comes from a plain step after it."""
    V = len(p0)
    out = np.empty(n, dtype=np.int64)
    for i in range(n):
        tokens = rule(p0, p1, draft, rng)
        if len(tokens) == 1:
            tokens.append(int(inverse_cdf(p1, rng.random(1))[0]))
        out[i] = tokens[0] * V + tokens[1]
    return out


def sample_and_match(p0, p1, draft, rng):
    """The verifier's rule: a sample at every position from its own uniform, ``accepted_tokens`` keeps."""
    sampled = [int(inverse_cdf(p, rng.random(1))[0]) for p in (p0, p1)]
    return accepted_tokens([draft], sampled)


def resample_without_residual(p0, p1, draft, rng):
    """Wrong: accept with probability p(x), but on rejection resample from p itself (x not removed)."""
    if rng.random() < p0[draft]:
        return [draft, int(inverse_cdf(p1, rng.random(1))[0])]
    return [int(inverse_cdf(p0, rng.random(1))[0])]


def no_speculation(p0, p1, draft, rng):
    return [int(inverse_cdf(p0, rng.random(1))[0])]


@pytest.mark.parametrize("rule, same", [(sample_and_match, True), (resample_without_residual, False)])
def test_the_rule_keeps_the_target_distribution_and_a_wrong_one_is_caught(rule, same):
    rng = np.random.default_rng(7)
    V, n = 6, 20000
    p0 = rng.dirichlet(np.ones(V))
    p1 = rng.dirichlet(np.ones(V))
    draft = int(np.argmax(p0))  # a likely draft, as a proposer would make
    a = np.bincount(two_position_samples(rule, p0, p1, draft, n, rng), minlength=V * V)
    b = np.bincount(two_position_samples(no_speculation, p0, p1, draft, n, rng), minlength=V * V)
    stat, df = chi_square_homogeneity(a, b)
    assert bool(stat < chi_square_critical(df)) == same, (stat, chi_square_critical(df))
