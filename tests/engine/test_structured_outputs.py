"""Structured outputs through the engine on the default model: every choice of a constrained request
follows its constraint (sampled, forked, greedy, preempted and recomputed mid-JSON), unconstrained
requests beside it are unchanged, and bad constraints are refused before anything is queued."""

import json
import re

import pytest

from rawpaged import LLM, SamplingParams
from rawpaged.errors import InvalidRequestError

pytestmark = pytest.mark.model

SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20}, "population": {"type": "integer", "minimum": 0}},
    "required": ["city", "population"],
    "additionalProperties": False,
}
PROMPT = "Give the largest city of France and its population as JSON."


def check_city(text):
    value = json.loads(text)
    pytest.importorskip("jsonschema").validate(value, SCHEMA)
    assert set(value) == {"city", "population"}, value
    assert isinstance(value["city"], str) and len(value["city"]) <= 20
    assert isinstance(value["population"], int) and value["population"] >= 0


def assert_pool_empty(llm):
    s = llm.stats()
    assert s["num_free_blocks"] == s["num_total_blocks"], s
    llm.engine.kv_cache_manager.check_invariants()


def test_json_schema_for_n_sampled_choices(llm):
    params = SamplingParams(n=3, temperature=0.8, seed=3, max_tokens=200, structured_outputs={"json": SCHEMA})
    out = llm.generate([PROMPT], params)[0]
    assert len(out.outputs) == 3
    for choice in out.outputs:
        assert choice.finish_reason == "stop", choice.text
        check_city(choice.text)
    assert len({c.text for c in out.outputs}) > 1  # each fork followed its own samples
    assert_pool_empty(llm)


def test_regex_choice_and_an_unconstrained_neighbour(llm):
    free = SamplingParams(temperature=0.0, max_tokens=12)
    alone = llm.generate(["The capital of Italy is"], free)[0].outputs[0].token_ids
    outs = llm.generate(
        [PROMPT, "Is the sky blue? Answer:", "The capital of Italy is"],
        [
            SamplingParams(temperature=0.0, max_tokens=40, structured_outputs={"regex": r"[A-Z][a-z]+, [0-9]{1,8}"}),
            SamplingParams(temperature=0.7, seed=1, max_tokens=10, structured_outputs={"choice": ["yes", "no"]}),
            free,
        ],
    )
    assert re.fullmatch(r"[A-Z][a-z]+, [0-9]{1,8}", outs[0].outputs[0].text), outs[0].outputs[0].text
    assert outs[0].outputs[0].finish_reason == "stop"
    assert outs[1].outputs[0].text in ("yes", "no")
    assert outs[2].outputs[0].token_ids == alone  # a constrained neighbour changes nothing
    assert_pool_empty(llm)


def test_max_tokens_cuts_an_incomplete_json_with_length(llm):
    params = SamplingParams(temperature=0.0, max_tokens=5, structured_outputs={"json": SCHEMA})
    choice = llm.generate([PROMPT], params)[0].outputs[0]
    assert choice.finish_reason == "length" and choice.text.startswith('{"city": "')
    with pytest.raises(ValueError):
        json.loads(choice.text)


def test_ignore_eos_goes_on_unconstrained_after_the_output_ends(llm):
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, structured_outputs={"choice": ["yes"]})
    choice = llm.generate(["Is the sky blue? Answer:"], params)[0].outputs[0]
    assert choice.finish_reason == "length" and len(choice.token_ids) == 8
    assert choice.text.startswith("yes") and choice.token_ids[1] in llm.engine.eos_token_ids


def test_preemption_mid_json_keeps_every_output_valid(model_dir, llm):
    """A pool too small for all of them: sequences are preempted mid-JSON and recomputed; the matcher's
    state is that of the kept tokens, so each output is what the large pool gives."""
    prompts = [PROMPT] + [f"Describe {c} as JSON." for c in ("Lyon", "Marseille", "Nice", "Lille", "Brest")]
    long_schema = {  # outputs long enough to outgrow the pool
        "type": "object",
        "properties": {"city": {"type": "string"}, "history": {"type": "string", "minLength": 60, "maxLength": 80}},
        "required": ["city", "history"],
        "additionalProperties": False,
    }
    params = SamplingParams(temperature=0.0, max_tokens=60, structured_outputs={"json": long_schema})
    expected = [o.outputs[0].text for o in llm.generate(prompts, params)]
    longest = max(len(llm.generate([p], SamplingParams(max_tokens=1))[0].prompt_token_ids) for p in prompts)
    small = LLM(
        model=str(model_dir),
        device="cpu",
        num_kv_blocks=-(-(longest + 60) // 16) + 3,
        max_model_len=1024,
        enable_prefix_caching=False,
    )
    got = [o.outputs[0] for o in small.generate(prompts, params)]
    assert small.stats()["num_preemptions"] > 0
    assert [c.text for c in got] == expected
    for c in got:  # cut by max_tokens or complete, a prefix of valid compact JSON for the schema
        assert c.text.startswith('{"city": "')
        if c.finish_reason == "stop":
            value = json.loads(c.text)
            pytest.importorskip("jsonschema").validate(value, long_schema)
            assert set(value) == {"city", "history"} and 60 <= len(value["history"]) <= 80
    assert_pool_empty(small)


@pytest.mark.parametrize(
    "structured, param",
    [
        ({"json": {"type": "object", "properties": {"a": {"type": "strin"}}}}, "structured_outputs.json"),
        ({"regex": "(unclosed"}, "structured_outputs.regex"),
        ({"regex": "a", "choice": ["a"]}, "structured_outputs"),
        ({"regexp": "a"}, "structured_outputs"),
    ],
)
def test_bad_constraints_are_refused_and_nothing_is_queued(llm, structured, param):
    with pytest.raises(InvalidRequestError) as err:
        llm.engine.add_request(PROMPT, SamplingParams(structured_outputs=structured))
    assert err.value.param == param
    assert not llm.engine.has_unfinished_requests()


def test_beam_search_with_a_constraint_is_refused():
    with pytest.raises(InvalidRequestError, match="beam search") as err:
        SamplingParams(use_beam_search=True, structured_outputs={"choice": ["a", "b"]})
    assert err.value.param == "structured_outputs" and "StructuredOutputsParams(" not in str(err.value)
