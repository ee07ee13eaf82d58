"""Token selection for one step: from the logits of the sequences that sample to each one's next token.

In order, once per step: grammar masks on the constrained rows (``structured_output``), the host rows
that need the whole distribution (logprobs, beam search, best_of), beams advanced by
``beam_search.step_beams``, ``n > 1`` samples forked on their first token (``parallel_sampling``), one
seeded uniform per sample (``model_executor.sampler.draw_uniform``), every draw sampled in one backend
call through the ``ModelRunner``, and each grammar advanced by its token. A failure in one request's
part ends that request alone (``SelectedTokens.failed``); the others go on.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from rawpaged.engine import beam_search, parallel_sampling
from rawpaged.errors import EngineError
from rawpaged.model_executor.sampler import draw_uniform, log_softmax
from rawpaged.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


@dataclass
class SelectedTokens:
    """What a step selected. ``samples``: (sequence, token id, float64 logprob row or None) of requests
    that did not fail; ``beam_sampled``: (beam, token id); ``pruned``: beams dropped; ``beams_done``:
    requests whose beam search ended; ``touched``: request id -> request with new tokens or finished;
    ``failed``: request id -> the exception that ended it."""

    samples: list = field(default_factory=list)
    beam_sampled: list = field(default_factory=list)
    pruned: list = field(default_factory=list)
    beams_done: list = field(default_factory=list)
    touched: dict = field(default_factory=dict)
    failed: dict = field(default_factory=dict)


def needs_distribution(params: SamplingParams) -> bool:
    """Whether a row's whole distribution must reach the host (logprobs, best_of, beams); sampling itself
    runs on the backend and returns only ids."""
    return parallel_sampling.needs_logprobs(params) or params.use_beam_search


class TokenSelector:
    """Selects a step's tokens (see the module doc).

    Args:
        runner: the ``ModelRunner`` (``sample``, ``fetch_rows``, ``apply_token_bitmask``).
        grammar_bitmask: ``grammars -> int32 bitmask [len(grammars), words]`` (the structured-output
            manager's, created on first use).
        fork: ``(request, parent, index=None) -> child sequence`` sharing the parent's blocks.
        eos_token_ids, max_model_len, tokenizer: for beam search's stops and texts.
    """

    def __init__(self, runner, grammar_bitmask: Callable, fork: Callable, eos_token_ids, max_model_len, tokenizer):
        self.runner = runner
        self.grammar_bitmask = grammar_bitmask
        self.fork = fork
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.tokenizer = tokenizer

    def select(self, logits, sampling: list, requests: dict, now: float) -> SelectedTokens:
        """The tokens of ``sampling`` (one sequence per logits row) for ``requests`` (id -> ``Request``)."""
        out = SelectedTokens()
        rows = self.runner.fetch_rows(
            logits, [row for row, seq in enumerate(sampling) if needs_distribution(seq.sampling_params)]
        )
        self._apply_grammars(logits, sampling)
        draws, samples = [], []  # per sample: its draw, (sequence, logprob row)
        for row, seq in enumerate(sampling):
            req = requests[seq.request_id]
            if req.request_id in out.failed:
                continue
            try:
                if req.beam is not None:
                    self._advance_beams(req, seq, rows[row], now, out)
                    continue
                params = req.params
                lp_row = log_softmax(rows[row]) if parallel_sampling.needs_logprobs(params) else None
                targets = [seq] if req.forked else [seq, *parallel_sampling.fork_samples(req, seq, self.fork)]
                req_draws = [(row, params, draw_uniform(params, t.rng)) for t in targets]
            except Exception as e:  # noqa: BLE001 - this request fails alone
                out.failed[req.request_id] = e
                continue
            draws += req_draws
            samples += [(t, lp_row) for t in targets]
            out.touched[req.request_id] = req
        tokens = self._sample(logits, draws, samples, out.failed)
        self._advance_grammars(samples, tokens, out.failed)
        out.samples = [(s, tok, lp) for (s, lp), tok in zip(samples, tokens) if s.request_id not in out.failed]
        return out

    def _advance_beams(self, req, seq, row, now: float, out: SelectedTokens) -> None:
        """Keep a beam's logprobs; once every beam of ``req`` has them, step the beam search."""
        seq.pending_logprobs = log_softmax(row)
        if not all(b.pending_logprobs is not None for b in req.beams):
            return
        sampled, dead = beam_search.step_beams(
            req, self.fork, self.eos_token_ids, self.max_model_len, now, self.tokenizer
        )
        out.beam_sampled += sampled
        out.pruned += dead
        if req.beam.done:
            out.beams_done.append(req)
            out.touched[req.request_id] = req

    def _apply_grammars(self, logits, sampling: list) -> None:
        """Structured outputs: forbid, in each constrained sequence's logits row, the tokens its grammar
        does not allow next (the rows' masks computed in parallel). Rows without a grammar are left as
        they are, and a step without one costs nothing. A grammar that has ended (its EOS accepted,
        generation going on under ``ignore_eos``) constrains nothing more, as in vLLM."""
        rows, grammars = [], []
        for row, seq in enumerate(sampling):
            if seq.grammar is not None and not seq.grammar.is_terminated():
                rows.append(row)
                grammars.append(seq.grammar)
        if rows:
            self.runner.apply_token_bitmask(logits, self.grammar_bitmask(grammars), rows)

    def _sample(self, logits, draws: list, samples: list, failed: dict) -> list:
        """Token ids for ``draws``, in one backend call; if that call fails, one call per draw, so a draw
        that fails fails only its request (recorded in ``failed``; its token is None)."""
        try:
            return [int(t) for t in self.runner.sample(logits, draws)]
        except Exception:  # noqa: BLE001
            logger.warning("batched sampling failed; sampling one request at a time", exc_info=True)
        tokens = []
        for draw, (seq, _) in zip(draws, samples):
            token = None
            if seq.request_id not in failed:
                try:
                    token = int(self.runner.sample(logits, [draw])[0])
                except Exception as e:  # noqa: BLE001
                    failed[seq.request_id] = e
            tokens.append(token)
        return tokens

    @staticmethod
    def _advance_grammars(samples: list, tokens: list, failed: dict) -> None:
        """Each constrained sequence's grammar takes its token; a token it refuses fails the request."""
        for (seq, _), tok in zip(samples, tokens):
            grammar = seq.grammar
            if grammar is None or grammar.is_terminated() or seq.request_id in failed:
                continue
            if not grammar.accept_token(tok):
                failed[seq.request_id] = EngineError(f"token {tok} broke the output's grammar: {grammar.error}")
