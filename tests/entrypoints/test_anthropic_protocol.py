"""The Messages API without a model: a request's blocks as the chat messages the template renders (tool
results in order with the text, ``is_error``, thinking dropped, a continued assistant turn), the content
blocks and stream events of a parsed choice, and errors rewritten in Anthropic's shape (status, type, headers
and connection kept)."""

from __future__ import annotations

import pytest

pytest.importorskip("pydantic")  # absent on some hosts (the GPU host has no package index)

import json

from aiohttp import web

from rawpaged.engine.outputs import CompletionOutput
from rawpaged.entrypoints.anthropic.content_blocks import ContentBlocks, signature
from rawpaged.entrypoints.anthropic.protocol import MessagesRequest
from rawpaged.entrypoints.anthropic.serving import _error_event
from rawpaged.entrypoints.generation.request_body import parse_request
from rawpaged.entrypoints.http.errors import ProtocolError
from rawpaged.entrypoints.http.json_reply import as_anthropic_error, json_response
from rawpaged.entrypoints.server.config import Limits
from rawpaged.errors import EngineError

TOOL = {"name": "get_weather", "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}


def request(messages, **kw) -> MessagesRequest:
    return parse_request(MessagesRequest, {"model": "m", "max_tokens": 8, "messages": messages, **kw}, Limits())


def test_blocks_become_the_chat_messages_the_template_renders():
    req = request(
        [
            {"role": "user", "content": "Weather in Paris and Rome?"},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "two calls", "signature": "s"},
                    {"type": "text", "text": "Looking."},
                    {"type": "tool_use", "id": "t1", "name": "get_weather", "input": {"city": "Paris"}},
                    {"type": "tool_use", "id": "t2", "name": "get_weather", "input": {"city": "Rome"}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "t1", "content": "sunny"},
                    {
                        "type": "tool_result",
                        "tool_use_id": "t2",
                        "content": [{"type": "text", "text": "down"}],
                        "is_error": True,
                    },
                    {"type": "text", "text": "Thanks"},
                ],
            },
        ],
        system=[{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}],
        tools=[TOOL],
    )
    calls = [
        {"id": "t1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
        {"id": "t2", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Rome"}}},
    ]
    assert req.template_messages() == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {"role": "assistant", "content": "Looking.", "tool_calls": calls},
        {"role": "tool", "content": "sunny", "tool_call_id": "t1"},
        {"role": "tool", "content": "Error: down", "tool_call_id": "t2"},
        {"role": "user", "content": "Thanks"},
    ]
    assert req.add_generation_prompt and req.tool_mode == "auto"
    assert req.template_tools() == [
        {"type": "function", "function": {"name": "get_weather", "parameters": TOOL["input_schema"]}}
    ]
    prefill = request([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello,"}])
    assert (prefill.add_generation_prompt, prefill.continue_final_message) == (False, True)


@pytest.mark.parametrize(
    "messages, kw, param, needle",
    [
        ([{"role": "user", "content": [{"type": "document", "source": {}}]}], {}, "messages", "'document'"),
        (
            [{"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "x"}]}],
            {},
            "messages",
            "user turn",
        ),
        (
            [{"role": "user", "content": "Hi"}],
            {"tools": [TOOL], "tool_choice": {"type": "tool", "name": "nope"}},
            "tool_choice",
            "'nope'",
        ),
        (
            [{"role": "user", "content": "Hi"}],
            {"tools": [TOOL | {"type": "web_search_20250305"}]},
            "tools",
            "custom tools",
        ),
        ([{"role": "user", "content": "Hi"}], {"tools": [TOOL, TOOL]}, "tools", "unique"),
        ([{"role": "user", "content": "Hi"}], {"thinking": {"type": "enabled"}}, "thinking", "budget_tokens"),
        ([{"role": "user", "content": "Hi"}], {"stop_sequences": [""]}, "stop_sequences", "stop_sequences"),
    ],
)
def test_refusals_name_the_field(messages, kw, param, needle):
    with pytest.raises(ProtocolError) as e:
        request(messages, **kw)
    assert e.value.param == param and needle in e.value.message, e.value.message


def test_content_blocks_and_their_events():
    req = request([{"role": "user", "content": "Hi"}], tools=[TOOL])
    blocks = ContentBlocks(req, "qwen3")
    events = []
    for piece in (
        "<think>hm",
        "m</think>Sure.",
        '<tool_call>\n{"name": "get_weather", ',
        '"arguments": {"city": "Paris"}}\n</tool_call>',
    ):
        events += blocks.feed(piece)
    events += blocks.finish()
    assert [b["type"] for b in blocks.blocks] == ["thinking", "text", "tool_use"]
    thinking, text, call = blocks.blocks
    assert thinking == {"type": "thinking", "thinking": "hmm", "signature": signature("hmm")}
    assert text == {"type": "text", "text": "Sure."}
    assert call["name"] == "get_weather" and call["input"] == {"city": "Paris"} and call["id"].startswith("toolu_")
    starts = [e for e in events if e["type"] == "content_block_start"]
    assert [e["index"] for e in starts] == [0, 1, 2] and starts[2]["content_block"]["input"] == {}
    stops = [e["index"] for e in events if e["type"] == "content_block_stop"]
    assert stops == [0, 1, 2]
    deltas = [(e["index"], e["delta"]["type"]) for e in events if e["type"] == "content_block_delta"]
    assert (0, "signature_delta") in deltas and deltas.index((0, "signature_delta")) < deltas.index((1, "text_delta"))
    partial = "".join(
        e["delta"]["partial_json"] for e in events if e.get("delta", {}).get("type") == "input_json_delta"
    )
    assert json.loads(partial) == {"city": "Paris"}
    done = CompletionOutput(0, "", [1, 2], "stop")
    assert blocks.stop(done, tokenizer=None) == ("tool_use", None)


def test_errors_are_rewritten_in_anthropic_shape():
    busy = json_response({"error": {"message": "the server is at capacity", "type": "service_unavailable_error"}}, 503)
    busy.headers["Retry-After"] = "1"
    busy.force_close()
    as_anthropic_error(busy)
    assert busy.status == 529 and busy.headers["Retry-After"] == "1" and not busy.keep_alive
    assert json.loads(busy.text) == {
        "type": "error",
        "error": {"type": "overloaded_error", "message": "the server is at capacity"},
    }
    kinds = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error", 500: "api_error"}
    for status, kind in (kinds | {413: "request_too_large"}).items():
        resp = json_response({"error": {"message": "m", "type": "x"}}, status)
        as_anthropic_error(resp)
        assert (resp.status, json.loads(resp.text)["error"]["type"]) == (status, kind)
    plain = web.Response(text="not json", status=405)
    as_anthropic_error(plain)
    assert json.loads(plain.text)["error"] == {"type": "invalid_request_error", "message": "not json"}
    event = _error_event(EngineError("the engine died")).decode()
    assert event.startswith("event: error\n")
    assert json.loads(event.split("data: ", 1)[1]) == {
        "type": "error",
        "error": {"type": "api_error", "message": "the engine died"},
    }
