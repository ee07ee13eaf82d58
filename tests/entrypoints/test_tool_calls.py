"""Tool calls without a server: the parsers (Hermes ``<tool_call>`` blocks for ``"auto"``, the constrained
JSON of ``"required"`` and named functions), the grammar a forced call is generated under (random walks
through it must end in calls valid against the tools' schemas), and how tools reach the chat template,
natively (Qwen2.5) or written into the system message (SmolLM2)."""

from __future__ import annotations

import pytest

pytest.importorskip("pydantic")  # absent on some hosts (the GPU host has no package index)
pytest.importorskip("jsonschema")  # absent on some hosts (the GPU host has no package index)

import json

import jsonschema
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from rawpaged.entrypoints.generation.chat_utils import template_conversation, tools_system_prompt
from rawpaged.entrypoints.generation.request_body import parse_request
from rawpaged.entrypoints.generation.tool_parsers import (
    ForcedToolParser,
    HermesToolParser,
    extract_tool_calls,
    forced_tool_schema,
)
from rawpaged.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from rawpaged.entrypoints.server.config import Limits
from rawpaged.structured_output import StructuredOutputsParams
from rawpaged.structured_output.json_schema import no_additional_properties
from rawpaged.tokenizer import Tokenizer
from tests.structured_output.test_guidance import walk
from tests.tokenizer_files import tokenizer_dir

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 20},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
CLOCK = {"type": "function", "function": {"name": "get_time"}}  # no parameters: an empty parameter list
# parameters with a $ref into their own $defs, as pydantic writes them
MOVE = {
    "type": "function",
    "function": {
        "name": "move",
        "parameters": {
            "type": "object",
            "properties": {"to": {"$ref": "#/$defs/Place"}},
            "required": ["to"],
            "additionalProperties": False,
            "$defs": {
                "Place": {
                    "type": "object",
                    "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}},
                    "required": ["x", "y"],
                    "additionalProperties": False,
                }
            },
        },
    },
}
TOOLS = [WEATHER, CLOCK, MOVE]
SCHEMAS = {
    "get_weather": WEATHER["function"]["parameters"],
    "get_time": {"type": "object", "maxProperties": 0},
    "move": MOVE["function"]["parameters"],
}


def call(name, arguments):
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


def plain(calls):
    """Tool calls without their random ids."""
    return [(c["type"], c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


# ------------------------------------------------------------------------------------------ Hermes
@pytest.mark.parametrize(
    "text, content, calls",
    [
        ("Just text, with < and <tool and spaces  \n", "Just text, with < and <tool and spaces  \n", []),
        (call("get_time", {}), None, [("function", "get_time", {})]),
        (
            "Let me look.\n\n"
            + call("get_weather", {"city": "Paris", "unit": "celsius"})
            + "\n"
            + call("get_time", {}),
            "Let me look.",
            [("function", "get_weather", {"city": "Paris", "unit": "celsius"}), ("function", "get_time", {})],
        ),
        (
            '<tool_call>{"name": "get_time", "parameters": {"tz": "UTC"}}',
            None,
            [("function", "get_time", {"tz": "UTC"})],
        ),
        ("x <tool_call>{not json}</tool_call> y", "x <tool_call>{not json}</tool_call> y", []),
        ('<tool_call>{"arguments": {}}</tool_call>', '<tool_call>{"arguments": {}}</tool_call>', []),
        ('a <tool_call>{"name": "get_ti', 'a <tool_call>{"name": "get_ti', []),  # cut off: content, as written
        ("before " + call("get_time", {}) + "\n after\n", "before\nafter", [("function", "get_time", {})]),
        # an argument that holds the markup: read by the JSON's structure, not by the first closing tag
        (
            call("run", {"code": 'print("</tool_call>")'}) + call("run", {"code": "<tool_call>{}"}),
            None,
            [("function", "run", {"code": 'print("</tool_call>")'}), ("function", "run", {"code": "<tool_call>{}"})],
        ),
        (
            '<tool_call>{"name": "run", "arguments": {"s": "a\\"</tool_call>"}}</tool_call>',
            None,
            [("function", "run", {"s": 'a"</tool_call>'})],
        ),
        # not a call: content through the first closing tag after its JSON, then parsing goes on
        (
            '<tool_call>{"name": "run"} junk</tool_call>' + call("get_time", {}),
            '<tool_call>{"name": "run"} junk</tool_call>',
            [("function", "get_time", {})],
        ),
        # a JSON that never ends: the block ends at its first closing tag, as before
        (
            '<tool_call>{"name": "get_ti</tool_call>' + call("get_time", {}),
            '<tool_call>{"name": "get_ti</tool_call>',
            [("function", "get_time", {})],
        ),
    ],
)
def test_hermes_parser_separates_content_and_calls(text, content, calls):
    got_content, got_calls = extract_tool_calls(HermesToolParser(), text)
    assert got_content == content and plain(got_calls) == calls
    assert all(c["id"].startswith("call_") and len(c["id"]) == 29 for c in got_calls)
    assert len({c["id"] for c in got_calls}) == len(got_calls)


@pytest.mark.parametrize("parallel", [None, True, False])
def test_parallel_tool_calls_false_keeps_the_first_call_with_auto(parallel):
    text = "Let me look.\n\n" + call("get_weather", {"city": "Paris"}) + "\n" + call("get_time", {}) + "\nDone."
    body = {"messages": CONVERSATION, "tools": TOOLS, "tool_choice": "auto"}
    if parallel is not None:
        body["parallel_tool_calls"] = parallel
    req = parse_request(ChatCompletionRequest, body, Limits())
    content, calls = extract_tool_calls(req.tool_parser(), text)
    names = [c["function"]["name"] for c in calls]
    assert names == (["get_weather"] if parallel is False else ["get_weather", "get_time"])
    assert content == "Let me look.\nDone."


PIECES = [
    "Sure",
    ". ",
    "\n",
    "<",
    "tool",
    "_call",
    ">",
    "\n",
    '{"name": ',
    '"get_time"',
    ', "arguments": {}}',
    "</tool_",
    "call>",
    " ",
    "a<b",
    " <tool_call>",
    "oops",
    "</tool_call>",
    '{"name": "run", "arguments": {"code": "',
    '\\"',
    '"}}',
]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from(PIECES), max_size=24), st.data())
def test_hermes_streamed_in_any_pieces_equals_the_whole_parse(pieces, data):
    text = "".join(pieces)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=12)))
    chunks = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    parser, content, calls = HermesToolParser(), "", []
    for chunk in chunks:
        d = parser.feed(chunk)
        content, calls = content + d.content, calls + d.tool_calls
    d = parser.finish()
    content, calls = content + d.content, calls + d.tool_calls
    whole_content, whole_calls = extract_tool_calls(HermesToolParser(), text)
    assert content == (whole_content or "")
    assert [(c["index"], c["function"]["name"], c["function"]["arguments"]) for c in calls] == [
        (i, c["function"]["name"], c["function"]["arguments"]) for i, c in enumerate(whole_calls)
    ]
    assert parser.num_calls == len(whole_calls)
    if "<tool_call>" not in text:
        assert content == text, "text without a call passes through unchanged"


