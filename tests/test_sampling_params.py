"""SamplingParams: every rule at its boundary (the value just inside is accepted, the one just outside
refused with the exact message and ``param``), booleans are not numbers, the defaults and what the
constructor derives (best_of, stop strings, beam width, vLLM's temperature thresholds)."""

import math

import pytest

from rawpaged.errors import InvalidRequestError
from rawpaged.sampling_params import MAX_SEED, MIN_TEMPERATURE, SAMPLING_EPS, SamplingParams

REFUSED = [
    # (kwargs, param, message)
    (dict(n=0), "n", "n must be an integer >= 1, got 0"),
    (dict(n=1.0), "n", "n must be an integer >= 1, got 1.0"),
    (dict(n=True), "n", "n must be an integer >= 1, got True"),
    (dict(n=2, best_of=1), "best_of", "best_of must be an integer >= n (2), got 1"),
    (dict(best_of=2.0), "best_of", "best_of must be an integer >= n (1), got 2.0"),
    (dict(temperature=-1e-9), "temperature", "temperature must be a number in [0, 100], got -1e-09"),
    (dict(temperature=100.000001), "temperature", "temperature must be a number in [0, 100], got 100.000001"),
    (dict(temperature=math.nan), "temperature", "temperature must be a number in [0, 100], got nan"),
    (dict(temperature=math.inf), "temperature", "temperature must be a number in [0, 100], got inf"),
    (dict(temperature=True), "temperature", "temperature must be a number in [0, 100], got True"),
    (dict(temperature="1"), "temperature", "temperature must be a number in [0, 100], got '1'"),
    (dict(top_p=0.0), "top_p", "top_p must be in (0, 1], got 0.0"),
    (dict(top_p=1.0000001), "top_p", "top_p must be in (0, 1], got 1.0000001"),
    (dict(top_p=math.nan), "top_p", "top_p must be in (0, 1], got nan"),
    (dict(top_p=True), "top_p", "top_p must be in (0, 1], got True"),
    (dict(top_k=-2), "top_k", "top_k must be -1 (disabled), 0 (disabled) or a positive integer, got -2"),
    (dict(top_k=5.0), "top_k", "top_k must be -1 (disabled), 0 (disabled) or a positive integer, got 5.0"),
    (dict(top_k=True), "top_k", "top_k must be -1 (disabled), 0 (disabled) or a positive integer, got True"),
    (dict(min_p=-1e-9), "min_p", "min_p must be in [0, 1], got -1e-09"),
    (dict(min_p=1.0000001), "min_p", "min_p must be in [0, 1], got 1.0000001"),
    (dict(min_p=-math.inf), "min_p", "min_p must be in [0, 1], got -inf"),
    (dict(min_p=False), "min_p", "min_p must be in [0, 1], got False"),
    (dict(seed=-1), "seed", "seed must be an integer in [0, 2^64) or None, got -1"),
    (dict(seed=MAX_SEED + 1), "seed", f"seed must be an integer in [0, 2^64) or None, got {MAX_SEED + 1}"),
    (dict(seed=1.0), "seed", "seed must be an integer in [0, 2^64) or None, got 1.0"),
    (dict(seed=True), "seed", "seed must be an integer in [0, 2^64) or None, got True"),
    (dict(max_tokens=0), "max_tokens", "max_tokens must be an integer >= 1, got 0"),
    (dict(max_tokens=2.0), "max_tokens", "max_tokens must be an integer >= 1, got 2.0"),
    (dict(max_tokens=True), "max_tokens", "max_tokens must be an integer >= 1, got True"),
    (dict(stop=5), "stop", "stop must be a string or a list of strings, got 5"),
    (dict(stop=["a", 1]), "stop", "stop must be a string or a list of strings, got ['a', 1]"),
    (dict(stop={"a"}), "stop", "stop must be a string or a list of strings, got {'a'}"),
    (dict(stop=""), "stop", "stop must not contain empty strings, got ''"),
    (dict(stop=["a", ""]), "stop", "stop must not contain empty strings, got ['a', '']"),
    (dict(stop_token_ids=[-1]), "stop_token_ids", "stop_token_ids must be a list of non-negative integers, got [-1]"),
    (dict(stop_token_ids=[1.0]), "stop_token_ids", "stop_token_ids must be a list of non-negative integers, got [1.0]"),
    (
        dict(stop_token_ids=[True]),
        "stop_token_ids",
        "stop_token_ids must be a list of non-negative integers, got [True]",
    ),
    (dict(stop_token_ids=3), "stop_token_ids", "stop_token_ids must be a list of non-negative integers, got 3"),
    (dict(ignore_eos=1), "ignore_eos", "ignore_eos must be a boolean, got 1"),
    (dict(logprobs=-2), "logprobs", "logprobs must be an integer >= 0, -1 (the whole vocabulary) or None, got -2"),
    (dict(logprobs=1.0), "logprobs", "logprobs must be an integer >= 0, -1 (the whole vocabulary) or None, got 1.0"),
    (dict(logprobs=True), "logprobs", "logprobs must be an integer >= 0, -1 (the whole vocabulary) or None, got True"),
    (dict(beam_width=0), "beam_width", "beam_width must be an integer >= 1, got 0"),
    (dict(beam_width=2.0), "beam_width", "beam_width must be an integer >= 1, got 2.0"),
    (dict(beam_width=True), "beam_width", "beam_width must be an integer >= 1, got True"),
    (dict(n=3, beam_width=2), "n", "n must be <= beam_width (2) with beam search, got 3"),
    (dict(n=3, use_beam_search=True, beam_width=2), "n", "n must be <= beam_width (2) with beam search, got 3"),
    (dict(length_penalty=math.inf), "length_penalty", "length_penalty must be a finite number, got inf"),
    (dict(length_penalty="1"), "length_penalty", "length_penalty must be a finite number, got '1'"),
    (dict(length_penalty=True), "length_penalty", "length_penalty must be a finite number, got True"),
]


