"""Structured outputs over llguidance with the default model's tokenizer: what each constraint lets
through, the bitmask layout the kernels read, forks, rollbacks, errors and the compile cache."""

import pytest

pytest.importorskip("llguidance")  # absent on some hosts (the GPU host has no package index)

import json
import re

import numpy as np

from rawpaged.errors import InvalidRequestError
from rawpaged.kernels.cpu import sampling as cpu_sampling
from rawpaged.structured_output import StructuredOutputsParams
from rawpaged.structured_output.backend_guidance import bitmask_words

pytestmark = pytest.mark.model

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}


def allowed(bitmask_row, vocab_size):
    """Token ids whose bit is set (an independent reading of the packed layout)."""
    bits = np.unpackbits(bitmask_row.view(np.uint8), bitorder="little")[:vocab_size]
    return np.flatnonzero(bits)


def walk(manager, grammar, tokenizer, rng, max_tokens=120):
    """Random allowed tokens until EOS is drawn; the text and whether EOS ended it."""
    out = []
    for _ in range(max_tokens):
        ids = allowed(manager.grammar_bitmask([grammar])[0], grammar.vocab_size)
        assert ids.size, "a matcher must always allow some token"
        # prefer ending once allowed, so that the walk terminates
        token = tokenizer.eos_token_id if tokenizer.eos_token_id in ids and rng.random() < 0.5 else int(rng.choice(ids))
        if token == tokenizer.eos_token_id:
            assert grammar.is_accepting()
            return tokenizer.decode(out), True
        assert grammar.accept_token(token), grammar.error
        out.append(token)
    return tokenizer.decode(out), False


def check_against_schema(value):
    jsonschema = pytest.importorskip("jsonschema")
    jsonschema.validate(value, SCHEMA)
    assert set(value) == {"name", "age", "tags"}
    assert isinstance(value["name"], str) and len(value["name"]) <= 12
    assert isinstance(value["age"], int) and 0 <= value["age"] <= 150
    assert isinstance(value["tags"], list) and len(value["tags"]) <= 3 and set(value["tags"]) <= {"a", "b"}


@pytest.mark.parametrize("seed", range(4))
def test_json_schema_walks_end_in_valid_compact_json(manager, tokenizer, seed):
    rng = np.random.default_rng(seed)
    grammar = manager.compile(StructuredOutputsParams(json=SCHEMA))
    text, ended = walk(manager, grammar, tokenizer, rng, max_tokens=400)
    assert ended, text
    check_against_schema(json.loads(text))
    # no free whitespace: the text is what json.dumps writes for the value
    assert text == json.dumps(json.loads(text), ensure_ascii=False) or "\\" in text


def test_json_object_regex_and_choice(manager, tokenizer):
    # any object (a random walk through it need not end: objects nest without bound)
    grammar = manager.compile(StructuredOutputsParams(json_object=True))
    assert all(grammar.accept_token(t) for t in tokenizer.encode_literal('{"a": [1, {"b": null}], "c": "d"}'))
    assert tokenizer.eos_token_id in allowed(manager.grammar_bitmask([grammar])[0], grammar.vocab_size)
    not_an_object = manager.compile(StructuredOutputsParams(json_object=True))
    assert not not_an_object.accept_token(tokenizer.encode_literal("[1]")[0])
    for seed in range(3):
        rng = np.random.default_rng(seed)
        grammar = manager.compile(StructuredOutputsParams(regex=r"[0-9]{3}-[a-z]{2,4}"))
        text, ended = walk(manager, grammar, tokenizer, rng)
        assert ended and re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", text), text
        grammar = manager.compile(StructuredOutputsParams(choice=["positive", "negative", "neutral"]))
        text, ended = walk(manager, grammar, tokenizer, rng)
        assert ended and text in ("positive", "negative", "neutral")


def test_grammar_in_lark_and_gbnf(manager, tokenizer):
    lark = 'start: "yes" | "no" | NUMBER\nNUMBER: /[1-9][0-9]?/'
    gbnf = 'root ::= "(" [a-c]+ ")"'
    for spec, pattern in ((lark, r"yes|no|[1-9][0-9]?"), (gbnf, r"\([a-c]+\)")):
        grammar = manager.compile(StructuredOutputsParams(grammar=spec))
        text, ended = walk(manager, grammar, tokenizer, np.random.default_rng(1))
        assert ended and re.fullmatch(pattern, text), text