# ------------------------------------------------------------------------------------------ forced
def test_named_call_streams_its_arguments():
    parser = ForcedToolParser("get_weather")
    first = parser.feed('{"city":')
    second = parser.feed('"Oslo","unit":"celsius"}')
    assert first.tool_calls[0]["function"] == {"name": "get_weather", "arguments": '{"city":'}
    assert first.tool_calls[0]["id"].startswith("call_") and first.tool_calls[0]["type"] == "function"
    assert second.tool_calls == [{"index": 0, "function": {"arguments": '"Oslo","unit":"celsius"}'}}]
    assert not parser.finish() and parser.finish_reason("stop") == "tool_calls"
    assert parser.finish_reason("length") == "length"
    content, calls = extract_tool_calls(ForcedToolParser("get_time"), "{}")
    assert content is None and plain(calls) == [("function", "get_time", {})]


def test_required_calls_come_whole_at_the_end_and_a_cut_output_is_content():
    text = '[{"name":"get_time","arguments":{}},{"name":"get_weather","arguments":{"city":"Rome","unit":"celsius"}}]'
    parser = ForcedToolParser(None)
    assert not parser.feed(text)
    assert plain(extract_tool_calls(ForcedToolParser(None), text)[1]) == [
        ("function", "get_time", {}),
        ("function", "get_weather", {"city": "Rome", "unit": "celsius"}),
    ]
    cut = ForcedToolParser(None)
    assert extract_tool_calls(cut, text[:30]) == (text[:30], []) and cut.finish_reason("length") == "length"
    assert extract_tool_calls(ForcedToolParser(None), '[{"name":"get_time"}]')[1] == []


@pytest.mark.model
@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("name, parallel", [(None, True), (None, False), ("get_weather", True)])
def test_random_walks_through_the_forced_grammar_are_valid_calls(manager, tokenizer, name, parallel, seed):
    grammar = manager.compile(StructuredOutputsParams(json=forced_tool_schema(TOOLS, name, parallel)))
    text, ended = walk(manager, grammar, tokenizer, np.random.default_rng(seed), max_tokens=400)
    assert ended, text
    parser = ForcedToolParser(name)
    content, calls = extract_tool_calls(parser, text)
    assert content is None and calls and parser.finish_reason("stop") == "tool_calls", text
    assert parallel or len(calls) == 1
    for c in calls:
        assert c["function"]["name"] == (name or c["function"]["name"]) and c["function"]["name"] in SCHEMAS
        strict = no_additional_properties(SCHEMAS[c["function"]["name"]])  # what the grammar enforces
        jsonschema.validate(json.loads(c["function"]["arguments"]), strict)


