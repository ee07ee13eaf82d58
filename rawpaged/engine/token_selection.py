"""Token selection for one step: from the logits of the sequences that sample to each one's next token.

In order, once per step: the host rows of raw logits that logprobs and best_of need, the sampling
parameters' logits edits (penalties, logit bias, bans: ``model_executor.logits_processors``), the rows beam
search needs (edited), grammar masks on the constrained rows (``structured_output``), beams advanced by
``beam_search.step_beams``, ``n > 1`` samples forked on their first token (``parallel_sampling``), one
seeded uniform per sample (``model_executor.sampler.draw_uniform``), every draw sampled in one backend
call through the ``ModelRunner``, and each grammar advanced by its token. A failure in one request's
part ends that request alone (``SelectedTokens.failed``); the others go on.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from rawpaged.engine import beam_search, parallel_sampling
from rawpaged.errors import EngineError
from rawpaged.model_executor.logits_processors import build_edits
from rawpaged.model_executor.sampler import draw_uniform, log_softmax
from rawpaged.spec_decode.rejection_sampler import accepted_tokens

logger = logging.getLogger(__name__)


@dataclass
class SelectedTokens:
    """What a step selected. ``samples``: (sequence, token id, float64 logprob row or None) of requests
    that did not fail; ``beam_sampled``: (beam, token id); ``pruned``: beams dropped; ``beams_done``:
    requests whose beam search ended; ``touched``: request id -> request with new tokens or finished;
    ``failed``: request id -> the exception that ended it; ``verified``: (sequence, draft tokens,
    accepted drafts) of each sequence that verified drafts. A sequence with drafts has several samples,
    in order."""

    samples: list = field(default_factory=list)
    beam_sampled: list = field(default_factory=list)
    pruned: list = field(default_factory=list)
    beams_done: list = field(default_factory=list)
    touched: dict = field(default_factory=dict)
    failed: dict = field(default_factory=dict)
    verified: list = field(default_factory=list)


class TokenSelector:
    """Selects a step's tokens (see the module doc).

    Args:
        runner: the ``ModelRunner`` (``sample``, ``fetch_rows``, ``apply_token_bitmask``).
        grammar_bitmask: ``grammars -> int32 bitmask [len(grammars), words]`` (the structured-output
            manager's, created on first use).
        fork: ``(request, parent, index=None) -> child sequence`` sharing the parent's blocks.
        eos_token_ids, max_model_len, tokenizer: for beam search's stops and texts.
        reasoning_end_token_id: ``</think>`` of a reasoning model: a grammar waits for it (None: no wait).
    """

    def __init__(
        self,
        runner,
        grammar_bitmask: Callable,
        fork: Callable,
        eos_token_ids,
        max_model_len,
        tokenizer,
        reasoning_end_token_id: int | None = None,
    ):
        self.reasoning_end_token_id = reasoning_end_token_id
        self.runner = runner
        self.grammar_bitmask = grammar_bitmask
        self.fork = fork
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.tokenizer = tokenizer

    def select(self, logits, layout, requests: dict, now: float) -> SelectedTokens:
        """The tokens of the sequences that sample, for ``requests`` (id -> ``Request``), from the rows
        ``layout`` (``model_executor.step_input.LogitsLayout``) gives each: one logits row per sequence,
        except a sequence with drafts, which has one row per draft plus one and keeps the tokens
        ``rejection_sampler.accepted_tokens`` accepts."""
        out = SelectedTokens()
        sampling = layout.seqs
        rows = self.runner.fetch_rows(  # logprobs are of the raw logits, as vLLM's default
            logits,
            [
                r
                for i, seq in enumerate(sampling)
                if parallel_sampling.needs_logprobs(seq.sampling_params) and not seq.sampling_params.use_beam_search
                for r in layout.rows(i)
            ],
        )
        self._apply_logits_rules(logits, layout, requests, out.failed)
        rows.update(  # beams choose by the edited logits (penalties apply, as in transformers)
            self.runner.fetch_rows(
                logits, [f for f, seq in zip(layout.first_rows, sampling) if seq.sampling_params.use_beam_search]
            )
        )
        self._apply_grammars(logits, sampling, layout.first_rows)
        draws, samples, drafted = self._draws(layout, rows, requests, now, out)
        tokens = self._sample(logits, draws, samples, out.failed)
        keep = self._verify_drafts(drafted, tokens, out)
        self._advance_grammars(samples, tokens, out.failed)
        out.samples = [
            (s, tok, lp)
            for i, ((s, lp), tok) in enumerate(zip(samples, tokens))
            if s.request_id not in out.failed and keep[i]
        ]
        return out

    def _draws(self, layout, rows: dict, requests: dict, now: float, out: SelectedTokens) -> tuple:
        """Each sampling sequence's draws (beams advance instead): ``(draws, samples, drafted)``, per draw
        its ``(row, params, uniform)``, per sample its ``(sequence, logprob row or None)``, and per
        sequence with drafts ``(sequence, index of its first draw, drafts, its generator's state before
        them)``. ``n > 1`` samples fork here on their first token. A request whose part fails is recorded
        in ``out.failed`` and draws nothing."""
        draws, samples, drafted = [], [], []
        for first, seq, drafts in layout.by_seq():
            req = requests[seq.request_id]
            if req.request_id in out.failed:
                continue
            try:
                if req.beam is not None:
                    self._advance_beams(req, seq, rows[first], now, out)
                    continue
                params = req.params
                needs_lp = parallel_sampling.needs_logprobs(params)
                if drafts:
                    state = seq.rng.bit_generator.state if not params.greedy else None
                    drafted.append((seq, len(draws), drafts, state))
                    for r in range(first, first + len(drafts) + 1):
                        draws.append((r, params, draw_uniform(params, seq.rng)))
                        samples.append((seq, log_softmax(rows[r]) if needs_lp else None))
                    out.touched[req.request_id] = req
                    continue
                lp_row = log_softmax(rows[first]) if needs_lp else None
                targets = [seq] if req.forked else [seq, *parallel_sampling.fork_samples(req, seq, self.fork)]
                req_draws = [(first, params, draw_uniform(params, t.rng)) for t in targets]
            except Exception as e:  # noqa: BLE001 - this request fails alone
                out.failed[req.request_id] = e
                continue
            draws += req_draws
            samples += [(t, lp_row) for t in targets]
            out.touched[req.request_id] = req
        return draws, samples, drafted

    @staticmethod
    def _verify_drafts(drafted: list, tokens: list, out: SelectedTokens) -> list:
        """Which samples are kept: for each sequence with drafts, the prefix ``accepted_tokens`` keeps; its
        generator then stands as if it had drawn one uniform per kept token (so a seed gives the tokens a
        step without speculation would). Records ``(sequence, drafted, accepted)`` in ``out.verified``."""
        keep = [True] * len(tokens)
        for seq, start, drafts, state in drafted:
            if seq.request_id in out.failed:
                continue
            sampled = tokens[start : start + len(drafts) + 1]
            kept = len(accepted_tokens(drafts, sampled))
            for i in range(start + kept, start + len(drafts) + 1):
                keep[i] = False
            if state is not None:
                seq.rng.bit_generator.state = state
                seq.rng.random(kept)
            out.verified.append((seq, len(drafts), kept - 1))
        return keep

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

    def _apply_logits_rules(self, logits, layout, requests: dict, failed: dict):
        """Penalties, logit bias, min_tokens, bad_words and allowed_token_ids on the rows of the requests that
        set them (``model_executor.logits_processors``): a row's history is its sequence's output plus the
        drafts before it. Costs nothing when no request sets them; a request whose edits cannot be built
        fails alone."""
        entries, masks, mask_rows = [], [], []
        for first, seq, seq_drafts in layout.by_seq():
            req = requests.get(seq.request_id)
            rules = req.logits_rules if req is not None else None
            if rules is None:
                continue
            try:
                drafts = list(seq_drafts)
                for j in range(len(drafts) + 1):
                    history = seq.output_token_ids + drafts[:j] if j else seq.output_token_ids
                    entries.append((first + j, rules, history))
                    if rules.allowed_bitmask is not None:
                        mask_rows.append(first + j)
                        masks.append(rules.allowed_bitmask)
            except Exception as e:  # noqa: BLE001 - this request fails alone
                failed[seq.request_id] = e
        if masks:
            self.runner.apply_token_bitmask(logits, np.stack(masks), mask_rows)
        edits = build_edits(entries) if entries else None
        if edits is not None:
            self.runner.apply_logits_edits(logits, edits)

    def _apply_grammars(self, logits, sampling: list, first_rows: list) -> None:
        """Structured outputs: forbid, in each constrained sequence's logits row, the tokens its grammar
        does not allow next (the rows' masks computed in parallel). Rows without a grammar are left as
        they are, and a step without one costs nothing. A grammar that has ended (its EOS accepted,
        generation going on under ``ignore_eos``) constrains nothing more, as in vLLM."""
        rows, grammars = [], []
        for row, seq in zip(first_rows, sampling):  # a constrained sequence has no drafts: one row
            if seq.grammar is not None and seq.reasoning_ended and not seq.grammar.is_terminated():
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

    def _advance_grammars(self, samples: list, tokens: list, failed: dict) -> None:
        """Each constrained sequence's grammar takes its token; a token it refuses fails the request. While
        a reasoning model thinks, its grammar waits: ``</think>`` opens it (and is not the grammar's)."""
        for (seq, _), tok in zip(samples, tokens):
            grammar = seq.grammar
            if grammar is None or grammar.is_terminated() or seq.request_id in failed:
                continue
            if not seq.reasoning_ended:
                seq.reasoning_ended = tok == self.reasoning_end_token_id
                continue
            if not grammar.accept_token(tok):
                failed[seq.request_id] = EngineError(f"token {tok} broke the output's grammar: {grammar.error}")
