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
