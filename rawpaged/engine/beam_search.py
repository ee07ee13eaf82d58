"""Beam search selection, step by step, with HF transformers' semantics (``generation/utils.py``
``_beam_search``, default ``early_stopping=False``), so results compare with ``generate(num_beams=k)``.

Per step, with k running beams of cumulative logprob ``c_b`` and ``g`` tokens generated so far:
  * candidates are the top ``2k`` of ``c_b + log_softmax(logits_b)`` over every beam and token;
  * a candidate "hits" when its token is EOS / a stop token, when its text completes a stop string, or
    when ``g + 1`` reaches the length limit (stops as sampling has them: a stop string or a stop token's
    text is cut from the hypothesis' text unless ``include_stop_str_in_output``);
  * the next running beams are the k best candidates that do not hit;
  * hitting candidates ranked in the top k become finished hypotheses scored
    ``(c_b + logprob) / (g + 1) ** length_penalty``; the k best hypotheses are kept;
  * search ends when every candidate hits, or when all k hypotheses exist and the best running beam's
    ``c / (g + 1) ** length_penalty`` cannot beat the worst hypothesis (HF's heuristic).
``step`` only decides; ``step_beams`` applies a decision to a request's sequences (forks for beams that
branch, the pruned ones to finish) and ``beam_outputs`` gives the final hypotheses.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from rawpaged.engine.logprobs import top_logprobs
from rawpaged.engine.outputs import CompletionOutput
from rawpaged.engine.stop_strings import cut_at_stop_string, find_stop_string

#: tokens of a beam's tail decoded to look for a stop string, beyond the longest one's characters
STOP_WINDOW_MARGIN = 8


def length_normalized(cumulative_logprob: float, length: int, length_penalty: float) -> float:
    """``cumulative_logprob / length ** length_penalty`` in float64, for any finite ``length_penalty``: a
    power that overflows gives -0.0 and one that underflows -inf (never an exception)."""
    with np.errstate(all="ignore"):
        return float(np.float64(cumulative_logprob) / np.power(np.float64(length), length_penalty))


@dataclass
class Hypothesis:
    score: float
    cumulative_logprob: float
    token_ids: list  # generated tokens, the final (hitting) one included
    hit_eos: bool  # ended by EOS or a stop token id
    logprobs: list | None = None  # per token: {token_id: logprob}, when asked for
    stop_str: str | None = None  # the stop string its text completed

    @property
    def finish_reason(self) -> str:
        return "stop" if self.hit_eos or self.stop_str is not None else "length"


@dataclass
class BeamState:
    """Search state of one request: finished hypotheses (best first) and the stop flag."""

    width: int
    length_penalty: float
    finished: list = field(default_factory=list)
    improvement_possible: bool = True
    done: bool = False


@dataclass
class Candidate:
    parent: int  # index into the running beams passed to ``step``
    token_id: int
    cumulative_logprob: float


def step(
    state: BeamState,
    cum_logprobs: list,
    generated: list,
    logprob_rows: np.ndarray,
    stop_ids: set,
    max_new_tokens: int,
    logprobs: list | None = None,
    num_logprobs: int = 0,
    stop_string: Callable[[int, int], str | None] | None = None,
) -> list:
    """Advance one token. Returns the next running beams as ``Candidate``s (best first).

    Args:
        cum_logprobs: cumulative logprob of each running beam (float).
        generated: each running beam's generated token ids so far (all the same length g).
        logprob_rows: float32 ``[num_beams, vocab]`` log_softmax of each beam's logits.
        stop_ids: token ids that end a hypothesis (EOS unless ignored, plus stop_token_ids).
        max_new_tokens: length limit of generated tokens.
        logprobs: each running beam's per-token logprob entries, when they are reported; a finished
            hypothesis then carries its own (``num_logprobs`` top entries for its last token).
        stop_string: ``(parent, token) -> the stop string that beam's text completes with that token``
            (or None); asked only of the top ``2k`` candidates.
    """
    k = state.width
    g = len(generated[0])
    totals = logprob_rows.astype(np.float64) + np.asarray(cum_logprobs, np.float64)[:, None]
    flat = totals.reshape(-1)
    top = _top_candidates(flat, 2 * k)
    vocab = logprob_rows.shape[1]
    at_limit = g + 1 >= max_new_tokens
    running, new_finished = [], []
    for rank, idx in enumerate(top):
        parent, token, total = int(idx // vocab), int(idx % vocab), float(flat[idx])
        stop_str = stop_string(parent, token) if stop_string is not None and token not in stop_ids else None
        hits = at_limit or token in stop_ids or stop_str is not None
        if hits:
            if rank < k and state.improvement_possible:
                entries = None
                if logprobs is not None:
                    entries = logprobs[parent] + [top_logprobs(logprob_rows[parent], token, num_logprobs)]
                new_finished.append(
                    Hypothesis(
                        length_normalized(total, g + 1, state.length_penalty),
                        total,
                        generated[parent] + [token],
                        token in stop_ids,
                        entries,
                        stop_str,
                    )
                )
        elif len(running) < k:
            running.append(Candidate(parent, token, total))
    _keep_best(state, new_finished, running, g + 1)
    return running


def _top_candidates(flat: np.ndarray, count: int) -> np.ndarray:
    """Flat indices of the ``count`` largest of ``flat`` (all of them if fewer), ordered as torch.topk:
    by value, ties by lower flat index."""
    keep = min(count, flat.size)
    top = np.argpartition(-flat, keep - 1)[:keep]
    return top[np.lexsort((top, -flat[top]))]


def _keep_best(state: BeamState, new_finished: list, running: list, length: int) -> None:
    """Keep the ``state.width`` best hypotheses, old and new, and decide whether the search is done: no
    beam runs on, or the best running beam (``running[0]``, of ``length`` tokens after this step)
    cannot beat the worst kept hypothesis once there are ``width`` of them."""
    k = state.width
    merged = state.finished + new_finished
    merged.sort(key=lambda h: -h.score)  # stable: earlier hypotheses win ties, as in torch.topk on the concat
    state.finished = merged[:k]
    if running and len(state.finished) == k:
        best_possible = length_normalized(running[0].cumulative_logprob, length, state.length_penalty)
        if best_possible <= state.finished[-1].score:
            state.improvement_possible = False
    state.done = not running or not state.improvement_possible


def stop_token_ids(params, eos_token_ids) -> set:
    """Token ids that end a hypothesis: ``stop_token_ids``, plus EOS unless ``ignore_eos``."""
    return set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_token_ids))


def stop_string_finder(stops: list, beams: list, tokenizer) -> Callable[[int, int], str | None]:
    """``(parent, token) -> stop string`` for ``step``: decodes the tail of beam ``parent`` with and
    without ``token`` and looks for a stop string that ends in the new characters (as sampling finds
    them across token boundaries)."""
    longest = max(len(s) for s in stops)
    window = longest + STOP_WINDOW_MARGIN
    before: dict = {}

    def find(parent: int, token: int) -> str | None:
        tail = beams[parent].output_token_ids[-window:]
        if parent not in before:
            before[parent] = tokenizer.decode(tail)
        old, new = before[parent], tokenizer.decode([*tail, token])
        common = len(os.path.commonprefix([old, new]))
        found = find_stop_string(new, stops, max(0, common - longest + 1))
        return None if found is None else found[1]

    return find


def step_beams(req, fork, eos_token_ids, max_model_len: int, now: float, tokenizer=None) -> tuple:
    """Advance request ``req`` by one token once all its running beams have their ``pending_logprobs``.

    Every chosen ``(parent, token)`` gets a sequence: the parent itself the first time, a fork
    (``fork(req, parent)``, sharing the parent's blocks) after. Returns ``(sampled, pruned)``: the
    ``(sequence, token_id)`` pairs to append, and the beams no candidate continues (to finish).
    ``req.beams`` becomes the chosen sequences, their cumulative logprobs set. ``tokenizer`` decodes
    the candidates' text to find the request's stop strings (none are looked for without it).
    """
    params, beams = req.params, req.beams
    limit = min(params.max_tokens, max_model_len - len(req.prompt_token_ids))
    rows = np.stack([b.pending_logprobs for b in beams])
    for b in beams:
        b.pending_logprobs = None
    with_logprobs = params.logprobs is not None
    chosen = step(
        req.beam,
        [b.cumulative_logprob for b in beams],
        [b.output_token_ids for b in beams],
        rows,
        stop_token_ids(params, eos_token_ids),
        limit,
        [b.logprobs for b in beams] if with_logprobs else None,
        params.logprobs or 0,
        stop_string_finder(params.stop_strings, beams, tokenizer) if params.stop_strings and tokenizer else None,
    )
    claimed, sampled = set(), []
    for cand in chosen:  # forks first: each copies its parent's state before this step's token
        parent = beams[cand.parent]
        seq = parent if cand.parent not in claimed else fork(req, parent)
        claimed.add(cand.parent)
        sampled.append((seq, cand))
    for seq, cand in sampled:
        seq.cumulative_logprob = cand.cumulative_logprob
        if with_logprobs:
            seq.logprobs.append(top_logprobs(rows[cand.parent], cand.token_id, params.logprobs))
        if seq.first_token_time is None:
            seq.first_token_time = now
    req.beams = [seq for seq, _ in sampled]
    return [(seq, cand.token_id) for seq, cand in sampled], [b for i, b in enumerate(beams) if i not in claimed]


def hypothesis_text(hyp: Hypothesis, params, tokenizer) -> str:
    """The text of a finished hypothesis as sampling would show it: a stop token's text left out and a
    stop string cut off, unless ``include_stop_str_in_output``."""
    include = params.include_stop_str_in_output
    ids = hyp.token_ids[:-1] if hyp.hit_eos and not include else hyp.token_ids
    text = tokenizer.decode(ids)
    if hyp.stop_str is not None:
        found = find_stop_string(text, [hyp.stop_str], 0)
        if found is not None:
            text = cut_at_stop_string(text, found, include)
    return text


def beam_outputs(req, tokenizer) -> list:
    """The ``n`` best finished hypotheses of a done search, best first, as ``CompletionOutput``s."""
    return [
        CompletionOutput(
            index=i,
            text=hypothesis_text(hyp, req.params, tokenizer),
            token_ids=list(hyp.token_ids),
            finish_reason=hyp.finish_reason,
            logprobs=hyp.logprobs,
            cumulative_logprob=hyp.cumulative_logprob,
        )
        for i, hyp in enumerate(req.beam.finished[: req.params.n])
    ]
