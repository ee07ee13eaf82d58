"""Stop strings (``SamplingParams.stop``): found across token boundaries in the detokenized text, cut
from the output, and never streamed, since text that could begin one is held back while the sequence runs
(vLLM's semantics)."""

from __future__ import annotations


def find_stop_string(text: str, stops: list, start: int) -> tuple | None:
    """``(index, stop string)`` of the earliest stop string found in ``text[start:]``, or None."""
    found = None
    for s in stops:
        i = text.find(s, start)
        if i != -1 and (found is None or i < found[0]):
            found = (i, s)
    return found


def cut_at_stop_string(text: str, found: tuple, include: bool) -> str:
    """``text`` up to the stop string ``found`` (``find_stop_string``), or through it with ``include``."""
    i, s = found
    return text[: i + len(s)] if include else text[:i]


def truncate_at_stop_string(seq, num_new_chars: int) -> bool:
    """If a stop string ends inside the last ``num_new_chars`` characters of ``seq.output_text``, cut the
    text at the earliest such match (after it with ``include_stop_str_in_output``) and return True."""
    params = seq.sampling_params
    text = seq.output_text
    stops = params.stop_strings
    found = find_stop_string(text, stops, max(0, len(text) - num_new_chars - max(len(s) for s in stops) + 1))
    if found is None:
        return False
    seq.output_text = cut_at_stop_string(text, found, params.include_stop_str_in_output)
    return True


def visible_text(seq) -> str:
    """The text safe to show: while the sequence runs, a tail that could begin a stop string is held
    back (never less than what was already shown)."""
    stops = seq.sampling_params.stop_strings
    if seq.is_finished or not stops or seq.sampling_params.include_stop_str_in_output:
        return seq.output_text
    hold = max(len(s) for s in stops) - 1
    return seq.output_text[: max(seq.num_text_emitted, len(seq.output_text) - hold)]
