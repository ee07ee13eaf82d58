"""Request parsing without a server or model: JSON types (strict), OpenAI's and the server's own rules,
the engine's range checks reported under the client's field names, and what a request turns into
(``SamplingParams``, prompts, chat messages)."""

import pytest

pytest.importorskip("pydantic")  # absent on some hosts (the GPU host has no package index)

import json

from rawpaged.entrypoints.generation.request_body import parse_request
from rawpaged.entrypoints.generation.tool_requests import ToolRequest
from rawpaged.entrypoints.http.errors import ProtocolError
from rawpaged.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from rawpaged.entrypoints.openai.completion.protocol import CompletionRequest
from rawpaged.entrypoints.server.config import Limits
from rawpaged.entrypoints.websocket.protocol import WebSocketGenerateRequest
from rawpaged.sampling_params import SamplingParams

LIMITS = Limits(max_tokens=512, max_n=16, max_prompts=4)
HI = [{"role": "user", "content": "hi"}]
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


def refused(model, body) -> ProtocolError:
    with pytest.raises(ProtocolError) as e:
        parse_request(model, body, LIMITS)
    assert e.value.status == 400 and e.value.message
    return e.value


@pytest.mark.parametrize(
    "body, param",
    [
        ({"prompt": "hi", "max_tokens": "many"}, "max_tokens"),  # JSON types, strictly
        ({"prompt": "hi", "max_tokens": 2.0}, "max_tokens"),
        ({"prompt": "hi", "temperature": True}, "temperature"),
        ({"prompt": "hi", "temperature": "0.5"}, "temperature"),
        ({"prompt": "hi", "n": True}, "n"),
        ({"prompt": "hi", "stop": 5}, "stop"),
        ({"prompt": "hi", "stop": ["a", 1]}, "stop"),
        ({"prompt": "hi", "stop_token_ids": [1.5]}, "stop_token_ids"),
        ({"prompt": "hi", "stream_options": {"include_usage": "yes"}}, "stream_options"),
        ({"prompt": [1, "a"]}, "prompt"),
        ({"prompt": None}, "prompt"),
        ({}, "prompt"),
        ({"prompt": "hi", "max_tokens": 0}, "max_tokens"),  # the engine's ranges
        ({"prompt": "hi", "temperature": -0.5}, "temperature"),
        ({"prompt": "hi", "top_p": 0}, "top_p"),
        ({"prompt": "hi", "top_k": -2}, "top_k"),
        ({"prompt": "hi", "min_p": 1.5}, "min_p"),
        ({"prompt": "hi", "n": 0}, "n"),
        ({"prompt": "hi", "n": 2, "best_of": 1}, "best_of"),
        ({"prompt": "hi", "logprobs": -2}, "logprobs"),
        ({"prompt": "hi", "stop": ["ok", ""]}, "stop"),
        ({"prompt": "hi", "stop_token_ids": [-1]}, "stop_token_ids"),
        ({"prompt": "hi", "max_tokens": 513}, "max_tokens"),  # the server's limits and OpenAI's rules
        ({"prompt": "hi", "n": 17}, "n"),
        ({"prompt": "hi", "best_of": 17}, "best_of"),
        ({"prompt": "hi", "seed": 1 << 64}, "seed"),
        ({"prompt": "hi", "stop": ["x"] * 17}, "stop"),
        ({"prompt": "hi", "stream_options": {"include_usage": True}}, "stream_options"),
        ({"prompt": "hi", "n": 1, "best_of": 2, "stream": True}, "best_of"),
        ({"prompt": "hi", "use_beam_search": True, "stream": True}, "use_beam_search"),
        ({"prompt": "hi", "length_penalty": 2.0}, "length_penalty"),
        ({"prompt": "hi", "presence_penalty": 2.5}, "presence_penalty"),
        ({"prompt": "hi", "frequency_penalty": -2.01}, "frequency_penalty"),
        ({"prompt": "hi", "repetition_penalty": 0}, "repetition_penalty"),
        ({"prompt": "hi", "logit_bias": {"five": 1}}, "logit_bias"),
        ({"prompt": "hi", "logit_bias": {"5": 101}}, "logit_bias"),
        ({"prompt": "hi", "logit_bias": {"5": "1"}}, "logit_bias"),
        ({"prompt": "hi", "min_tokens": 8, "max_tokens": 4}, "min_tokens"),
        ({"prompt": "hi", "min_tokens": -1}, "min_tokens"),
        ({"prompt": "hi", "bad_words": "x"}, "bad_words"),
        ({"prompt": "hi", "bad_words": [" "]}, "bad_words"),
        ({"prompt": "hi", "allowed_token_ids": []}, "allowed_token_ids"),
        ({"prompt": "hi", "prompt_logprobs": -2}, "prompt_logprobs"),
        ({"prompt": "hi", "suffix": "end"}, "suffix"),
        ({"prompt": "hi", "tools": [TOOL]}, "tools"),  # chat only
        ({"prompt": "hi", "response_format": {"type": "xml"}}, "response_format"),
        ({"prompt": "hi", "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
        (
            {"prompt": "hi", "response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
            "response_format",
        ),
        ({"prompt": "hi", "structured_outputs": {"regexp": "a"}}, "structured_outputs"),
        ({"prompt": "hi", "structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
        ({"prompt": "hi", "structured_outputs": "a"}, "structured_outputs"),
        ({"prompt": "hi", "structured_outputs": {"choice": ["a"]}, "use_beam_search": True}, "structured_outputs"),
        ({"prompt": ""}, "prompt"),
        ({"prompt": []}, "prompt"),
        ({"prompt": ["a", ""]}, "prompt"),
        ({"prompt": ["a"] * 5}, "prompt"),
    ],
)
def test_completion_refusals_name_the_field(body, param):
    assert refused(CompletionRequest, body).param == param


@pytest.mark.parametrize(
    "body, param",
    [
        ({"messages": "hi"}, "messages"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages"),
        ({"messages": [{"role": "user"}]}, "messages"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, "messages"),
        ({"messages": HI, "logprobs": "yes"}, "logprobs"),
        ({"messages": HI, "top_logprobs": 2}, "top_logprobs"),
        ({"messages": HI, "logprobs": True, "top_logprobs": -2}, "top_logprobs"),
        ({"messages": HI, "max_completion_tokens": -1}, "max_completion_tokens"),
        ({"messages": HI, "max_completion_tokens": 513}, "max_completion_tokens"),
        ({"messages": HI, "max_tokens": 0}, "max_tokens"),
        ({"messages": HI, "tools": [{"type": "function"}]}, "tools"),
        ({"messages": HI, "tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools"),
        ({"messages": HI, "tools": [{"type": "retrieval", "function": {"name": "f"}}]}, "tools"),
        ({"messages": HI, "tools": [TOOL, TOOL]}, "tools"),
        ({"messages": HI, "tool_choice": "required"}, "tool_choice"),
        ({"messages": HI, "tools": [TOOL], "tool_choice": "sometimes"}, "tool_choice"),
        (
            {"messages": HI, "tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "g"}}},
            "tool_choice",
        ),
        (
            {"messages": HI, "tools": [TOOL], "tool_choice": "required", "response_format": {"type": "json_object"}},
            "tool_choice",
        ),
        ({"messages": HI, "tools": [TOOL], "tool_choice": "required", "use_beam_search": True}, "tool_choice"),
        ({"messages": HI, "functions": [{"name": "f"}]}, "functions"),
        ({"messages": [{"role": "tool", "content": "42"}]}, "messages"),  # no tool_call_id
        ({"messages": [{"role": "user", "content": "x", "tool_calls": []}]}, "messages"),
        ({"messages": [{"role": "assistant", "tool_calls": [{"id": "c", "function": {"name": "f"}}]}]}, "messages"),
    ],
)
def test_chat_refusals_name_the_field(body, param):
    e = refused(ChatCompletionRequest, body)
    assert e.param == param
    if param.startswith("max_"):
        assert e.message.startswith(param)  # the engine's message, under the client's name


def test_body_level_errors_have_no_param():
    e = refused(CompletionRequest, b"{not json")
    assert e.param is None and "not valid JSON" in e.message
    e = refused(CompletionRequest, b"[1, 2]")
    assert e.param is None and "JSON object" in e.message


def test_completion_request_becomes_prompts_and_sampling_params():
    req = parse_request(
        CompletionRequest,
        json.dumps(
            {
                "prompt": [[1, 2], [3]],
                "max_tokens": 7,
                "temperature": 0,
                "top_k": 5,
                "n": 2,
                "seed": -1,
                "stop": "x",
                "stop_token_ids": [9],
                "ignore_eos": True,
                "logprobs": 3,
                "echo": True,
                "unknown_field": "ignored",
            }
        ).encode(),
        LIMITS,
    )
    assert req.prompts(LIMITS) == [[1, 2], [3]] and req.echo and req.kind == "completion"
    assert req.requested_max_tokens == 7 and req.num_choices == 2 and req.num_logprobs == 3
    p = req.sampling_params(7)
    assert p == SamplingParams(
        n=2,
        temperature=0.0,
        top_k=5,
        seed=(1 << 64) - 1,
        stop="x",
        stop_token_ids=[9],
        ignore_eos=True,
        logprobs=3,
        prompt_logprobs=3,  # echo with logprobs scores the prompt too
        max_tokens=7,
    )
    assert parse_request(CompletionRequest, {"prompt": "a"}, LIMITS).sampling_params(16).temperature == 1.0
    assert parse_request(CompletionRequest, {"prompt": [5, 6]}, LIMITS).prompts(LIMITS) == [[5, 6]]


def test_beam_search_parameters():
    req = parse_request(
        CompletionRequest,
        {"prompt": "a", "n": 2, "best_of": 3, "use_beam_search": True, "length_penalty": 0.5, "temperature": 0.9},
        LIMITS,
    )
    p = req.sampling_params(4)
    assert (p.use_beam_search, p.beam_width, p.n, p.temperature, p.length_penalty) == (True, 3, 2, 0.0, 0.5)
    p = parse_request(CompletionRequest, {"prompt": "a", "use_beam_search": True}, LIMITS).sampling_params(4)
    assert p.beam_width == 2 and p.n == 1


def test_chat_request_messages_and_logprobs():
    req = parse_request(
        ChatCompletionRequest,
        {
            "messages": [
                {"role": "developer", "content": [{"type": "text", "text": "be "}, {"type": "text", "text": "brief"}]},
                {"role": "assistant", "content": None},
                {"role": "user", "content": "hi", "name": "me"},
            ],
            "max_tokens": 9,
            "max_completion_tokens": 5,
            "logprobs": True,
            "top_logprobs": 2,
        },
        LIMITS,
    )
    assert req.template_messages() == [
        {"role": "system", "content": "be brief"},
        {"role": "assistant", "content": ""},
        {"role": "user", "content": "hi", "name": "me"},
    ]
    assert (req.requested_max_tokens, req.max_tokens_param, req.num_logprobs) == (5, "max_completion_tokens", 2)
    assert req.kind == "chat" and req.prompt_param == "messages"
    plain = parse_request(
        ChatCompletionRequest, {"messages": HI, "stream": True, "stream_options": {"include_usage": True}}, LIMITS
    )
    assert plain.num_logprobs is None and plain.requested_max_tokens is None and plain.include_usage


def test_websocket_generate():
    req = parse_request(WebSocketGenerateRequest, {"prompt": "hi", "logprobs": 2, "n": 2}, LIMITS)
    assert req.kind == "completion" and req.prompts(LIMITS) == ["hi"] and req.num_logprobs == 2
    chat = parse_request(WebSocketGenerateRequest, {"messages": HI}, LIMITS)
    assert chat.kind == "chat" and chat.prompt_param == "messages" and chat.template_messages() == HI
    for body in ({}, {"prompt": "a", "messages": HI}):
        assert refused(WebSocketGenerateRequest, body).param == "prompt"
    assert refused(WebSocketGenerateRequest, {"prompt": ["a", "b"]}).param == "prompt"
    assert refused(WebSocketGenerateRequest, {"prompt": "a", "temperature": -1}).param == "temperature"


def test_tool_choice_picks_the_parser_and_the_constraint():
    tools = [TOOL, {"type": "function", "function": {"name": "g"}}]

    def chat(**kw):
        return parse_request(ChatCompletionRequest, {"messages": HI, **kw}, LIMITS)

    plain = chat()
    assert plain.tool_mode == "none" and plain.tool_parser() is None and plain.template_tools() is None
    assert chat(tools=tools, tool_choice="none").tool_parser() is None
    auto = chat(tools=tools)
    assert auto.tool_mode == "auto" and type(auto.tool_parser()).__name__ == "HermesToolParser"
    assert auto.structured_outputs_fields() is None and auto.template_tools()[1] == {
        "type": "function",
        "function": {"name": "g"},
    }
    required = chat(tools=tools, tool_choice="required", parallel_tool_calls=False)
    schema = required.sampling_params(8).structured_outputs.json
    assert schema["type"] == "array" and schema["maxItems"] == 1
    calls = schema["items"]["anyOf"]
    assert [c["properties"]["name"] for c in calls] == [{"const": "f"}, {"const": "g"}]
    assert [c["properties"]["arguments"] for c in calls] == [{"$ref": "#/$defs/f"}, {"$ref": "#/$defs/g"}]
    no_parameters = {"type": "object", "properties": {}, "additionalProperties": False}  # OpenAI: no arguments
    assert schema["$defs"] == {"f": {"type": "object"}, "g": no_parameters}
    named = chat(tools=tools, tool_choice={"type": "function", "function": {"name": "f"}})
    assert named.tool_mode == "named" and named.sampling_params(8).structured_outputs.json == {"type": "object"}
    assert (
        chat(tools=tools, tool_choice={"type": "function", "function": {"name": "g"}})
        .sampling_params(8)
        .structured_outputs.json
        == no_parameters
    )
    bad = chat(
        tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "strin"}}}], tool_choice="required"
    )
    assert bad.client_param("structured_outputs.json") == "tools"


def test_a_tool_request_model_must_say_how_it_names_its_tools():
    class NoNames(ChatCompletionRequest):  # named_tool kept, tool_names left to the mixin
        tool_names = ToolRequest.tool_names

    class NoNamedTool(ChatCompletionRequest):
        named_tool = ToolRequest.named_tool

    for model in (NoNames, NoNamedTool):
        with pytest.raises(TypeError, match="abstract"):
            model(messages=HI)
    assert ChatCompletionRequest(messages=HI).tool_names() == []


def test_a_deeply_nested_schema_is_valid_json_and_a_lone_surrogate_is_not():
    schema = {"type": "string"}
    for _ in range(150):
        schema = {"type": "object", "properties": {"a": schema}}
    body = {"messages": [{"role": "user", "content": "hi"}]}
    fmt = {"type": "json_schema", "json_schema": {"name": "deep", "schema": schema}}
    req = parse_request(ChatCompletionRequest, json.dumps({**body, "response_format": fmt}), LIMITS)
    assert req.structured_outputs_fields()["json"] == schema
    with pytest.raises(ProtocolError, match="nested too deeply"):
        parse_request(ChatCompletionRequest, "[" * 100_000 + "]" * 100_000, LIMITS)
    with pytest.raises(ProtocolError, match="surrogate") as e:
        parse_request(ChatCompletionRequest, '{"messages": [{"role": "user", "content": "abc \\ud800"}]}', LIMITS)
    assert e.value.param == "messages"
