"""Stop strings (``SamplingParams.stop``): found across token boundaries in the detokenized text, cut
from the output, and never streamed, since text that could begin one is held back while the sequence runs
(vLLM's semantics)."""

from __future__ import annotations


def truncate_at_stop_string(seq, num_new_chars: int) -> bool:
    """If a stop string ends inside the last ``num_new_chars`` characters of ``seq.output_text``, cut the
    text at the earliest such match and return True."""
    text = seq.output_text
    stops = seq.sampling_params.stop_strings
    start = max(0, len(text) - num_new_chars - max(len(s) for s in stops) + 1)
    cut = None
    for s in stops:
        i = text.find(s, start)
        if i != -1 and (cut is None or i < cut):
            cut = i
    if cut is None:
        return False
    seq.output_text = text[:cut]
    return True


def visible_text(seq) -> str:
    """The text safe to show: while the sequence runs, a tail that could begin a stop string is held
    back (never less than what was already shown)."""
    stops = seq.sampling_params.stop_strings
    if seq.is_finished or not stops:
        return seq.output_text
    hold = max(len(s) for s in stops) - 1
    return seq.output_text[: max(seq.num_text_emitted, len(seq.output_text) - hold)]
