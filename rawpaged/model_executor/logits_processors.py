"""The sampling parameters that edit logits before the sampler: ``allowed_token_ids``, ``bad_words``,
``min_tokens``, ``logit_bias``, then the repetition, frequency and presence penalties, in vLLM v1's order
(``vllm/v1/sample/sampler.py``, ``Sampler.apply_logits_processors``). For a logits row ``x`` of a sequence
whose prompt is ``P`` and whose output so far is ``O`` (with ``c_t`` the count of token ``t`` in ``O``):

1. ``allowed_token_ids``: ``x_t = -inf`` for every ``t`` not listed.
2. ``bad_words``: ``x_w = -inf`` for the last token ``w`` of each banned token sequence whose other tokens
   end ``O`` (``vllm/v1/sample/ops/bad_words.py``).
3. ``min_tokens``: while ``len(O) < min_tokens``, ``x_t = -inf`` for EOS and ``stop_token_ids``.
4. ``logit_bias``: ``x_t += bias_t``.
5. ``repetition_penalty`` ``r``, for ``t`` in ``P`` or ``O``: ``x_t / r`` if ``x_t > 0`` else ``x_t * r``
   (CTRL, Keskar et al. 2019, eq. 1, as transformers' ``RepetitionPenaltyLogitsProcessor`` and
   vLLM's ``apply_repetition_penalties_torch`` in ``vllm/_custom_ops.py``).
6. ``frequency_penalty`` ``f`` and ``presence_penalty`` ``p``, for ``t`` in ``O``: ``x_t -= f * c_t``,
   then ``x_t -= p`` (OpenAI's definition; vLLM ``model_executor/layers/utils.py`` ``apply_penalties``).

A row of a sequence verifying drafts counts the drafts before it as output (vLLM's
``_combine_outputs_with_spec_tokens``). Masks commute with the other steps (``-inf`` stays ``-inf``), so the
backends apply 1 as a packed bitmask (``apply_token_bitmask``, the structured outputs' kernel) and 2-6 as
one sparse ``apply_logits_edits`` call: per row, additive entries (4, with 2-3 as ``-inf``), then
repetition entries (5), then count entries (6). Only listed tokens are touched, so a step costs what its
histories hold, and nothing when no request uses these parameters.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numba as nb
import numpy as np

from rawpaged.errors import InvalidRequestError
from rawpaged.sampling_params import SamplingParams


@dataclass(frozen=True, eq=False)
class LogitsRules:
    """One request's logits parameters as token-id arrays, built once when it is queued.

    Attributes:
        repetition_penalty, frequency_penalty, presence_penalty: as in ``SamplingParams``.
        prompt_ids: int32 sorted unique prompt token ids (empty unless ``repetition_penalty != 1``).
        bias_ids, bias_values: int32 / float32 ``[k]``: ``logit_bias`` sorted by token id.
        min_tokens: as in ``SamplingParams``.
        stop_ids: int32 sorted unique: EOS ids and ``stop_token_ids`` (forbidden before ``min_tokens``).
        bad_words: token-id tuples banned at their last token.
        allowed_bitmask: int32 ``[ceil(vocab / 32)]`` (bit ``t % 32`` of word ``t // 32``) or None.
    """

    repetition_penalty: float
    frequency_penalty: float
    presence_penalty: float
    prompt_ids: np.ndarray
    bias_ids: np.ndarray
    bias_values: np.ndarray
    min_tokens: int
    stop_ids: np.ndarray
    bad_words: tuple
    allowed_bitmask: np.ndarray | None

    @property
    def counts_output(self) -> bool:
        return self.frequency_penalty != 0.0 or self.presence_penalty != 0.0


def bad_words_token_ids(words, tokenizer) -> tuple:
    """Each word, stripped of leading spaces, encoded without special tokens, then again after one space
    (the form a word takes inside a text); both forms are banned whatever their token counts (vLLM's
    ``SamplingParams.update_from_tokenizer`` drops a spaced form with another number of tokens, so a word
    that is one token after a space but several bare is never banned). Returns a tuple of token-id tuples,
    plain then spaced, without repeats. Raises InvalidRequestError ("bad_words") for a word with no
    tokens."""
    out = []
    for word in words:
        plain = tuple(tokenizer.encode(word.lstrip(), add_special_tokens=False))
        if not plain:
            raise InvalidRequestError(f"bad_words entry {word!r} encodes to no tokens", "bad_words")
        spaced = tuple(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        out += [ids for ids in (plain, spaced) if ids and ids not in out]
    return tuple(out)


def _token_ids(ids, vocab_size: int, field: str) -> np.ndarray:
    ids = np.asarray(sorted(set(ids)), dtype=np.int64)
    bad = ids[(ids < 0) | (ids >= vocab_size)]
    if bad.size:
        raise InvalidRequestError(
            f"{field} has token ids outside the vocabulary [0, {vocab_size}): {bad[:5].tolist()}", field
        )
    return ids.astype(np.int32)


def logits_rules(
    params: SamplingParams, prompt_ids: list, tokenizer, vocab_size: int, eos_token_ids
) -> LogitsRules | None:
    """The ``LogitsRules`` of a request, or None when ``params`` edits no logits.

    Raises:
        InvalidRequestError naming the field: token ids of ``logit_bias`` or ``allowed_token_ids`` outside
        ``[0, vocab_size)``, or a bad word that encodes to no token or to ids outside the vocabulary.
    """
    if not params.has_logits_rules:
        return None
    bias = params.logit_bias or {}
    bias_ids = _token_ids(bias, vocab_size, "logit_bias")
    allowed = None
    if params.allowed_token_ids is not None:
        ids = _token_ids(params.allowed_token_ids, vocab_size, "allowed_token_ids")
        words = np.zeros((vocab_size + 31) // 32, dtype=np.uint32)
        np.bitwise_or.at(words, ids >> 5, np.uint32(1) << (ids & 31).astype(np.uint32))
        allowed = words.view(np.int32)
    bad_words = bad_words_token_ids(params.bad_words or (), tokenizer)
    _token_ids([t for w in bad_words for t in w], vocab_size, "bad_words")
    repeat = params.repetition_penalty != 1.0
    return LogitsRules(
        repetition_penalty=float(params.repetition_penalty),
        frequency_penalty=float(params.frequency_penalty),
        presence_penalty=float(params.presence_penalty),
        prompt_ids=np.unique(np.asarray(prompt_ids, dtype=np.int32)) if repeat else np.zeros(0, np.int32),
        bias_ids=bias_ids,
        bias_values=np.array([bias[int(t)] for t in bias_ids], dtype=np.float32),
        min_tokens=params.min_tokens,
        stop_ids=np.array(sorted(set(eos_token_ids) | set(params.stop_token_ids)), dtype=np.int32),
        bad_words=bad_words,
        allowed_bitmask=allowed,
    )


@dataclass
class LogitsEdits:
    """A step's sparse logits edits for ``apply_logits_edits``; ``R`` rows, each with three segments of
    entries (CSR: entries ``start[i]:start[i + 1]`` belong to ``rows[i]``). Token ids are unique within a
    segment of a row.

    rows: int64 ``[R]``, the logits rows.
    add_start int32 ``[R + 1]``, add_ids int32, add_values float32: ``x_t += v`` (``-inf`` forbids ``t``).
    rep_start, rep_ids, repetition float32 ``[R]``: the repetition penalty of each row's listed tokens.
    count_start, count_ids, counts float32, frequency, presence float32 ``[R]``:
        ``x_t -= frequency * c_t``, then ``x_t -= presence``.
    """

    rows: np.ndarray
    add_start: np.ndarray
    add_ids: np.ndarray
    add_values: np.ndarray
    rep_start: np.ndarray
    rep_ids: np.ndarray
    repetition: np.ndarray
    count_start: np.ndarray
    count_ids: np.ndarray
    counts: np.ndarray
    frequency: np.ndarray
    presence: np.ndarray


def _banned(rules: LogitsRules, history: list) -> list:
    """Token ids forbidden after ``history``: EOS and stop ids before ``min_tokens``, and each bad word's
    last token where its other tokens end ``history``."""
    banned = list(rules.stop_ids) if len(history) < rules.min_tokens else []
    for word in rules.bad_words:
        k = len(word) - 1
        if k == 0 or (k <= len(history) and tuple(history[-k:]) == word[:-1]):
            banned.append(word[-1])
    return banned


def _cat(parts: list, dtype) -> np.ndarray:
    return np.concatenate(parts).astype(dtype, copy=False) if parts else np.zeros(0, dtype)


def _starts(sizes) -> np.ndarray:
    out = np.zeros(len(sizes) + 1, dtype=np.int32)
    np.cumsum(sizes, out=out[1:])
    return out


@nb.njit(cache=True, nogil=True)
def _penalty_entries(history, history_start, prompt, prompt_start, repeat, count):
    """Per row ``i``: repetition entries (its sorted unique prompt ids, then its history's distinct ids not
    among them) when ``repeat[i]``, count entries (the history's distinct ids and counts) when ``count[i]``."""
    num_rows = history_start.shape[0] - 1
    sorted_history = history.copy()
    for i in range(num_rows):
        sorted_history[history_start[i] : history_start[i + 1]].sort()
    rep_sizes = np.zeros(num_rows, np.int64)
    count_sizes = np.zeros(num_rows, np.int64)
    for step in range(2):  # 0: sizes, 1: fill
        if step == 1:
            rep_start = np.zeros(num_rows + 1, np.int32)
            count_start = np.zeros(num_rows + 1, np.int32)
            for i in range(num_rows):
                rep_start[i + 1] = rep_start[i] + rep_sizes[i]
                count_start[i + 1] = count_start[i] + count_sizes[i]
            rep_ids = np.empty(rep_start[num_rows], np.int32)
            count_ids = np.empty(count_start[num_rows], np.int32)
            counts = np.empty(count_start[num_rows], np.float32)
        for i in range(num_rows):
            p = prompt[prompt_start[i] : prompt_start[i + 1]]
            r = 0
            c = 0
            if repeat[i]:
                if step == 1:
                    rep_ids[rep_start[i] : rep_start[i] + p.shape[0]] = p
                r = p.shape[0]
            j = history_start[i]
            end = history_start[i + 1]
            while j < end:
                t = sorted_history[j]
                k = j
                while k < end and sorted_history[k] == t:
                    k += 1
                if repeat[i]:
                    at = np.searchsorted(p, t)
                    if at == p.shape[0] or p[at] != t:
                        if step == 1:
                            rep_ids[rep_start[i] + r] = t
                        r += 1
                if count[i]:
                    if step == 1:
                        count_ids[count_start[i] + c] = t
                        counts[count_start[i] + c] = k - j
                    c += 1
                j = k
            rep_sizes[i] = r
            count_sizes[i] = c
    return rep_start, rep_ids, count_start, count_ids, counts


def build_edits(rows: list) -> LogitsEdits | None:
    """The ``LogitsEdits`` of ``rows`` = [(logits row, LogitsRules, output token ids so far)], or None when
    they edit nothing (rows without rules may be left out). The additive entries are gathered here (bans
    are rare: a dict merge only on rows that have one); the penalties' entries in one compiled pass over
    every row's history (``_penalty_entries``)."""
    rows_out, add_ids, add_vals, prompts, histories = [], [], [], [], []
    repeat, count, repetition, frequency, presence = [], [], [], [], []
    for row, rules, history in rows:
        banned = _banned(rules, history)
        if banned:
            merged = dict(zip(rules.bias_ids.tolist(), rules.bias_values.tolist()))
            merged.update(dict.fromkeys(banned, -np.inf))
            add_ids.append(np.fromiter(merged.keys(), np.int32, len(merged)))
            add_vals.append(np.fromiter(merged.values(), np.float32, len(merged)))
        else:
            add_ids.append(rules.bias_ids)
            add_vals.append(rules.bias_values)
        repeats, counts = rules.repetition_penalty != 1.0, rules.counts_output
        prompts.append(rules.prompt_ids if repeats else rules.prompt_ids[:0])
        histories.append(history if repeats or counts else ())
        rows_out.append(row)
        repeat.append(repeats)
        count.append(counts)
        repetition.append(rules.repetition_penalty)
        frequency.append(rules.frequency_penalty)
        presence.append(rules.presence_penalty)
    sizes = [len(h) for h in histories]
    history = np.fromiter(itertools.chain.from_iterable(histories), np.int32, sum(sizes))
    rep_start, rep_ids, count_start, count_ids, counts = _penalty_entries(
        history,
        _starts(sizes),
        _cat(prompts, np.int32),
        _starts([p.size for p in prompts]),
        np.array(repeat, dtype=np.bool_),
        np.array(count, dtype=np.bool_),
    )
    add_start = _starts([a.size for a in add_ids])
    if add_start[-1] == 0 and rep_ids.size == 0 and count_ids.size == 0:
        return None
    return LogitsEdits(
        rows=np.asarray(rows_out, dtype=np.int64),
        add_start=add_start,
        add_ids=_cat(add_ids, np.int32),
        add_values=_cat(add_vals, np.float32),
        rep_start=rep_start,
        rep_ids=rep_ids,
        repetition=np.asarray(repetition, dtype=np.float32),
        count_start=count_start,
        count_ids=count_ids,
        counts=counts,
        frequency=np.asarray(frequency, dtype=np.float32),
        presence=np.asarray(presence, dtype=np.float32),
    )
