"""The llguidance grammar engine (https://github.com/guidance-ai/llguidance; vLLM's ``guidance`` backend).

``GuidanceBackend`` wraps the model's tokenizer once (llguidance reads the ``tokenizers`` JSON directly,
no transformers) and turns a ``StructuredOutputsParams`` into a validated grammar; ``GuidanceGrammar``
is one sequence's matcher over it.
"""

from __future__ import annotations

import json

import llguidance
import numpy as np

from rawpaged.errors import InvalidRequestError
from rawpaged.structured_output.json_schema import hoist_deep_subschemas, no_additional_properties
from rawpaged.structured_output.params import StructuredOutputsParams

#: llguidance's JSON options when free whitespace is disabled: fixed separators, as ``json.dumps``
#: writes them
_COMPACT_JSON = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
#: first tokens the compile-time probe tries (``GuidanceBackend.probe``): the parser's limits are hit when
#: the first token's row is expanded, which happens for any of them
PROBE_FIRST_TOKENS = 16


def _limits():
    """The parser's default limits (llguidance's ``ParserLimits``), with errors that name the limit but
    not the parser's internal state (which a client should not see)."""
    return llguidance.LLParserLimits(verbose_errors=False)


def bitmask_words(vocab_size: int) -> int:
    """int32 words of one row of a token bitmask: ``ceil(vocab_size / 32)``."""
    return (vocab_size + 31) // 32


def fill_bitmasks_parallel(grammars: list, bitmask: np.ndarray, executor) -> None:
    """Row ``i`` of ``bitmask`` (C-contiguous int32 ``[len(grammars), words]``) for ``grammars[i]``, the
    rows computed on ``executor`` (an ``llguidance.LLExecutor``, its own thread pool; the mask of a fresh
    state walks the token trie, ~1 ms for a 49k vocabulary).

    Raises:
        ValueError when the bitmask's shape or dtype does not fit.
    """
    if bitmask.dtype != np.int32 or not bitmask.flags.c_contiguous or bitmask.shape[0] != len(grammars):
        raise ValueError(f"bitmask must be a C-contiguous int32 [{len(grammars)}, words] array")
    pairs = [(g._matcher, i) for i, g in enumerate(grammars)]
    executor.unsafe_compute_mask_ptr(pairs, bitmask.ctypes.data, bitmask.shape[1] * 4, bitmask.shape[0])


class GuidanceBackend:
    """Grammars over one tokenizer.

    Args:
        tokenizer: the model's ``rawpaged.tokenizer.Tokenizer`` (its ``tokenizers`` JSON and EOS id).
        vocab_size: the model's logits width, when larger than the tokenizer's (padded embeddings);
            ids past the tokenizer's are never allowed.
        eos_token_ids: the ids that end generation (default: the tokenizer's EOS); a complete output
            allows exactly these.
        disable_additional_properties: JSON Schemas compile strict
            (``json_schema.no_additional_properties``: an object that lists its properties admits no
            other key unless it says so); False: by the letter of JSON Schema.
    """

    def __init__(
        self, tokenizer, vocab_size: int | None = None, eos_token_ids=None, disable_additional_properties: bool = True
    ):
        self.disable_additional_properties = disable_additional_properties
        eos = sorted(eos_token_ids) if eos_token_ids else tokenizer.eos_token_id
        self.llg_tokenizer = llguidance.LLTokenizer(tokenizer.to_json(), n_vocab=vocab_size, eos_token=eos)
        self.vocab_size = self.llg_tokenizer.vocab_size
        self.eos_token_ids = frozenset(self.llg_tokenizer.eos_tokens)
        self.executor = llguidance.LLExecutor()  # computes several rows' masks in parallel

    def grammar_spec(self, params: StructuredOutputsParams) -> str:
        """The llguidance grammar (its JSON text) for ``params``, validated against the tokenizer.

        Raises:
            InvalidRequestError naming ``structured_outputs.<kind>`` when the schema, expression or
            grammar does not compile (the message is llguidance's, which says where and why).
        """
        kind = params.kind
        field = f"structured_outputs.{kind}"
        try:
            if kind in ("json", "json_object"):
                schema = {"type": "object"} if kind == "json_object" else params.json
                if isinstance(schema, str):
                    try:
                        schema = json.loads(schema)
                    except (ValueError, RecursionError):
                        pass  # llguidance says what is wrong with it
                if not isinstance(schema, str):
                    if kind == "json" and self.disable_additional_properties:
                        schema = no_additional_properties(schema)
                    schema = hoist_deep_subschemas(schema)  # deeper than llguidance's JSON reader goes
                text = schema if isinstance(schema, str) else json.dumps(schema)
                spec = llguidance.LLMatcher.grammar_from_json_schema(
                    text, defaults=_COMPACT_JSON if params.disable_any_whitespace else None
                )
            elif kind == "regex":
                spec = llguidance.LLMatcher.grammar_from_regex(params.regex)
            elif kind == "choice":
                spec = llguidance.grammar_from("choice", json.dumps(list(params.choice)))
            else:
                spec = llguidance.grammar_from("grammar", params.grammar)
        except (ValueError, TypeError, RuntimeError) as e:
            raise InvalidRequestError(f"{field} does not compile: {e}", field) from None
        message = llguidance.LLMatcher.validate_grammar(spec, self.llg_tokenizer, limits=_limits())
        if message:
            raise InvalidRequestError(f"{field} does not compile: {message}", field)
        self.probe(spec, field)
        return spec

    def probe(self, spec: str, field: str) -> None:
        """Run the grammar's first steps at compile time, so that a grammar over one of the parser's limits
        (a row of more than 2000 alternatives: hundreds of optional properties, a long ``choice`` list) or
        one that no finite output satisfies (a schema that requires itself) is refused before anything
        runs, not at the first token: the first token's mask, then, for up to ``PROBE_FIRST_TOKENS`` of the
        tokens it allows, that token consumed and the next mask.

        Raises:
            InvalidRequestError naming ``field`` and the limit.
        """
        words = bitmask_words(self.vocab_size)
        matcher = llguidance.LLMatcher(self.llg_tokenizer, spec, log_level=0, limits=_limits())
        first = np.zeros(words, dtype=np.int32)
        matcher.unsafe_compute_mask_ptr(first.ctypes.data, first.nbytes)
        self._check_probe(matcher, field)
        allowed = np.flatnonzero(np.unpackbits(first.view(np.uint8), bitorder="little")[: self.vocab_size])
        if len(allowed) == 0 and not matcher.is_accepting():
            raise InvalidRequestError(f"{field} allows no output at all", field)
        step = np.zeros(words, dtype=np.int32)
        picks = allowed[np.linspace(0, len(allowed) - 1, min(len(allowed), PROBE_FIRST_TOKENS)).astype(int)]
        for token in dict.fromkeys(int(t) for t in picks):
            branch = matcher.deep_copy()
            branch.consume_token(token)
            if not branch.is_error() and not branch.is_stopped():
                branch.unsafe_compute_mask_ptr(step.ctypes.data, step.nbytes)
            self._check_probe(branch, field)

    @staticmethod
    def _check_probe(matcher, field: str) -> None:
        if matcher.is_error():
            error = matcher.get_error().replace("<non-verbose/>", "").strip().split("; consider")[0]
            raise InvalidRequestError(
                f"{field} is refused: the grammar engine stops at its first token ({error}); a grammar this "
                "large, or one that no finite output satisfies, cannot run",
                field,
            )

    def grammar(self, spec: str) -> GuidanceGrammar:
        """A fresh matcher for a spec from ``grammar_spec``."""
        matcher = llguidance.LLMatcher(self.llg_tokenizer, spec, log_level=0, limits=_limits())
        return GuidanceGrammar(matcher, self.vocab_size, self.eos_token_ids)


