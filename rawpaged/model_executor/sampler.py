"""Token selection around the backends' ``sample`` kernels: per-request seeded uniforms, the
per-sample arrays, logprobs.

The filters themselves (temperature, top-k, top-p, min-p, inverse-CDF draw) run on the backend:
``rawpaged.kernels.cpu.sampling.sample`` (Numba) and ``cuda/sampling.cu``, both checked against the
float64 NumPy reference ``rawpaged.testing.reference_sampler.sample``. Each
non-greedy token costs its request's generator one uniform drawn here, so a seed gives the same tokens
whatever the request is batched with. Logprobs are of the model's raw distribution
(``log_softmax(logits)``, before temperature), as vLLM reports them.
"""

from __future__ import annotations

import numpy as np


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """float32 ``log_softmax`` over the last axis, computed stably in float64."""
    x = logits.astype(np.float64)
    x = x - x.max(axis=-1, keepdims=True)
    return (x - np.log(np.exp(x).sum(axis=-1, keepdims=True))).astype(np.float32)


def sampling_arrays(draws: list, vocab_size: int) -> dict:
    """The per-sample arrays of the backends' ``sample`` for ``draws`` = [(logits row, SamplingParams,
    uniform)]: sample_rows, temperature (0 for greedy), top_k (at most ``vocab_size``, so any value fits
    the kernels' integers), top_p, min_p, uniforms."""
    params = [p for _, p, _ in draws]
    return dict(
        sample_rows=np.array([r for r, _, _ in draws], dtype=np.int64),
        temperature=np.array([p.temperature for p in params], dtype=np.float64),  # 0.0 when greedy
        top_k=np.array([min(p.top_k, vocab_size) for p in params], dtype=np.int64),
        top_p=np.array([p.top_p for p in params], dtype=np.float64),
        min_p=np.array([p.min_p for p in params], dtype=np.float64),
        uniforms=np.array([u for _, _, u in draws], dtype=np.float64),
    )


def draw_uniform(params, rng: np.random.Generator) -> float:
    """The one uniform in [0, 1) a non-greedy token costs the request's generator (greedy: none, 0.0)."""
    return 0.0 if params.greedy else float(rng.random())