def test_a_forbidden_token_is_refused_and_the_first_mask_is_exact(manager, tokenizer):
    grammar = manager.compile(StructuredOutputsParams(choice=["yes", "no"]))
    ids = allowed(manager.grammar_bitmask([grammar])[0], grammar.vocab_size)
    texts = {tokenizer.decode([int(t)]) for t in ids}
    assert texts and all("yes".startswith(t) or "no".startswith(t) for t in texts), texts
    assert tokenizer.eos_token_id not in ids  # nothing yet: ending now would be invalid
    assert not grammar.accept_token(tokenizer.encode_literal("maybe")[0])
    assert grammar.error


def test_fork_and_rollback_keep_independent_states(manager, tokenizer):
    grammar = manager.compile(StructuredOutputsParams(regex=r"ab(c|d)e"))
    for t in tokenizer.encode_literal("ab"):
        assert grammar.accept_token(t)
    before = manager.grammar_bitmask([grammar])[0].copy()
    fork = grammar.fork()
    c = tokenizer.encode_literal("c")
    assert len(c) == 1 and fork.accept_token(c[0])
    # the original is unaffected by its fork
    np.testing.assert_array_equal(manager.grammar_bitmask([grammar])[0], before)
    assert fork.num_processed_tokens == grammar.num_processed_tokens + 1
    # rolling the fork back gives the state it was forked from
    fork.rollback(1)
    np.testing.assert_array_equal(manager.grammar_bitmask([fork])[0], before)
    with pytest.raises(ValueError, match="roll back"):
        fork.rollback(fork.num_processed_tokens + 1)


@pytest.mark.parametrize(
    "kwargs, field, words",
    [
        (dict(json={"type": "object", "properties": {"a": {"type": "strin"}}}), "structured_outputs.json", "strin"),
        (dict(json="{not json"), "structured_outputs.json", "structured_outputs.json"),
        (dict(regex="[a-z]+("), "structured_outputs.regex", "unclosed group"),
        (dict(grammar="start: undefined_rule"), "structured_outputs.grammar", "undefined_rule"),
    ],
)
def test_a_constraint_that_does_not_compile_is_a_clear_error(manager, kwargs, field, words):
    with pytest.raises(InvalidRequestError, match=re.escape(words)) as err:
        manager.compile(StructuredOutputsParams(**kwargs))
    assert err.value.param == field and field in str(err.value)
    # the same error when compiled in the thread
    with pytest.raises(InvalidRequestError):
        manager.compile_async(StructuredOutputsParams(**kwargs)).result()


@pytest.mark.parametrize(
    "kwargs",
    [dict(), dict(regex="a", choice=["a"]), dict(choice=[]), dict(choice=["a", 1]), dict(regex=""), dict(json=3)],
)
def test_params_need_exactly_one_well_typed_kind(kwargs):
    with pytest.raises(InvalidRequestError) as err:
        StructuredOutputsParams(**kwargs)
    assert err.value.param.startswith("structured_outputs")


def test_compile_cache_is_keyed_by_the_constraint(manager):
    n = manager.num_compiled
    schema = {"type": "object", "properties": {"x": {"type": "integer"}}}
    a = manager.compile_async(StructuredOutputsParams(json=schema))
    b = manager.compile(StructuredOutputsParams(json='{"properties": {"x": {"type": "integer"}}, "type": "object"}'))
    a.result()
    assert manager.num_compiled == n + 1  # the same schema, key order aside: compiled once
    manager.compile(StructuredOutputsParams(json={"type": "object"}, disable_any_whitespace=False))
    manager.compile(StructuredOutputsParams(json={"type": "object"}))
    assert manager.num_compiled == n + 3  # whitespace rules are part of the key
    assert b is not a.result()  # each request gets its own matcher


