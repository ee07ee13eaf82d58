"""top_logprobs: the chosen token first, then the k most likely by rank (ties by lower id), no repeats."""

import numpy as np

from rawpaged.engine.logprobs import top_logprobs

ROW = np.log(np.array([0.05, 0.4, 0.1, 0.4, 0.05], np.float32))


def test_chosen_first_then_the_top_k_in_order():
    assert list(top_logprobs(ROW, 2, 2).items()) == [(2, float(ROW[2])), (1, float(ROW[1])), (3, float(ROW[3]))]
    assert list(top_logprobs(ROW, 3, 2)) == [3, 1]  # the chosen one is not repeated: one fewer entry
    assert list(top_logprobs(ROW, 0, 0)) == [0] and list(top_logprobs(ROW, 4, 1)) == [4, 1]
    assert list(top_logprobs(ROW, 2, 5)) == [2, 1, 3, 0, 4]  # every token, ties by lower id
    assert all(isinstance(k, int) and isinstance(v, float) for k, v in top_logprobs(ROW, 1, 3).items())


def test_against_a_sorted_reference_on_random_rows():
    rng = np.random.default_rng(0)
    for vocab in (3, 17, 40):
        for _ in range(10):
            row = rng.normal(size=vocab).astype(np.float32)
            row[rng.integers(0, vocab, 3)] = row[0]  # some equal values
            chosen = int(rng.integers(0, vocab))
            for k in (0, 1, 2, 5, vocab, vocab + 3):
                ranked = sorted(range(vocab), key=lambda t: (-row[t], t))[: min(k, vocab)]
                want = [chosen] + [t for t in ranked if t != chosen]
                got = top_logprobs(row, chosen, k)
                assert list(got) == want and all(got[t] == float(row[t]) for t in got)


def test_many_equal_values_keep_id_order():
    row = np.zeros(64, np.float32)  # 64 ties: a sort that is not stable would reorder them
    assert list(top_logprobs(row, 63, 20)) == [63, *range(20)]
