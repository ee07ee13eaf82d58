"""The CPU backend's token selection: structured outputs' bitmask on the logits (``apply_token_bitmask``),
the sampling parameters' sparse logits edits (``apply_logits_edits``: penalties, logit bias, banned tokens),
then the sampler: ``rawpaged.testing.reference_sampler.sample``'s semantics (temperature, top-k, softmax,
top-p, min-p, then an inverse-CDF draw in token-id order) compiled with Numba, one sample per thread task.

The NumPy reference sorts the whole vocabulary for top-p (a stable argsort of 49k float64 values: about
6 ms per row on this project's 2-core host, 0.37 s per step at batch 64). Here nothing but a handful of
tokens is sorted. The bits of a non-negative float64, read as an int64, are ordered as its values, so a
probability's exponent and leading mantissa bits are a bucket key in descending-probability order. One
pass sums the probability mass per bucket (8 per octave); the running sum over buckets from the top
finds the bucket where the nucleus ends, a second pass does the same with the next 10 mantissa bits
inside it, and only the tokens of that sub-bucket are sorted (stably, by descending probability) to find
the last token of the nucleus. Every token of a higher bucket has a strictly larger probability, so the
nucleus is the reference's: every token with ``p > p_cut``, and those with ``p == p_cut`` up to the cut's
token id (the reference's stable order). Bucket sums add in another order than the reference's running
sum; where a running sum comes within 1e-9 of ``top_p`` (rounding could move the cut), the row takes the
exact path instead: the candidates with ``p`` above a threshold, all sorted, summed in the reference's
order.

The softmax is computed as the reference's code writes it (float64 logits / temperature, minus the row's
max, ``exp``, divided by the sum), with a vectorized ``exp`` (``intrinsics.exp_f64``: within 1 ulp of
NumPy's; 0 below ``exp(-708)``, where NumPy gives subnormals) and a sequential sum rather than NumPy's
pairwise; later sums are sequential too, so draws agree with the reference except where a uniform falls
within rounding of a token's CDF boundary.
"""

from __future__ import annotations

import numba as nb
import numpy as np

from rawpaged.kernels.cpu.intrinsics import exp_f64
from rawpaged.kernels.cpu.jit import jit_serial_and_parallel

_JIT = dict(cache=True, nogil=True)  # no fastmath: sums and comparisons as written
#: the exact path's candidate threshold shrinks by this factor per pass
_THRESHOLD_STEP = 1.0 / 16.0
#: level 1 buckets: a float64's bits shifted right by this keep its exponent and 3 mantissa bits
_L1_SHIFT = 49
#: 8 buckets per octave over 48 octaves below the row's largest probability; the last bucket holds the rest
_L1_BUCKETS = 8 * 48 + 1
#: level 2 buckets: the next 10 mantissa bits
_L2_SHIFT = 39
_L2_BUCKETS = 1024
#: a running sum this close to top_p sends the row to the exact path
_CUT_TOLERANCE = 1e-9


@nb.njit(**_JIT)
def _sum4(p):
    """Sum of float64 ``p`` in four interleaved running sums (independent chains: no float reduction
    vectorizes without reassociation, and one running sum waits on each add)."""
    n = p.shape[0]
    s0 = s1 = s2 = s3 = 0.0
    i = 0
    while i + 4 <= n:
        s0 += p[i]
        s1 += p[i + 1]
        s2 += p[i + 2]
        s3 += p[i + 3]
        i += 4
    while i < n:
        s0 += p[i]
        i += 1
    return (s0 + s1) + (s2 + s3)