def test_apply_token_bitmask_against_an_independent_unpacking():
    rng = np.random.default_rng(3)
    vocab = 100  # 4 words cover 128 ids; the logits are wider than the mask's 3 words below
    logits = rng.standard_normal((5, vocab)).astype(np.float32)
    bitmask = rng.integers(-(2**31), 2**31, size=(2, 3), dtype=np.int64).astype(np.int32)
    rows = np.array([3, 1])
    got = logits.copy()
    cpu_sampling.apply_token_bitmask(got, bitmask, rows)
    expected = logits.copy()
    for i, r in enumerate(rows):
        keep = np.zeros(vocab, bool)
        keep[allowed(bitmask[i], 96)] = True  # ids 96..99 are past the mask: forbidden
        expected[r, ~keep] = -np.inf
    np.testing.assert_array_equal(got, expected)
    np.testing.assert_array_equal(got[[0, 2, 4]], logits[[0, 2, 4]])  # rows without a mask untouched
    assert np.isneginf(got[3]).sum() > 0 and np.isfinite(got[3]).sum() > 0
    with pytest.raises(ValueError, match="rows"):
        cpu_sampling.apply_token_bitmask(got, bitmask, np.array([0, 5]))
    with pytest.raises(ValueError, match="bitmask"):
        cpu_sampling.apply_token_bitmask(got, bitmask.astype(np.int64), rows)


def test_bitmask_rows_and_masked_greedy_decoding(manager, tokenizer):
    """The manager's rows, through the kernel, make greedy decoding of random logits obey each matcher."""
    rng = np.random.default_rng(5)
    grammars = [manager.compile(StructuredOutputsParams(regex=r"[a-c]{3}")) for _ in range(2)]
    assert manager.allocate_bitmask(2).shape == (2, bitmask_words(tokenizer.vocab_size))
    outs = [[], []]
    for _ in range(10):
        live = [i for i in range(2) if not grammars[i].is_terminated()]
        if not live:
            break
        logits = rng.standard_normal((2, tokenizer.vocab_size)).astype(np.float32)
        cpu_sampling.apply_token_bitmask(logits, manager.grammar_bitmask([grammars[i] for i in live]), np.array(live))
        for i in live:
            token = int(np.argmax(logits[i]))
            assert grammars[i].accept_token(token)
            if token != tokenizer.eos_token_id:
                outs[i].append(token)
    for grammar, out in zip(grammars, outs):
        assert grammar.is_terminated() and re.fullmatch(r"[a-c]{3}", tokenizer.decode(out)), out
    # complete (only EOS may follow) before the EOS, terminated only after it
    g = manager.compile(StructuredOutputsParams(choice=["ab"]))
    assert all(g.accept_token(t) for t in tokenizer.encode_literal("ab"))
    assert g.is_complete() and not g.is_terminated()
    assert allowed(manager.grammar_bitmask([g])[0], g.vocab_size).tolist() == [tokenizer.eos_token_id]
    assert g.accept_token(tokenizer.eos_token_id) and g.is_terminated()


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(json={"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(600)}}), "json"),
        (dict(choice=[f"c{i}" for i in range(2001)]), "choice"),
        (dict(json={"type": "object", "properties": {"x": {"$ref": "#"}}, "required": ["x"]}), "json"),
    ],
    ids=["600-optional-properties", "2001-choices", "requires-itself"],
)
def test_a_grammar_over_the_engines_limits_is_refused_at_compile_time(manager, kwargs, field):
    """Each compiled and then failed at the first token (a 500 mid-request); now refused up front, naming
    the limit and without the parser's internal state."""
    with pytest.raises(InvalidRequestError) as err:
        manager.compile(StructuredOutputsParams(**kwargs))
    message = str(err.value)
    assert err.value.param == f"structured_outputs.{field}" and "first token" in message
    assert ("max is 2000" in message or "limit 50000" in message) and "<state>" not in message
    with pytest.raises(InvalidRequestError):  # the refusal is cached: the same answer, not compiled again
        n = manager.num_compiled
        manager.compile(StructuredOutputsParams(**kwargs))
    assert manager.num_compiled == n


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(json={"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(400)}}),
        dict(choice=[f"c{i}" for i in range(1500)]),
        dict(json={"type": "object", "properties": {"x": {"$ref": "#"}}}),  # recursive, but may stop
    ],
    ids=["400-optional-properties", "1500-choices", "optional-recursion"],
)
def test_grammars_within_the_limits_still_compile(manager, kwargs):
    grammar = manager.compile(StructuredOutputsParams(**kwargs))
    assert not grammar.error and manager.grammar_bitmask([grammar]).any()


