"""The CPU backend's token selection: structured outputs' bitmask on the logits (``apply_token_bitmask``),
the sampling parameters' sparse logits edits (``apply_logits_edits``: penalties, logit bias, banned tokens),
then the sampler: ``rawpaged.testing.reference_sampler.sample``'s semantics (temperature, top-k, top-p,
min-p, then an inverse-CDF draw in token-id order) compiled with Numba, one sample per task.

The NumPy reference sorts the whole vocabulary for top-p (a stable argsort of 49k float64 values: about
6 ms per row on this project's 2-core host, 0.37 s per step at batch 64). Here only the candidates are
sorted: the tokens whose probability is at least a threshold ``t`` whose set already holds ``top_p`` of
the mass. Every token of the nucleus has a probability of at least ``t`` (the nucleus is the shortest
descending prefix reaching ``top_p``), so the candidates, sorted stably by descending probability, are a
prefix of the reference's order and give the same cut. ``t`` starts at the largest probability and is
divided by 16 until its set holds ``top_p`` (one pass over the row each; a peaked distribution needs one
or two). The softmax is the reference's own NumPy code; later sums run in float64 in the reference's
orders, except the renormalizations after top-p and min-p (sequential here, pairwise in NumPy), so draws
agree except where a uniform falls within rounding of a token's CDF boundary.
"""

from __future__ import annotations

import numba as nb
import numpy as np

_JIT = dict(cache=True, nogil=True)  # no fastmath: sums and comparisons as written
#: the candidate threshold shrinks by this factor per pass
_THRESHOLD_STEP = 1.0 / 16.0


@nb.njit(**_JIT)
def _filter_and_draw(p, top_p, min_p, uniform):
    """Top-p and min-p on one row of probabilities ``p`` (float64, sums to 1; changed in place), then
    the inverse-CDF draw of ``uniform``: the first token whose running sum exceeds ``uniform`` times
    the total."""
    vocab = p.shape[0]
    pmax = 0.0
    for i in range(vocab):
        pmax = max(pmax, p[i])
    if top_p < 1.0:
        t = pmax
        while True:
            mass = 0.0
            for i in range(vocab):
                if p[i] >= t:
                    mass += p[i]
            if mass >= top_p or t == 0.0:
                break
            t *= _THRESHOLD_STEP
        n = 0
        for i in range(vocab):
            if p[i] >= t:
                n += 1
        cand = np.empty(n, dtype=np.int64)
        neg = np.empty(n, dtype=np.float64)
        j = 0
        for i in range(vocab):
            if p[i] >= t:
                cand[j] = i
                neg[j] = -p[i]
                j += 1
        order = np.argsort(neg, kind="mergesort")  # stable: equal probabilities keep token-id order
        cum = 0.0
        cut = n
        for j in range(n):
            cum += p[cand[order[j]]]
            if cum >= top_p:
                cut = j + 1
                break
        keep = np.zeros(vocab, dtype=np.bool_)
        for j in range(cut):
            keep[cand[order[j]]] = True
        total = 0.0
        for i in range(vocab):
            if not keep[i]:
                p[i] = 0.0
            total += p[i]
        pmax = 0.0
        for i in range(vocab):
            p[i] /= total
            pmax = max(pmax, p[i])
    if min_p > 0.0:
        floor = min_p * pmax
        total = 0.0
        for i in range(vocab):
            if not p[i] >= floor:
                p[i] = 0.0
            total += p[i]
        for i in range(vocab):
            p[i] /= total
    cdf_total = 0.0
    for i in range(vocab):
        cdf_total += p[i]
    target = uniform * cdf_total
    cum = 0.0
    for i in range(vocab):
        cum += p[i]
        if cum > target:
            return i
    return vocab - 1


def _draw_kernel(probs, top_p, min_p, uniforms, out):
    for j in nb.prange(probs.shape[0]):
        out[j] = _filter_and_draw(probs[j], top_p[j], min_p[j], uniforms[j])


_draw_serial = nb.njit(**_JIT)(_draw_kernel)
_draw_parallel = nb.njit(parallel=True, **_JIT)(_draw_kernel)


def sample(logits, sample_rows, temperature, top_k, top_p, min_p, uniforms):
    """Token ids drawn from rows of ``logits``, as ``rawpaged.testing.reference_sampler.sample`` draws them (see the
    module doc for where they may differ).

    logits: float32 ``[num_rows, vocab]``; sample_rows (int), temperature (``<= 0``: greedy), top_k,
    top_p, min_p, uniforms (in [0, 1)): ``[num_samples]`` each. Returns int64 ``[num_samples]``.

    Greedy samples take the first maximum; the others' temperature, top-k and softmax run in NumPy over
    all of them at once (its vectorized ``exp``), their top-p, min-p and draw in Numba, one sample per
    thread task.
    """
    rows = np.asarray(sample_rows, dtype=np.int64)
    temperature = np.asarray(temperature, dtype=np.float64)
    out = np.empty(rows.shape[0], dtype=np.int64)
    greedy = ~(temperature > 0)
    if greedy.any():
        out[greedy] = np.argmax(logits[rows[greedy]], axis=1)
    hot = np.flatnonzero(~greedy)
    if hot.size == 0:
        return out
    x = np.asarray(logits[rows[hot]], dtype=np.float64) / temperature[hot, None]
    vocab = x.shape[1]
    top_k = np.asarray(top_k, dtype=np.int64)[hot]
    for j in np.flatnonzero((top_k > 0) & (top_k < vocab)):
        kth = np.partition(x[j], vocab - top_k[j])[vocab - top_k[j]]
        x[j] = np.where(x[j] >= kth, x[j], -np.inf)
    x -= x.max(axis=1, keepdims=True)
    p = np.exp(x, out=x)
    p /= p.sum(axis=1, keepdims=True)
    drawn = np.empty(hot.size, dtype=np.int64)
    kernel = _draw_parallel if hot.size > 1 else _draw_serial
    kernel(
        p,
        np.asarray(top_p, dtype=np.float64)[hot],
        np.asarray(min_p, dtype=np.float64)[hot],
        np.asarray(uniforms, dtype=np.float64)[hot],
        drawn,
    )
    out[hot] = drawn
    return out


