"""The pooler: a pooling sequence's vector from the final-norm hidden states of its prompt positions (vLLM's
``model_executor/layers/pooler.py``), step by step, so that a prompt prefilled in chunks pools the same
vector as one prefilled at once.

Each step adds the rows the sequence's pooling type needs from this step's positions into
``Sequence.pooling_state`` (a float64 sum ``[hidden]``): MEAN every position, CLS position 0, LAST the last
prompt position. The step that computes the last prompt position finishes the vector: MEAN divides the sum
by the prompt length; then ``dimensions`` keeps the first values (Matryoshka), then ``normalize`` divides by
the L2 norm (at least 1e-12, as ``torch.nn.functional.normalize``). A chunk that starts at position 0 starts
the sum again (a sequence preempted by recompute runs its prompt again from there).
"""

from __future__ import annotations

import numpy as np

#: the smallest L2 norm divided by (``torch.nn.functional.normalize``'s ``eps``)
NORM_EPS = 1e-12


def _rows_needed(pooling_type: str, row: int, n: int, start: int, ends: bool) -> range:
    """The step's hidden rows (from ``row``, ``n`` of them for positions ``start..start + n - 1``) that a
    sequence pooling with ``pooling_type`` adds to its sum; ``ends``: these positions reach its last."""
    if pooling_type == "MEAN":
        return range(row, row + n)
    if pooling_type == "CLS":
        return range(row, row + 1) if start == 0 else range(0)
    return range(row + n - 1, row + n) if ends else range(0)


def pool_step(backend, hidden, ordered) -> dict:
    """Pool this step's positions for the scheduled sequences that pool.

    Args:
        backend: the backend ``hidden`` lives on.
        hidden: the step's final-norm hidden states ``[num_tokens, hidden_size]`` (compute dtype).
        ordered: the step's ``(sequence, num_new_tokens)`` in token order (``StepInput.ordered``); a pooling
            sequence has ``pooling_params`` (resolved: ``pooling_type`` set), its ``num_computed_tokens``
            still the step's first position.

    Returns ``{sequence: float32 [dimensions or hidden_size]}`` for each pooling sequence whose last prompt
    position ran in this step; the others keep their partial sums in ``pooling_state``.
    """
    plan, rows, row = [], [], 0
    for seq, n in ordered:
        params = seq.pooling_params
        if params is not None:
            start = seq.num_computed_tokens
            ends = start + n == seq.num_tokens
            take = _rows_needed(params.pooling_type, row, n, start, ends)
            plan.append((seq, start, ends, len(rows), len(take)))
            rows.extend(take)
        row += n
    if not plan:
        return {}
    width = hidden.shape[1]
    host = np.zeros((0, width))
    if rows:
        host = backend.to_numpy(hidden[backend.asarray(np.array(rows, dtype=np.int64))]).astype(np.float64)
    pooled = {}
    for seq, start, ends, first, count in plan:
        if start == 0 or seq.pooling_state is None:
            seq.pooling_state = np.zeros(width)
        seq.pooling_state += host[first : first + count].sum(axis=0)
        if ends:
            pooled[seq] = finish_vector(seq.pooling_state, seq.pooling_params, seq.num_tokens)
            seq.pooling_state = None
    return pooled


def finish_vector(total: np.ndarray, params, num_tokens: int) -> np.ndarray:
    """The float32 vector of a float64 sum ``total [hidden_size]`` over a prompt of ``num_tokens`` tokens:
    MEAN divides by ``num_tokens``, then the first ``params.dimensions`` values are kept, then with
    ``params.normalize`` it is divided by its L2 norm (at least ``NORM_EPS``)."""
    vec = total / num_tokens if params.pooling_type == "MEAN" else total
    if params.dimensions is not None:
        vec = vec[: params.dimensions]
    if params.normalize:
        vec = vec / max(float(np.linalg.norm(vec)), NORM_EPS)
    return vec.astype(np.float32)