def test_compiles_run_side_by_side_and_one_constraint_compiles_once(tokenizer):
    """A slow constraint does not hold up another; requests for the same one share its compile."""
    import threading
    import time

    from rawpaged.structured_output.manager import StructuredOutputManager

    manager = StructuredOutputManager(tokenizer)
    backend = manager.backend  # the tokenizer wrapped before timing
    real = backend.grammar_spec
    started = threading.Event()

    def grammar_spec(params):
        if params.regex == "slow":
            started.set()
            time.sleep(1.0)
        return real(params)

    backend.grammar_spec = grammar_spec
    slow = [manager.compile_async(StructuredOutputsParams(regex="slow")) for _ in range(3)]
    assert started.wait(5)
    t0 = time.perf_counter()
    manager.compile_async(StructuredOutputsParams(regex="fast")).result(timeout=5)
    assert time.perf_counter() - t0 < 0.5  # not queued behind the slow one
    for f in slow:
        f.result(timeout=5)
    assert manager.num_compiled == 2  # three requests for "slow", one compile
    manager.shutdown()


def test_a_compile_past_its_time_limit_is_refused_and_its_result_kept(tokenizer):
    import asyncio
    import time

    from rawpaged.structured_output.manager import StructuredOutputManager

    manager = StructuredOutputManager(tokenizer, compile_timeout_s=0.2)
    backend = manager.backend
    real = backend.grammar_spec
    backend.grammar_spec = lambda params: (time.sleep(0.6), real(params))[1]
    params = StructuredOutputsParams(regex="[0-9]+")
    with pytest.raises(InvalidRequestError, match=r"within 0\.2 s \(--grammar-compile-timeout\)") as err:
        asyncio.run(manager.compile_await(params))
    assert err.value.param == "structured_outputs"
    time.sleep(0.8)  # the compile went on in its thread
    assert not asyncio.run(manager.compile_await(params)).error and manager.num_compiled == 1
    manager.shutdown()


def test_a_150_level_nested_schema_compiles_and_takes_its_deep_value(manager, tokenizer):
    """Deeper than llguidance's JSON reader (128 levels): its deep subschemas move to ``$defs``."""
    schema = {"type": "string", "enum": ["x"]}
    for _ in range(150):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"], "additionalProperties": False}
    grammar = manager.compile(StructuredOutputsParams(json=schema, disable_any_whitespace=True))
    text = '{"a": ' * 150 + '"x"' + "}" * 150
    for token in tokenizer.encode_literal(text):
        assert grammar.accept_token(token), grammar.error
    assert grammar.is_accepting()
    wrong = manager.compile(StructuredOutputsParams(json=schema, disable_any_whitespace=True))
    assert not all(wrong.accept_token(t) for t in tokenizer.encode_literal('{"a": ' * 149 + '"x"}'))


def test_schemas_compile_strict_unless_the_engine_says_otherwise(manager, tokenizer):
    """An object that lists its properties refuses an unlisted key by default (xgrammar's and OpenAI's
    strict mode); with disable_additional_properties=False the letter of JSON Schema admits it."""
    from rawpaged.structured_output import StructuredOutputManager

    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    text = json.dumps({"city": "Paris", "type": "weather"})  # the compact JSON's spacing

    def accepts(m):
        grammar = m.compile(StructuredOutputsParams(json=schema))
        return all(grammar.accept_token(t) for t in tokenizer.encode_literal(text))

    assert manager.disable_additional_properties and not accepts(manager)
    loose = StructuredOutputManager(tokenizer, disable_additional_properties=False)
    try:
        assert accepts(loose)
    finally:
        loose.shutdown()
