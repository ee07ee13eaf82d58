"""Per-request sampling parameters (names and meaning as in vLLM's ``SamplingParams``)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields

import numpy as np

from rawpaged.errors import InvalidRequestError
from rawpaged.structured_output.params import StructuredOutputsParams

#: ``logprobs`` / ``prompt_logprobs`` value asking for the whole vocabulary (vLLM's); the engine's
#: ``max_logprobs`` bounds both counts
ALL_LOGPROBS = -1
#: vLLM's thresholds: a temperature below ``SAMPLING_EPS`` is greedy; one in ``[SAMPLING_EPS, MIN_TEMPERATURE)``
#: is raised to ``MIN_TEMPERATURE`` (``logits / T`` would overflow float32).
SAMPLING_EPS = 1e-5
MIN_TEMPERATURE = 1e-2
MAX_SEED = (1 << 64) - 1


@dataclass
class SamplingParams:
    """How to pick tokens and when to stop.

    Attributes:
        n: completions returned per prompt; they share the prompt's KV blocks.
        best_of: completions generated (>= n); the n with the highest cumulative logprob are returned.
        temperature: below 1e-5 greedy (argmax); otherwise logits are divided by it (at least 1e-2, as
            vLLM raises smaller ones).
        top_p: nucleus sampling mass in (0, 1].
        top_k: keep the k most likely tokens; -1 (or 0) keeps all, as does any k >= the vocabulary.
        min_p: drop tokens whose probability is below ``min_p * p_max`` (Nguyen et al. 2024).
        seed: per-request seed in [0, 2^64); the same seed gives the same tokens whatever the request is
            batched with.
        max_tokens: generated tokens at most (>= 1).
        stop: strings that end generation; not included in the text; found across token boundaries.
        stop_token_ids: token ids that end generation (besides EOS unless ``ignore_eos``).
        include_stop_str_in_output: keep the stop string, or the text of the stop token, at the end of
            the output (vLLM's field; such text is then streamed as it comes, not held back).
        ignore_eos: keep going after EOS.
        logprobs: number of top logprobs to return per generated token (>= 0; -1: the whole vocabulary), or
            None. The engine refuses more than its ``max_logprobs`` (default 20) when the request is added.
        use_beam_search / beam_width / length_penalty: beam search (score = cumulative logprob /
            generated_length ** length_penalty, as in HF transformers; any finite length_penalty).
        structured_outputs: a ``StructuredOutputsParams`` (or the dict of its fields): the output follows
            a JSON Schema, regex, choice or grammar (``rawpaged.structured_output``); not with beam search.
        presence_penalty, frequency_penalty: in [-2, 2] (OpenAI's ranges); each token id ``t`` already
            generated ``c_t > 0`` times has ``frequency_penalty * c_t + presence_penalty`` subtracted from
            its logit (OpenAI's definition; vLLM ``model_executor/layers/utils.py`` ``apply_penalties``).
        repetition_penalty: > 0 (1 is off); each token id in the prompt or the output so far has a positive
            logit divided by it and a negative one multiplied by it (Keskar et al. 2019, CTRL eq. 1 as
            transformers' ``RepetitionPenaltyLogitsProcessor`` and vLLM apply it).
        logit_bias: ``{token id: bias}``, bias in [-100, 100], added to those logits (OpenAI's parameter).
        min_tokens: EOS and ``stop_token_ids`` are forbidden, and stop strings not looked for, until this
            many tokens were generated (<= ``max_tokens``).
        bad_words: words never generated: each is tokenized with and without a leading space, and the last
            token of such a sequence is forbidden wherever the output so far ends with the others (vLLM's
            ``bad_words``).
        allowed_token_ids: only these token ids may be generated (a non-empty list).
        prompt_logprobs: number of top logprobs to return per prompt token (as ``logprobs``; plus the prompt
            token's own), or None; the first prompt token has none. Such a request reads no prefix cache.
        The order on the logits is vLLM's: allowed_token_ids, bad_words, min_tokens, logit_bias, then the
        repetition, frequency and presence penalties, then temperature and the filters above. Logprobs are
        of the raw logits, before any of them.
    Raises:
        InvalidRequestError (a ValueError) on any invalid value; its message starts with the field's name
        and its ``param`` is that name.
    """

    n: int = 1
    best_of: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int = 16
    stop: list | str | None = None
    stop_token_ids: list | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    use_beam_search: bool = False
    beam_width: int | None = None
    length_penalty: float = 1.0
    structured_outputs: StructuredOutputsParams | dict | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict | None = None
    min_tokens: int = 0
    bad_words: list | None = None
    allowed_token_ids: list | None = None
    prompt_logprobs: int | None = None
    stop_strings: list = field(init=False, repr=False, default_factory=list)

    def __post_init__(self):
        def bad(name, why):
            raise InvalidRequestError(f"{name} {why}, got {getattr(self, name)!r}", name)

        def is_int(v):
            return isinstance(v, int) and not isinstance(v, bool)

        def is_num(v):  # a finite int or float
            return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)

        if not is_int(self.n) or self.n < 1:
            bad("n", "must be an integer >= 1")
        if self.best_of is None:
            self.best_of = self.n
        if not is_int(self.best_of) or self.best_of < self.n:
            bad("best_of", f"must be an integer >= n ({self.n})")
        if not is_num(self.temperature) or not 0.0 <= self.temperature <= 100.0:
            bad("temperature", "must be a number in [0, 100]")
        if self.temperature < SAMPLING_EPS:
            self.temperature = 0.0
        elif self.temperature < MIN_TEMPERATURE:
            self.temperature = MIN_TEMPERATURE
        if not is_num(self.top_p) or not 0.0 < self.top_p <= 1.0:
            bad("top_p", "must be in (0, 1]")
        if not is_int(self.top_k) or self.top_k < -1:
            bad("top_k", "must be -1 (disabled), 0 (disabled) or a positive integer")
        if not is_num(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            bad("min_p", "must be in [0, 1]")
        if self.seed is not None and (not is_int(self.seed) or not 0 <= self.seed <= MAX_SEED):
            bad("seed", "must be an integer in [0, 2^64) or None")
        if not is_int(self.max_tokens) or self.max_tokens < 1:
            bad("max_tokens", "must be an integer >= 1")
        if isinstance(self.stop, str):
            self.stop_strings = [self.stop]
        elif isinstance(self.stop, (list, tuple)) and all(isinstance(s, str) for s in self.stop):
            self.stop_strings = list(self.stop)
        elif self.stop is not None:
            bad("stop", "must be a string or a list of strings")
        if any(s == "" for s in self.stop_strings):
            bad("stop", "must not contain empty strings")
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        if not isinstance(self.stop_token_ids, (list, tuple)) or not all(
            is_int(t) and t >= 0 for t in self.stop_token_ids
        ):
            bad("stop_token_ids", "must be a list of non-negative integers")
        if not isinstance(self.ignore_eos, bool):
            bad("ignore_eos", "must be a boolean")
        if not isinstance(self.include_stop_str_in_output, bool):
            bad("include_stop_str_in_output", "must be a boolean")
        if self.logprobs is not None and (not is_int(self.logprobs) or self.logprobs < ALL_LOGPROBS):
            bad("logprobs", "must be an integer >= 0, -1 (the whole vocabulary) or None")
        if self.beam_width is not None:
            if not is_int(self.beam_width) or self.beam_width < 1:
                bad("beam_width", "must be an integer >= 1")
            self.use_beam_search = True
        if self.use_beam_search:
            if self.beam_width is None:
                self.beam_width = max(self.n, 2)
            if self.n > self.beam_width:
                bad("n", f"must be <= beam_width ({self.beam_width}) with beam search")
        if not is_num(self.length_penalty):
            bad("length_penalty", "must be a finite number")
        self._check_logits_rules(bad, is_int, is_num)
        if isinstance(self.structured_outputs, dict):
            known = {f.name for f in fields(StructuredOutputsParams)}
            unknown = sorted(set(self.structured_outputs) - known, key=str)
            if unknown:
                raise InvalidRequestError(
                    f"structured_outputs has unknown fields {unknown}; it takes {sorted(known)}", "structured_outputs"
                )
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        if self.structured_outputs is not None:
            if not isinstance(self.structured_outputs, StructuredOutputsParams):
                bad("structured_outputs", "must be a StructuredOutputsParams or a dict of its fields")
            if self.use_beam_search:
                raise InvalidRequestError(
                    "structured_outputs cannot be combined with beam search", "structured_outputs"
                )

    def _check_logits_rules(self, bad, is_int, is_num) -> None:
        """The penalties, logit_bias, min_tokens, bad_words, allowed_token_ids and prompt_logprobs (token ids
        are checked against the vocabulary when the request is queued)."""
        for name in ("presence_penalty", "frequency_penalty"):
            if not is_num(getattr(self, name)) or not -2.0 <= getattr(self, name) <= 2.0:
                bad(name, "must be a number in [-2, 2]")
        with np.errstate(over="ignore"):  # a value past float32's range becomes inf: refused just below
            as_float32 = float(np.float32(self.repetition_penalty)) if is_num(self.repetition_penalty) else 0.0
        if not 0.0 < as_float32 < math.inf:
            bad("repetition_penalty", "must be a finite number > 0 (as a float32: the kernels' type)")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                bad("logit_bias", "must be a dict of token id -> bias")
            for token, bias in self.logit_bias.items():
                if not is_int(token) or token < 0:
                    raise InvalidRequestError(f"logit_bias key {token!r} is not a token id", "logit_bias")
                if not is_num(bias) or not -100.0 <= bias <= 100.0:
                    raise InvalidRequestError(
                        f"logit_bias value for token {token} must be a number in [-100, 100], got {bias!r}",
                        "logit_bias",
                    )
        if not is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            bad("min_tokens", f"must be an integer in [0, max_tokens ({self.max_tokens})]")
        if isinstance(self.bad_words, str):
            self.bad_words = [self.bad_words]
        if self.bad_words is not None and (
            not isinstance(self.bad_words, (list, tuple))
            or not all(isinstance(w, str) and w.strip() for w in self.bad_words)
        ):
            bad("bad_words", "must be a list of non-empty strings")
        if self.allowed_token_ids is not None and (
            not isinstance(self.allowed_token_ids, (list, tuple))
            or not self.allowed_token_ids
            or not all(is_int(t) and t >= 0 for t in self.allowed_token_ids)
        ):
            bad("allowed_token_ids", "must be a non-empty list of token ids")
        if self.prompt_logprobs is not None and (
            not is_int(self.prompt_logprobs) or self.prompt_logprobs < ALL_LOGPROBS
        ):
            bad("prompt_logprobs", "must be an integer >= 0, -1 (the whole vocabulary) or None")
        if self.use_beam_search and self.prompt_logprobs is not None:
            bad("prompt_logprobs", "cannot be combined with beam search")

    @property
    def has_logits_rules(self) -> bool:
        """Whether any of the penalties, logit_bias, min_tokens, bad_words or allowed_token_ids apply."""
        return bool(
            self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1.0
            or self.logit_bias
            or self.min_tokens
            or self.bad_words
            or self.allowed_token_ids is not None
        )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