@nb.njit(**_JIT)
def _softmax_row(logits_row, temperature, top_k, p):
    """``p`` (float64 ``[vocab]``) = softmax(logits_row / temperature) after top-k (values below the k-th
    largest set to -inf, ties kept), as the reference computes it. Returns the index of the row's first
    maximum (its probability is ``p``'s largest). Each loop does one thing, so that the elementwise ones
    vectorize."""
    vocab = p.shape[0]
    for i in range(vocab):
        p[i] = np.float64(logits_row[i]) / temperature
    m0 = m1 = m2 = m3 = -np.inf
    i = 0
    while i + 4 <= vocab:
        m0 = max(m0, p[i])
        m1 = max(m1, p[i + 1])
        m2 = max(m2, p[i + 2])
        m3 = max(m3, p[i + 3])
        i += 4
    while i < vocab:
        m0 = max(m0, p[i])
        i += 1
    mx = max(max(m0, m1), max(m2, m3))
    imax = 0
    while imax < vocab - 1 and p[imax] != mx:
        imax += 1
    if 0 < top_k < vocab:
        kth = np.partition(p.copy(), vocab - top_k)[vocab - top_k]
        for i in range(vocab):
            if not p[i] >= kth:
                p[i] = -np.inf
    for i in range(vocab):
        p[i] = exp_f64(p[i] - mx)
    total = _sum4(p)
    for i in range(vocab):
        p[i] /= total
    return imax


@nb.njit(**_JIT)
def _nucleus_cut_exact(p, top_p, pmax):
    """The nucleus's last token ``(p_cut, id_cut)`` by the exact path: ``t`` from the largest probability
    down by ``_THRESHOLD_STEP`` until the tokens with ``p >= t`` hold ``top_p``; those candidates sorted
    stably by descending probability and summed in that order (the reference's order)."""
    vocab = p.shape[0]
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
    last = cand[order[n - 1]]
    for j in range(n):
        cum += p[cand[order[j]]]
        if cum >= top_p:
            last = cand[order[j]]
            break
    return p[last], last


@nb.njit(**_JIT)
def _crossing(mass, cum, top_p):
    """The first bucket at which ``cum`` plus the running sum of ``mass`` reaches ``top_p`` (-1 if none), and
    the sum before it."""
    for b in range(mass.shape[0]):
        if cum + mass[b] >= top_p:
            return b, cum
        cum += mass[b]
    return -1, cum


@nb.njit(**_JIT)
def _nucleus_cut(p, top_p, imax):
    """The nucleus's last token ``(p_cut, id_cut)`` in the reference's stable descending order, found by
    two levels of buckets (module doc); the exact path where a running sum is within rounding of
    ``top_p``. ``imax``: the index of ``p``'s largest value."""
    bits = p.view(np.int64)
    vocab = p.shape[0]
    kmax = bits[imax] >> _L1_SHIFT
    # four partial histograms, token i into i % 4: consecutive tokens in one bucket would otherwise wait
    # on each other's add through memory
    part = np.zeros((4, _L1_BUCKETS), dtype=np.float64)
    i = 0
    while i + 4 <= vocab:
        for lane in range(4):
            part[lane, min(kmax - (bits[i + lane] >> _L1_SHIFT), _L1_BUCKETS - 1)] += p[i + lane]
        i += 4
    while i < vocab:
        part[0, min(kmax - (bits[i] >> _L1_SHIFT), _L1_BUCKETS - 1)] += p[i]
        i += 1
    mass1 = (part[0] + part[1]) + (part[2] + part[3])
    b1, cum = _crossing(mass1[:-1], 0.0, top_p)  # a cut in the last bucket (the tail) takes the exact path
    if b1 < 0:
        return _nucleus_cut_exact(p, top_p, p[imax])
    k1 = kmax - b1
    mass2 = np.zeros(_L2_BUCKETS, dtype=np.float64)
    count2 = np.zeros(_L2_BUCKETS, dtype=np.int64)
    top2 = (k1 << (_L1_SHIFT - _L2_SHIFT)) | (_L2_BUCKETS - 1)
    for i in range(vocab):
        if (bits[i] >> _L1_SHIFT) == k1:
            s = top2 - (bits[i] >> _L2_SHIFT)
            mass2[s] += p[i]
            count2[s] += 1
    b2, cum = _crossing(mass2, cum, top_p)
    if b2 < 0:
        return _nucleus_cut_exact(p, top_p, p[imax])
    k2 = top2 - b2
    n = count2[b2]
    cand = np.empty(n, dtype=np.int64)
    neg = np.empty(n, dtype=np.float64)
    j = 0
    for i in range(vocab):
        if (bits[i] >> _L2_SHIFT) == k2:
            cand[j] = i
            neg[j] = -p[i]
            j += 1
    order = np.argsort(neg, kind="mergesort")
    for j in range(n):
        before = cum
        cum += p[cand[order[j]]]
        if cum >= top_p:
            if abs(cum - top_p) <= _CUT_TOLERANCE or abs(before - top_p) <= _CUT_TOLERANCE:
                break
            last = cand[order[j]]
            return p[last], last
    return _nucleus_cut_exact(p, top_p, p[imax])


