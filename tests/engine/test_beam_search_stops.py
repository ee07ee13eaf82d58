"""Beam search stops as sampling does: ``stop`` strings (found across token boundaries and cut from the
text), ``stop_token_ids`` (the token's text left out) and ``include_stop_str_in_output`` (both kept).
On the default model the greedy answer and the 3-beam answer to "The capital of Germany is" are both
" Berlin." followed by more text, so each stop gives the same text by both paths."""

from __future__ import annotations

import pytest

from rawpaged import SamplingParams
from rawpaged.engine import beam_search
from tests.conftest import tiny_engine

PROMPT = "The capital of Germany is"


@pytest.mark.parametrize("beam", [False, True], ids=["sampling", "beam"])
@pytest.mark.parametrize("include", [False, True], ids=["cut", "included"])
@pytest.mark.parametrize("how", ["stop", "stop_token_ids"])
def test_stops_end_beams_as_they_end_samples(llm, beam, include, how):
    dot = llm.tokenizer.encode_literal(".")
    assert len(dot) == 1
    stop = {"stop": ["."]} if how == "stop" else {"stop_token_ids": dot}
    params = SamplingParams(
        temperature=0.0,
        max_tokens=12,
        use_beam_search=beam,
        beam_width=3 if beam else None,
        include_stop_str_in_output=include,
        **stop,
    )
    out = llm.generate([PROMPT], params)[0].outputs[0]
    assert out.text == (" Berlin." if include else " Berlin"), out
    assert out.finish_reason == "stop"
    assert out.token_ids[-1] == dot[0]


def test_without_a_stop_the_search_runs_past_the_period(llm):
    params = SamplingParams(max_tokens=12, use_beam_search=True, beam_width=3)
    out = llm.generate([PROMPT], params)[0].outputs[0]
    assert out.text.startswith(" Berlin.") and len(out.text) > len(" Berlin."), out
    assert out.finish_reason == "length"


@pytest.mark.parametrize("include", [False, True])
def test_every_hypothesis_is_cut_at_its_stop_string(tiny_dir, include):
    llm = tiny_engine(tiny_dir)
    plain = SamplingParams(max_tokens=24, use_beam_search=True, beam_width=4, n=4, ignore_eos=True)
    texts = [o.text for o in llm.generate(["hello there"], plain)[0].outputs]
    # stop strings taken from the middle of the unstopped hypotheses' texts, so some must fire
    stops = sorted({t[len(t) // 2 : len(t) // 2 + 2] for t in texts if len(t) > 4})
    params = SamplingParams(
        max_tokens=24,
        use_beam_search=True,
        beam_width=4,
        n=4,
        ignore_eos=True,
        stop=stops,
        include_stop_str_in_output=include,
    )
    outs = llm.generate(["hello there"], params)[0].outputs
    tok = llm.tokenizer
    fired = 0
    for o in outs:
        full = tok.decode(o.token_ids)
        if o.finish_reason == "stop":
            fired += 1
            hit = [s for s in stops if s in full]
            assert hit, (o, stops)
            first = min(full.find(s) for s in hit)
            s = next(s for s in hit if full.find(s) == first)
            assert o.text == (full[: first + len(s)] if include else full[:first]), (o, s)
            # the stop string ends in the last token's text: it did not fire earlier
            assert not any(s in tok.decode(o.token_ids[:-1]) for s in stops)
        else:
            assert not any(s in full for s in stops) and o.text == full
    assert fired > 0
    assert llm.engine.kv_cache_manager.block_pool.num_free_blocks == llm.engine.kv_cache_manager.num_blocks


def test_the_stop_string_finder_sees_strings_across_token_boundaries(tiny_dir):
    llm = tiny_engine(tiny_dir)
    tok = llm.tokenizer
    ids = tok.encode_literal("ab cd e")

    class Beam:
        output_token_ids = ids[:-1]

    find = beam_search.stop_string_finder(["d e", "zz"], [Beam()], tok)
    assert "d e" in tok.decode(ids) and "d e" not in tok.decode(ids[:-1])  # it spans the last two tokens
    assert find(0, ids[-1]) == "d e"
    assert beam_search.stop_string_finder(["ab"], [Beam()], tok)(0, ids[-1]) is None  # already there before