@pytest.mark.parametrize("kwargs, param, message", REFUSED)
def test_refused_values_name_the_field_exactly(kwargs, param, message):
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(**kwargs)
    assert str(e.value) == message and e.value.param == param
    assert isinstance(e.value, ValueError)


@pytest.mark.parametrize("kwargs", [
    dict(n=1), dict(n=3, best_of=3), dict(temperature=0.0), dict(temperature=100.0), dict(temperature=100),
    dict(top_p=1.0), dict(top_p=1e-9), dict(top_k=-1), dict(top_k=0), dict(top_k=1), dict(top_k=1 << 70),
    dict(min_p=0.0), dict(min_p=1.0), dict(seed=0), dict(seed=MAX_SEED), dict(max_tokens=1),
    dict(stop_token_ids=[0]), dict(logprobs=0), dict(logprobs=20), dict(logprobs=-1), dict(logprobs=21),
    dict(prompt_logprobs=-1), dict(beam_width=1), dict(n=2, beam_width=2),
    dict(length_penalty=-1e308), dict(length_penalty=0), dict(stop=("a", "b")), dict(stop_token_ids=(1, 2)),
])  # fmt: skip
def test_boundary_values_are_accepted(kwargs):
    SamplingParams(**kwargs)


def test_defaults():
    p = SamplingParams()
    assert (p.n, p.best_of, p.temperature, p.top_p, p.top_k, p.min_p, p.seed, p.max_tokens) == (
        1,
        1,
        1.0,
        1.0,
        -1,
        0.0,
        None,
        16,
    )
    assert (p.stop, p.stop_strings, p.stop_token_ids, p.ignore_eos, p.logprobs) == (None, [], [], False, None)
    assert (p.use_beam_search, p.beam_width, p.length_penalty, p.greedy) == (False, None, 1.0, False)


def test_derived_fields():
    assert SamplingParams(n=3).best_of == 3 and SamplingParams(n=2, best_of=5).best_of == 5
    assert SamplingParams(stop="x").stop_strings == ["x"] and SamplingParams(stop=("a", "b")).stop_strings == ["a", "b"]
    beam = SamplingParams(beam_width=3)
    assert beam.use_beam_search and beam.beam_width == 3
    assert SamplingParams(use_beam_search=True).beam_width == 2  # at least two beams
    assert SamplingParams(n=4, use_beam_search=True).beam_width == 4
    assert not SamplingParams(use_beam_search=False).use_beam_search


def test_temperature_thresholds():
    assert SamplingParams(temperature=SAMPLING_EPS * 0.999).temperature == 0.0
    assert SamplingParams(temperature=SAMPLING_EPS).temperature == MIN_TEMPERATURE
    assert SamplingParams(temperature=MIN_TEMPERATURE * 0.999).temperature == MIN_TEMPERATURE
    assert SamplingParams(temperature=MIN_TEMPERATURE).temperature == MIN_TEMPERATURE
    assert SamplingParams(temperature=0.5).temperature == 0.5
    assert SamplingParams(temperature=0).greedy and not SamplingParams(temperature=MIN_TEMPERATURE).greedy


def test_structured_outputs_from_a_dict_and_its_refusals():
    from rawpaged.structured_output.params import StructuredOutputsParams

    p = SamplingParams(structured_outputs={"regex": "[ab]+"})
    assert p.structured_outputs == StructuredOutputsParams(regex="[ab]+")
    same = StructuredOutputsParams(choice=["x", "y"])
    assert SamplingParams(structured_outputs=same).structured_outputs is same
    with pytest.raises(InvalidRequestError, match=r"unknown fields \['pattern'\]; it takes \[") as e:
        SamplingParams(structured_outputs={"pattern": "a", "regex": "b"})
    assert e.value.param == "structured_outputs" and "'regex'" in str(e.value)
    with pytest.raises(InvalidRequestError, match="StructuredOutputsParams or a dict") as e:
        SamplingParams(structured_outputs="[ab]+")
    assert e.value.param == "structured_outputs"
    with pytest.raises(InvalidRequestError, match="cannot be combined with beam search") as e:
        SamplingParams(structured_outputs={"regex": "a"}, use_beam_search=True, beam_width=2)
    assert e.value.param == "structured_outputs"
