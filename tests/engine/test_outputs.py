"""DeltaTracker (what each choice gained between cumulative outputs) and the stop-string helpers, on
hand-made outputs and sequences."""

from rawpaged.core.sequence import Sequence, SequenceStatus
from rawpaged.engine.outputs import CompletionOutput, DeltaTracker, RequestOutput
from rawpaged.engine.stop_strings import truncate_at_stop_string, visible_text
from rawpaged.sampling_params import SamplingParams


def out(*choices, finished=False):
    return RequestOutput("r", None, [1], [CompletionOutput(*c) for c in choices], finished)


def test_delta_tracker_per_choice():
    t = DeltaTracker()
    d = t.deltas(out((0, "He", [1], None, [{1: -0.1}]), (1, "", [], None, [])))
    assert [(x.index, x.text, x.token_ids, x.logprobs, x.first, x.text_offset) for x in d] == [
        (0, "He", [1], [{1: -0.1}], True, 0)
    ]  # choice 1 gained nothing yet
    d = t.deltas(out((0, "Hello", [1, 2], None, [{1: -0.1}, {2: -0.2}]), (1, "", [7], None, [{7: -1.0}])))
    assert [(x.index, x.text, x.token_ids, x.logprobs, x.first, x.text_offset) for x in d] == [
        (0, "llo", [2], [{2: -0.2}], False, 2),
        (1, "", [7], [{7: -1.0}], True, 0),
    ]
    d = t.deltas(out((0, "Hello", [1, 2], "stop", None), (1, "", [7], None, None)))
    assert [(x.index, x.text, x.token_ids, x.finish_reason) for x in d] == [(0, "", [], "stop")]
    assert t.finished(0) and not t.finished(1) and t.num_tokens(1) == 1 and t.num_tokens(5) == 0
    # A finished choice yields nothing more; the other goes on.
    d = t.deltas(out((0, "Hello!", [1, 2, 3], "stop", None), (1, "a", [7, 8], "length", None), finished=True))
    assert [(x.index, x.text, x.token_ids, x.finish_reason) for x in d] == [(1, "a", [8], "length")]


def _seq(text, stops, finished=False, emitted=0):
    s = Sequence(0, "r", 0, [1], SamplingParams(stop=stops), None, 0.0)
    s.output_text, s.num_text_emitted = text, emitted
    if finished:
        s.status = SequenceStatus.FINISHED
    return s


def test_stop_string_across_the_new_text():
    s = _seq("Emma who loved", ["o lov", "zz"])
    assert truncate_at_stop_string(s, num_new_chars=5) and s.output_text == "Emma wh"
    s = _seq("Emma who loved", ["Emma"])
    assert not truncate_at_stop_string(s, num_new_chars=3)  # the match ended before the new text
    s = _seq("abcabc", ["bc", "ca"])
    assert truncate_at_stop_string(s, num_new_chars=6) and s.output_text == "a"  # the earliest match


def test_visible_text_holds_back_a_possible_stop_string():
    assert visible_text(_seq("Hello wor", ["world"])) == "Hello"  # "wor" may begin "world": 4 chars held
    assert visible_text(_seq("Hello wor", ["world"], emitted=8)) == "Hello wo"  # never less than shown
    assert visible_text(_seq("Hello wor", ["world"], finished=True)) == "Hello wor"
    assert visible_text(_seq("Hello wor", None)) == "Hello wor"
