"""Incremental detokenization: streams text from token ids without broken UTF-8 characters, repeats or
drops.

Same windowing as vLLM's ``detokenize_incrementally``: decode ``ids[prefix_offset:]`` and
``ids[prefix_offset:read_offset]``; the new text is the difference, held back while it ends in an
incomplete character (U+FFFD from a partial byte sequence). The state lives on the sequence
(``output_text``, ``prefix_offset``, ``read_offset``), so a fork continues from its parent's.
"""

from __future__ import annotations

from rawpaged.tokenizer import Tokenizer


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer

    def step(self, seq, end: int | None = None) -> str:
        """Append the text of ``seq.output_token_ids[:end]`` (all of them by default) that became final;
        return the new piece."""
        ids = seq.output_token_ids if end is None else seq.output_token_ids[:end]
        prefix_text = self.tokenizer.decode(ids[seq.prefix_offset : seq.read_offset])
        full_text = self.tokenizer.decode(ids[seq.prefix_offset :])
        if len(full_text) > len(prefix_text) and not full_text.endswith("\ufffd"):
            new = full_text[len(prefix_text) :]
            seq.prefix_offset = seq.read_offset
            seq.read_offset = len(ids)
            seq.output_text += new
            return new
        return ""

    def flush(self, seq) -> None:
        """At the end, append any text held back because it ended in an incomplete character."""
        ids = seq.output_token_ids
        tail = self.tokenizer.decode(ids[seq.prefix_offset :])
        head = self.tokenizer.decode(ids[seq.prefix_offset : seq.read_offset])
        seq.output_text += tail[len(head) :]
        seq.prefix_offset = seq.read_offset = len(ids)
