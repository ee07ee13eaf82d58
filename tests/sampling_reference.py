"""Shared sampling cases for the emulated and the GPU tests of ``sample_kernel``: per-sample argument
arrays and the CPU reference with a boundary check."""

from __future__ import annotations

import numpy as np

from rawpaged.testing import reference_sampler

SAMPLE_CASES = [  # (temperature, top_k, top_p, min_p)
    (0.0, -1, 1.0, 0.0),
    (1.0, -1, 1.0, 0.0),
    (0.7, 5, 1.0, 0.0),
    (1.3, -1, 0.8, 0.0),
    (1.0, -1, 1.0, 0.05),
    (0.5, 20, 0.9, 0.01),
    (2.0, 1, 1.0, 0.0),
    (1.0, 3, 0.5, 0.0),
    (0.9, 0, 0.95, 0.0),
]


def sample_args(num_rows, cases, rng):
    rows, params = [], []
    for r in range(num_rows):
        for case in cases:
            rows.append(r)
            params.append(case)
    t, k, p, m = (np.array(c) for c in zip(*params))
    return dict(
        sample_rows=np.array(rows, np.int64),
        temperature=t,
        top_k=k,
        top_p=p,
        min_p=m,
        uniforms=rng.random(len(rows)).astype(np.float32).astype(np.float64),
    )


def robust_reference(logits, args, eps=1e-4):
    """reference_sampler.sample on float32 logits, which samples keep their id when the uniform and the top-p / min-p
    cut-offs move by a relative ``eps`` (float32 sums on the device may land on either side of such a
    boundary), and for every sample the set of ids those moves produce (what a device draw may be)."""
    ref = reference_sampler.sample(logits, **args)
    stable = np.ones(len(ref), dtype=bool)
    allowed = [{int(t)} for t in ref]
    for field, lo, hi in (("uniforms", 0.0, 1 - 1e-9), ("top_p", 0.0, 1.0), ("min_p", 0.0, 1.0)):
        for sign in (-1, 1):
            moved = dict(args)
            base = args[field]
            moved[field] = np.where((base > lo) & (base < hi), np.clip(base * (1 + sign * eps), lo, hi), base)
            ids = reference_sampler.sample(logits, **moved)
            stable &= ids == ref
            for a, t in zip(allowed, ids):
                a.add(int(t))
    return ref, stable, allowed


def assert_draws_match(got, logits, args, min_stable=0.5):
    """Every device id is the reference's, or, for a sample on a rounding boundary, one its neighbours
    give; exactly the reference's wherever the sample is away from boundaries (most of them)."""
    ref, stable, allowed = robust_reference(logits, args)
    np.testing.assert_array_equal(got[stable], ref[stable])
    bad = [j for j, (t, a) in enumerate(zip(got, allowed)) if int(t) not in a]
    assert not bad, f"samples {bad}: device ids {got[bad].tolist()}, reference {ref[bad].tolist()}"
    assert stable.mean() >= min_stable, f"only {stable.sum()} of {len(stable)} samples away from a boundary"