@nb.njit(**_JIT)
def _filter_and_draw(p, imax, top_p, min_p, uniform):
    """Top-p and min-p on one row of probabilities ``p`` (float64, sums to 1; changed in place; ``imax``
    the index of its largest value), then the inverse-CDF draw of ``uniform``: the first token whose
    running sum exceeds ``uniform`` times the total."""
    vocab = p.shape[0]
    pmax = p[imax]
    if top_p < 1.0:
        p_cut, id_cut = _nucleus_cut(p, top_p, imax)
        for i in range(vocab):
            if not (p[i] > p_cut or (p[i] == p_cut and i <= id_cut)):
                p[i] = 0.0
        total = _sum4(p)
        for i in range(vocab):
            p[i] /= total
        pmax = p[imax]
    if min_p > 0.0:
        floor = min_p * pmax
        for i in range(vocab):
            if not p[i] >= floor:
                p[i] = 0.0
        total = _sum4(p)
        for i in range(vocab):
            p[i] /= total
    target = uniform * _sum4(p)
    cum = 0.0
    for i in range(vocab):
        cum += p[i]
        if cum > target:
            return i
    return vocab - 1


def _draw_kernel(logits, rows, temperature, top_k, top_p, min_p, uniforms, scratch, out):
    for j in nb.prange(rows.shape[0]):
        p = scratch[j]
        imax = _softmax_row(logits[rows[j]], temperature[j], top_k[j], p)
        out[j] = _filter_and_draw(p, imax, top_p[j], min_p[j], uniforms[j])


_draw_serial, _draw_parallel = jit_serial_and_parallel(_draw_kernel, **_JIT)


def sample(logits, sample_rows, temperature, top_k, top_p, min_p, uniforms):
    """Token ids drawn from rows of ``logits``, as ``rawpaged.testing.reference_sampler.sample`` draws them (see the
    module doc for where they may differ).

    logits: float32 ``[num_rows, vocab]``; sample_rows (int), temperature (``<= 0``: greedy), top_k,
    top_p, min_p, uniforms (in [0, 1)): ``[num_samples]`` each. Returns int64 ``[num_samples]``.

    Greedy samples take the first maximum (NumPy); the others run in one Numba kernel, a sample per thread
    task: temperature, top-k and softmax into a float64 row, then top-p, min-p and the draw.
    """
    rows = np.asarray(sample_rows, dtype=np.int64)
    temperature = np.asarray(temperature, dtype=np.float64)
    out = np.empty(rows.shape[0], dtype=np.int64)
    greedy = ~(temperature > 0)
    if greedy.any():  # every row's argmax in place: cheaper than gathering the greedy rows first
        out[greedy] = np.argmax(logits, axis=1)[rows[greedy]]
    hot = np.flatnonzero(~greedy)
    if hot.size == 0:
        return out
    logits = np.ascontiguousarray(logits)
    drawn = np.empty(hot.size, dtype=np.int64)
    kernel = _draw_parallel if hot.size > 1 else _draw_serial
    kernel(
        logits,
        rows[hot],
        temperature[hot],
        np.asarray(top_k, dtype=np.int64)[hot],
        np.asarray(top_p, dtype=np.float64)[hot],
        np.asarray(min_p, dtype=np.float64)[hot],
        np.asarray(uniforms, dtype=np.float64)[hot],
        np.empty((hot.size, logits.shape[1]), dtype=np.float64),
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
