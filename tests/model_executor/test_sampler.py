"""The CPU sampling reference (``rawpaged.testing.reference_sampler.sample``/``filtered_probs``) against definitions
written out independently: sort-based top-k/top-p/min-p sets in pure Python with exact sums, and the
inverse-CDF draw checked by stratified uniforms (the count of each token over N evenly spaced uniforms is
N * p within one).
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from rawpaged.model_executor.sampler import draw_uniform, log_softmax, sampling_arrays
from rawpaged.sampling_params import SamplingParams
from rawpaged.testing import reference_sampler


def kept_set(x, temperature, top_k, top_p, min_p):
    """Token ids kept by the filters, from their definitions (vLLM/HF order), in pure Python."""
    vals = [float(v) / temperature for v in x]
    ids = list(range(len(vals)))
    if 0 < top_k < len(vals):
        kth = sorted(vals, reverse=True)[top_k - 1]
        ids = [i for i in ids if vals[i] >= kth]
    m = max(vals[i] for i in ids)
    w = {i: math.exp(vals[i] - m) for i in ids}
    z = math.fsum(w.values())
    if top_p < 1.0:
        order = sorted(ids, key=lambda i: (-w[i], i))
        chosen, acc = [], 0.0
        for i in order:
            chosen.append(i)
            acc = math.fsum([acc, w[i] / z])
            if acc >= top_p:
                break
        ids = sorted(chosen)
    if min_p > 0.0:
        top = max(w[i] for i in ids)
        ids = [i for i in ids if w[i] >= min_p * top]
    return set(ids), {i: w[i] for i in ids}


CASES = [
    dict(temperature=1.0, top_k=-1, top_p=1.0, min_p=0.0),
    dict(temperature=0.7, top_k=5, top_p=1.0, min_p=0.0),
    dict(temperature=1.3, top_k=-1, top_p=0.8, min_p=0.0),
    dict(temperature=1.0, top_k=-1, top_p=1.0, min_p=0.05),
    dict(temperature=0.5, top_k=20, top_p=0.9, min_p=0.01),
    dict(temperature=2.0, top_k=1, top_p=1.0, min_p=0.0),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
def test_filtered_probs_matches_the_definitions(case):
    rng = np.random.default_rng(7)
    x = (rng.standard_normal(200) * 3).astype(np.float32)
    p = reference_sampler.filtered_probs(x, **case)
    ids, w = kept_set(x, **case)
    assert set(np.flatnonzero(p)) == ids
    z = math.fsum(w.values())
    np.testing.assert_allclose(p[sorted(ids)], [w[i] / z for i in sorted(ids)], rtol=1e-12)


def test_ties_top_k_keeps_all_ties_top_p_takes_lower_ids_first():
    x = np.array([1.0, 3.0, 2.0, 3.0, 2.0, 2.0, 0.0], dtype=np.float32)
    # top_k=2: the two 3.0s; top_k=3 reaches into the 2.0s, and every 2.0 is kept.
    assert set(np.flatnonzero(reference_sampler.filtered_probs(x, 1.0, 2, 1.0, 0.0))) == {1, 3}
    assert set(np.flatnonzero(reference_sampler.filtered_probs(x, 1.0, 3, 1.0, 0.0))) == {1, 2, 3, 4, 5}
    # top_p: the 3.0s hold ~0.61 of the mass, each 2.0 ~0.11; 0.65 needs one 2.0: the lowest id (2).
    p = reference_sampler.filtered_probs(x, 1.0, -1, 0.65, 0.0)
    assert set(np.flatnonzero(p)) == {1, 2, 3}
    assert set(np.flatnonzero(p)) == kept_set(x, 1.0, -1, 0.65, 0.0)[0]


@pytest.mark.parametrize("case", CASES[:5], ids=range(5))
def test_inverse_cdf_draws_follow_the_filtered_distribution(case):
    rng = np.random.default_rng(3)
    x = (rng.standard_normal(50) * 2).astype(np.float32)[None, :]
    n = 4000
    u = (np.arange(n) + 0.5) / n  # stratified: token t is drawn for a run of about n * p_t uniforms
    ids = reference_sampler.sample(
        x,
        np.zeros(n, np.int64),
        np.full(n, case["temperature"]),
        np.full(n, case["top_k"]),
        np.full(n, case["top_p"]),
        np.full(n, case["min_p"]),
        u,
    )
    counts = np.bincount(ids, minlength=x.shape[1])
    expect = reference_sampler.filtered_probs(x[0], **case) * n
    assert np.all(np.abs(counts - expect) <= 1.0), np.abs(counts - expect).max()
    assert list(ids) == sorted(ids), "inverse CDF over token ids: increasing uniforms give non-decreasing ids"


def test_greedy_rows_take_the_first_maximum_and_rows_are_indexed():
    logits = np.array([[0.0, 5.0, 5.0, 1.0], [9.0, 0.0, 0.0, 0.0]], dtype=np.float32)
    ids = reference_sampler.sample(
        logits, np.array([0, 1, 0]), np.zeros(3), np.full(3, -1), np.ones(3), np.zeros(3), np.zeros(3)
    )
    assert ids.tolist() == [1, 0, 1]


def test_sampling_arrays_and_uniform_draws():
    greedy, hot = SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, top_k=7, top_p=0.9, min_p=0.1)
    rng, same = np.random.default_rng(5), np.random.default_rng(5)
    assert draw_uniform(greedy, rng) == 0.0
    u = draw_uniform(hot, rng)
    assert u == same.random(), "greedy tokens must not consume the request's generator"
    arrays = sampling_arrays([(0, greedy, 0.0), (3, hot, u)], vocab_size=100)
    assert arrays["sample_rows"].tolist() == [0, 3]
    assert arrays["temperature"].tolist() == [0.0, 0.8]
    assert arrays["top_k"].tolist() == [-1, 7] and arrays["top_p"].tolist() == [1.0, 0.9]
    assert arrays["min_p"].tolist() == [0.0, 0.1] and arrays["uniforms"].tolist() == [0.0, u]
    huge = SamplingParams(temperature=0.5, top_k=1 << 70)  # any k: the kernels get at most the vocabulary
    assert sampling_arrays([(0, huge, 0.5)], vocab_size=100)["top_k"].tolist() == [100]


def test_temperature_thresholds_follow_vllm():
    assert SamplingParams(temperature=5e-324).greedy and SamplingParams(temperature=9.9e-6).greedy
    assert SamplingParams(temperature=1e-5).temperature == 1e-2  # raised: logits / T would overflow
    assert SamplingParams(temperature=0.5).temperature == 0.5 and not SamplingParams(temperature=0.5).greedy
    rng = np.random.default_rng(0)
    assert draw_uniform(SamplingParams(temperature=1e-308), rng) == 0.0  # greedy: no uniform drawn


def test_log_softmax_against_float64():
    rng = np.random.default_rng(3)
    x = rng.normal(0, 30, (4, 50)).astype(np.float32)
    x[0, :3] = [1e4, -1e4, 0]  # large magnitudes: computed stably
    got = log_softmax(x)
    ref = x.astype(np.float64)
    ref = ref - ref.max(axis=-1, keepdims=True)
    ref = ref - np.log(np.exp(ref).sum(axis=-1, keepdims=True))
    assert got.dtype == np.float32 and np.allclose(got, ref, atol=1e-5) and (got <= 0).all()
    assert np.allclose(np.exp(got.astype(np.float64)).sum(axis=-1), 1.0, atol=1e-5)
    assert np.allclose(log_softmax(x + 7.0), got, atol=1e-4)  # shift invariant
    one = log_softmax(x[1])  # a single row, as the engine passes them
    assert one.shape == (50,) and np.allclose(one, ref[1], atol=1e-5)


def test_sampling_arrays_dtypes_even_when_empty():
    for draws in ([], [(2, SamplingParams(temperature=0.5, top_k=3), 0.25)]):
        arrays = sampling_arrays(draws, vocab_size=10)
        assert {k: a.dtype for k, a in arrays.items()} == {
            "sample_rows": np.int64, "temperature": np.float64, "top_k": np.int64, "top_p": np.float64,
            "min_p": np.float64, "uniforms": np.float64}  # fmt: skip
        assert all(len(a) == len(draws) for a in arrays.values())


def _random_rows(rng, shape, scale):
    x = (rng.standard_normal(shape) * scale).astype(np.float32)
    x[:, :4] = x[:, 4:8]  # equal logits: ties in top-k, top-p and the draw
    return x


@pytest.mark.parametrize("scale", [0.5, 3.0, 12.0], ids=["flat", "normal", "peaked"])
def test_compiled_cpu_sampler_draws_as_the_reference(scale):
    """``cpu_sampling.sample`` (the backend's) against ``reference_sampler.sample`` (the NumPy reference): every case
    of CASES plus greedy rows and rows sampled twice, on flat to peaked rows with ties."""
    from rawpaged.kernels.cpu import sampling as cpu_sampling

    rng = np.random.default_rng(11)
    logits = _random_rows(rng, (6, 3000), scale)
    cases = CASES + [
        dict(temperature=0.0, top_k=-1, top_p=1.0, min_p=0.0),
        dict(temperature=0.9, top_k=-1, top_p=0.5, min_p=0.2),
    ]
    draws = 400
    rows = rng.integers(0, logits.shape[0], draws)
    picked = [cases[i % len(cases)] for i in range(draws)]
    args = (
        logits,
        rows,
        np.array([c["temperature"] for c in picked]),
        np.array([c["top_k"] for c in picked]),
        np.array([c["top_p"] for c in picked]),
        np.array([c["min_p"] for c in picked]),
        rng.random(draws),
    )
    expected = reference_sampler.sample(*args)
    got = cpu_sampling.sample(*args)
    assert got.dtype == np.int64 and got.tolist() == expected.tolist()
    one = cpu_sampling.sample(*(a[:1] if i else a for i, a in enumerate(args)))  # one sample: the serial kernel
    assert one.tolist() == expected[:1].tolist()
    assert cpu_sampling.sample(logits, *(np.zeros(0) for _ in range(6))).shape == (0,)


def test_compiled_cpu_sampler_top_p_cut_inside_ties():
    from rawpaged.kernels.cpu import sampling as cpu_sampling

    x = np.array([[1.0, 3.0, 2.0, 3.0, 2.0, 2.0, 0.0]], dtype=np.float32)
    n = 2000
    u = (np.arange(n) + 0.5) / n
    args = (x, np.zeros(n, np.int64), np.ones(n), np.full(n, -1), np.full(n, 0.65), np.zeros(n), u)
    assert set(cpu_sampling.sample(*args).tolist()) == {1, 2, 3}  # the lowest-id 2.0 joins the two 3.0s
    assert cpu_sampling.sample(*args).tolist() == reference_sampler.sample(*args).tolist()


@pytest.mark.parametrize("scale", [0.05, 1.0, 6.0, 40.0], ids=["near-uniform", "flat", "normal", "peaked"])
def test_compiled_nucleus_cut_by_buckets_equals_the_exact_path(scale):
    """The bucketed top-p cut (two levels of probability-bit buckets, one sub-bucket sorted) names the same last
    nucleus token as the exact path (every candidate sorted, summed in the reference's order), on a full-size
    vocabulary with ties, for cuts from the first bucket to the far tail."""
    from rawpaged.kernels.cpu import sampling as cpu_sampling

    rng = np.random.default_rng(int(scale * 100))
    vocab = 49152
    for _ in range(4):
        x = rng.standard_normal(vocab) * scale
        x[: vocab // 4] = x[vocab // 4 : vocab // 2]  # a quarter of the tokens tie with another
        x -= x.max()
        p = np.exp(x)
        p /= p.sum()
        imax = int(np.argmax(p))
        for top_p in (0.01, 0.3, 0.9, 0.999, 1.0 - 1e-7):
            got = cpu_sampling._nucleus_cut(p.copy(), top_p, imax)
            exact = cpu_sampling._nucleus_cut_exact(p.copy(), top_p, p[imax])
            assert got == exact, (top_p, got, exact)
            order = np.argsort(-p, kind="stable")  # and both are the reference's cut
            last = order[int(np.searchsorted(np.cumsum(p[order]), top_p))]
            assert exact == (p[last], last)


def test_compiled_sampler_cuts_at_exact_ties_of_the_running_sum_as_the_reference():
    """Uniform rows where the running sum meets top_p exactly (0.5 of 8 equal tokens): the bucketed path defers
    to the exact one, and the nucleus is the reference's lowest ids."""
    from rawpaged.kernels.cpu import sampling as cpu_sampling

    n = 800
    for vocab in (4, 8, 1024):
        x = np.zeros((1, vocab), dtype=np.float32)
        for top_p in (0.125, 0.25, 0.5, 0.75):
            args = (x, np.zeros(n, np.int64), np.ones(n), np.full(n, -1), np.full(n, top_p), np.zeros(n))
            u = (np.arange(n) + 0.37) / n  # no uniform on a CDF boundary j / kept (rounding would decide it)
            got = cpu_sampling.sample(*args, u)
            assert got.tolist() == reference_sampler.sample(*args, u).tolist()
            assert set(got.tolist()) == set(range(max(1, round(top_p * vocab))))