@pytest.mark.model
def test_the_forced_grammar_refuses_an_unknown_name_and_bad_arguments(manager, tokenizer):
    def accepts(text, name=None):
        grammar = manager.compile(StructuredOutputsParams(json=forced_tool_schema(TOOLS, name)))
        return all(grammar.accept_token(t) for t in tokenizer.encode_literal(text))

    # compact JSON is json.dumps's default layout: ", " and ": " (StructuredOutputsParams.disable_any_whitespace)
    assert accepts(json.dumps([{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}]))
    assert not accepts(json.dumps([{"name": "get_wether", "arguments": {}}]))
    assert not accepts(json.dumps([{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "kelvin"}}]))
    assert not accepts("[]")
    assert accepts(json.dumps({"city": "Oslo", "unit": "fahrenheit"}), "get_weather")
    assert not accepts(json.dumps({"city": "Oslo"}) + "}", "get_weather")
    assert accepts(json.dumps([{"name": "move", "arguments": {"to": {"x": 1, "y": 2}}}]))  # $refs resolve
    assert not accepts(json.dumps([{"name": "move", "arguments": {"to": {"x": 1}}}]))
    assert accepts(json.dumps([{"name": "get_time", "arguments": {}}]))
    assert not accepts(json.dumps([{"name": "get_time", "arguments": {"tz": "UTC"}}]))


# ------------------------------------------------------------------------------------------ templates
CONVERSATION = [
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"},
    {"role": "tool", "tool_call_id": "call_2", "content": "12:00"},
]


def conversation_messages():
    req = parse_request(ChatCompletionRequest, {"messages": CONVERSATION, "tools": TOOLS}, Limits())
    return req.template_messages(), req.template_tools()


def test_tool_calls_reach_the_template_with_their_arguments_as_objects():
    messages, tools = conversation_messages()
    assert messages[1] == {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
        ],
    }
    assert messages[2] == {"role": "tool", "content": "18 C, sunny", "tool_call_id": "call_1"}
    assert tools == TOOLS


def test_qwen2_5_renders_tools_calls_and_answers_itself():
    tok = Tokenizer(tokenizer_dir("qwen2_5"))
    assert tok.supports_tools
    messages, tools = conversation_messages()
    assert template_conversation(messages, tools, tok.supports_tools) == (messages, tools)
    text, ids = tok.encode_chat(messages, True, None, tools)
    # The template's text, followed by hand through its Jinja (tojson: keys in order, not HTML-escaped).
    expected = (
        "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.\n\n# Tools\n\n"
        "You may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
        + "\n".join(json.dumps(t) for t in TOOLS)
        + "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
        '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}'
        "\n</tool_call><|im_end|>\n"
        "<|im_start|>user\nWeather in Paris?<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
        "<|im_end|>\n"
        "<|im_start|>user\n<tool_response>\n18 C, sunny\n</tool_response>\n<tool_response>\n12:00\n</tool_response>"
        "<|im_end|>\n<|im_start|>assistant\n"
    )
    assert text == expected
    assert tok.decode(ids, skip_special_tokens=False) == text


@pytest.mark.model
def test_smollm2_gets_the_tools_in_its_system_message(tokenizer):
    assert not tokenizer.supports_tools
    messages, tools = conversation_messages()
    rendered, no_tools = template_conversation(messages, tools, tokenizer.supports_tools)
    assert no_tools is None
    assert rendered == [
        {"role": "system", "content": tools_system_prompt(TOOLS)},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": call("get_weather", {"city": "Paris"})},
        {
            "role": "user",
            "content": "<tool_response>\n18 C, sunny\n</tool_response>\n<tool_response>\n12:00\n</tool_response>",
        },
    ]
    prompt = tools_system_prompt(TOOLS)
    assert all(json.dumps(t) in prompt for t in TOOLS) and "<tool_call>" in prompt
    # an existing system message keeps its text first
    with_system, _ = template_conversation([{"role": "system", "content": "Be brief."}, *messages], tools, False)
    assert with_system[0] == {"role": "system", "content": "Be brief.\n\n" + prompt}
    text, _ = tokenizer.encode_chat(rendered)
    assert text.startswith("<|im_start|>system\n# Tools") and "You are a helpful AI assistant" not in text
    # the Hermes parser reads back the call the conversation shows
    assert plain(extract_tool_calls(HermesToolParser(), rendered[2]["content"])[1]) == [
        ("function", "get_weather", {"city": "Paris"})
    ]