class GuidanceGrammar:
    """One sequence's matcher: which tokens may come next, given the tokens it accepted.

    Its bitmask row has bit ``t % 32`` of int32 word ``t // 32`` set when token ``t`` is allowed (EOS is
    the only token allowed once the output is complete).
    """

    def __init__(self, matcher, vocab_size: int, eos_token_ids: frozenset = frozenset()):
        self._matcher = matcher
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.num_processed_tokens = 0
        self._ended = False  # an EOS was accepted

    def fill_bitmask(self, bitmask: np.ndarray, index: int) -> None:
        """Write the allowed next tokens into row ``index`` of ``bitmask`` (C-contiguous int32
        ``[rows, bitmask_words(vocab_size)]``).

        Raises:
            ValueError when the bitmask's shape or dtype does not fit.
        """
        if bitmask.dtype != np.int32 or bitmask.ndim != 2 or not bitmask.flags.c_contiguous:
            raise ValueError("bitmask must be a C-contiguous int32 [rows, words] array")
        if bitmask.shape[1] != bitmask_words(self.vocab_size) or not 0 <= index < bitmask.shape[0]:
            raise ValueError(f"bitmask {bitmask.shape} does not fit row {index} of a {self.vocab_size}-token mask")
        row = bitmask[index]
        self._matcher.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)

    def accept_token(self, token_id: int) -> bool:
        """Advance by one sampled token; False when the grammar forbids it (the matcher is then in error,
        for good)."""
        ok = self._matcher.consume_token(int(token_id))
        if ok:
            self.num_processed_tokens += 1
            self._ended = int(token_id) in self.eos_token_ids
        return ok

    def rollback(self, num_tokens: int) -> None:
        """Forget the last ``num_tokens`` accepted tokens."""
        if not 0 <= num_tokens <= self.num_processed_tokens or not self._matcher.rollback(num_tokens):
            raise ValueError(f"cannot roll back {num_tokens} of {self.num_processed_tokens} tokens")
        self.num_processed_tokens -= num_tokens
        self._ended = self._ended and num_tokens == 0

    def fork(self) -> GuidanceGrammar:
        """An independent copy in the same state (a new sample of ``n > 1``, a beam)."""
        copy = GuidanceGrammar(self._matcher.deep_copy(), self.vocab_size, self.eos_token_ids)
        copy.num_processed_tokens = self.num_processed_tokens
        copy._ended = self._ended
        return copy

    def is_terminated(self) -> bool:
        """True once an EOS has been accepted: the output is over, the grammar constrains nothing more."""
        return self._ended

    def is_complete(self) -> bool:
        """True when the output is complete: only an EOS may come next."""
        return self._matcher.is_stopped()

    def is_accepting(self) -> bool:
        """True when the tokens so far form a complete output (more may still be allowed)."""
        return self._matcher.is_accepting()

    @property
    def error(self) -> str:
        """The matcher's error ("" when none)."""
        return self._matcher.get_error() if self._matcher.is_error() else ""