# no fastmath: -inf and the float32 order of operations as written; NumPy's error model: a division never
# raises inside a batch (SamplingParams keeps the repetition penalty a positive finite float32 anyway)
@nb.njit(cache=True, nogil=True, error_model="numpy")
def _apply_logits_edits(
    logits, rows, add_start, add_ids, add_values, rep_start, rep_ids, repetition, count_start, count_ids, counts,
    frequency, presence,
):  # fmt: skip
    for i in range(rows.shape[0]):
        row = logits[rows[i]]
        for e in range(add_start[i], add_start[i + 1]):
            row[add_ids[e]] += add_values[e]
        r = repetition[i]
        for e in range(rep_start[i], rep_start[i + 1]):
            x = row[rep_ids[e]]
            row[rep_ids[e]] = x / r if x > 0 else x * r
        f = frequency[i]
        p = presence[i]
        for e in range(count_start[i], count_start[i + 1]):
            t = count_ids[e]
            row[t] = (row[t] - f * counts[e]) - p


def apply_logits_edits(logits, edits):
    """Sampling parameters' logits edits (``rawpaged.model_executor.logits_processors.LogitsEdits``), in
    place: per row, ``x_t += v`` for its additive entries (``-inf`` forbids), then the repetition penalty
    (``x / r`` if ``x > 0`` else ``x * r``) on its repetition entries, then ``x_t -= f * c_t`` and
    ``x_t -= p`` on its count entries, in float32.

    Args:
        logits: float32 ``[num_rows, vocab]``, modified.
        edits: a ``LogitsEdits`` whose rows index ``logits`` and whose token ids are ``< vocab``.
    Raises:
        ValueError on a dtype, row or token id that does not fit.
    """
    if logits.dtype != np.float32 or logits.ndim != 2:
        raise ValueError(f"logits must be float32 [rows, vocab], got {logits.dtype} {logits.shape}")
    rows = np.asarray(edits.rows, dtype=np.int64)
    if rows.size and (rows.min() < 0 or rows.max() >= logits.shape[0]):
        raise ValueError(f"edits.rows must index the {logits.shape[0]} logits rows")
    for name in ("add_ids", "rep_ids", "count_ids"):
        ids = getattr(edits, name)
        if ids.size and (ids.min() < 0 or ids.max() >= logits.shape[1]):
            raise ValueError(f"edits.{name} must be token ids below the vocabulary size {logits.shape[1]}")
    _apply_logits_edits(
        logits,
        rows,
        edits.add_start,
        edits.add_ids,
        edits.add_values,
        edits.rep_start,
        edits.rep_ids,
        edits.repetition,
        edits.count_start,
        edits.count_ids,
        edits.counts,
        edits.frequency,
        edits.presence,
    )


@nb.njit(cache=True, nogil=True)  # no fastmath: it writes -inf
def _apply_token_bitmask(logits, bitmask, rows):
    vocab = logits.shape[1]
    covered = min(vocab, bitmask.shape[1] * 32)
    for i in range(rows.shape[0]):
        row = logits[rows[i]]
        words = bitmask[i]
        for v in range(covered):
            if (words[v >> 5] >> (v & 31)) & 1 == 0:
                row[v] = -np.inf
        for v in range(covered, vocab):
            row[v] = -np.inf


def apply_token_bitmask(logits, bitmask, rows):
    """Structured outputs: set the logits of the tokens a bitmask forbids to ``-inf``, in place.

    Args:
        logits: float32 ``[num_rows, vocab]``, modified.
        bitmask: int32 ``[n, words]``; token ``t`` is allowed in mask ``i`` when bit ``t % 32`` of word
            ``t // 32`` is set (the packed layout of vLLM, xgrammar and llguidance); tokens past
            ``32 * words`` are forbidden.
        rows: int ``[n]``, the logits row each mask applies to (rows without a mask are untouched).
    Raises:
        ValueError on shapes or dtypes that do not fit.
    """
    rows = np.asarray(rows, dtype=np.int64)
    if logits.dtype != np.float32 or logits.ndim != 2:
        raise ValueError(f"logits must be float32 [rows, vocab], got {logits.dtype} {logits.shape}")
    if bitmask.dtype != np.int32 or bitmask.ndim != 2 or bitmask.shape[0] != rows.shape[0]:
        raise ValueError(f"bitmask must be int32 [{rows.shape[0]}, words], got {bitmask.dtype} {bitmask.shape}")
    if rows.size and (rows.min() < 0 or rows.max() >= logits.shape[0]):
        raise ValueError(f"rows must index the {logits.shape[0]} logits rows")
    _apply_token_bitmask(logits, bitmask, rows)
