"""Parallel sampling (``n > 1``, ``best_of``): the prompt is prefilled once by the request's first
sequence; when it samples its first token it forks ``best_of - 1`` siblings that share its KV blocks
(copy-on-write), each drawing from its own seeded generator. With ``best_of > n`` only the ``n`` with the
highest cumulative logprob are returned, once all are done (vLLM's ``best_of``)."""

from __future__ import annotations

from rawpaged.sampling_params import SamplingParams


def fork_samples(req, parent, fork) -> list:
    """The siblings ``parent`` forks now (``fork(req, parent, index)`` makes one): ``best_of - 1`` of
    them on the request's first sample, none after."""
    if req.forked:
        return []
    req.forked = True
    return [fork(req, parent, index) for index in range(1, req.params.best_of)]


def needs_logprobs(params: SamplingParams) -> bool:
    """Whether a sample's logprob row is needed: logprobs asked for, or ``best_of > n`` ranking."""
    return params.logprobs is not None or params.best_of > params.n


def shown_sequences(req, finished: bool) -> list:
    """``(choice index, sequence)`` for each choice a ``RequestOutput`` shows: every sample by its index;
    with ``best_of > n`` nothing until the end, then the ``n`` best by cumulative logprob, renumbered."""
    params = req.params
    seqs = sorted(req.seqs, key=lambda s: s.index)
    if params.best_of > params.n:
        if not finished:
            return []
        return list(enumerate(sorted(seqs, key=lambda s: -s.cumulative_logprob)[: params.n]))
    return [(s.index, s) for s in seqs]
