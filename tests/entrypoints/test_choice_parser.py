"""The one parse of a choice's text (``generation.choice_parser``): reasoning first, then tool calls on the
rest, the same whole and in any pieces, and the same through chat's stream (``ChatFormat``), the
Responses API's output items (``OutputItems``) and a whole chat choice."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("pydantic")  # absent on some hosts (the GPU host has no package index)

from rawpaged.engine.outputs import CompletionDelta, CompletionOutput
from rawpaged.entrypoints.generation.choice_parser import ChoiceParser, parse_choice
from rawpaged.entrypoints.generation.output_json import ChatFormat
from rawpaged.entrypoints.generation.tool_parsers import HermesToolParser
from rawpaged.entrypoints.openai.responses.output_items import OutputItems

CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
# the call inside the thinking is reasoning, not a call: reasoning runs first
TEXT = "<think>maybe " + CALL + " then</think>Let me look. " + CALL
REASONING = "maybe " + CALL + " then"


def pieces(text: str, step: int) -> list:
    return [text[i : i + step] for i in range(0, len(text), step)]


def test_reasoning_then_tools_whole():
    reasoning, content, calls = parse_choice("qwen3", HermesToolParser(), TEXT)
    assert reasoning == REASONING
    assert content == "Let me look."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Paris"})
    ]
    assert parse_choice(None, None, TEXT) == (None, TEXT, [])
    assert parse_choice("qwen3", HermesToolParser(), "<think>cut off") == ("cut off", "", [])


@pytest.mark.parametrize("step", [1, 2, 3, 7, 1000])
def test_streamed_in_pieces_adds_up_to_the_whole(step):
    parser = ChoiceParser("qwen3", HermesToolParser())
    chunks = pieces(TEXT, step)
    deltas = [parser.feed(c, last=i == len(chunks) - 1) for i, c in enumerate(chunks)]
    assert "".join(d.reasoning for d in deltas) == REASONING
    assert "".join(d.content for d in deltas).strip() == "Let me look."
    calls = [c for d in deltas for c in d.tool_calls]
    assert "".join(c["function"]["arguments"] for c in calls) == '{"city": "Paris"}'
    assert parser.finish_reason("stop") == "tool_calls" and parser.finish_reason("length") == "length"


class _Req:
    """What ``ChatFormat`` reads of a chat request with auto tools."""

    num_logprobs = None
    echo_text = ""
    response_role = "assistant"

    @staticmethod
    def tool_parser():
        return HermesToolParser()


@pytest.mark.parametrize("step", [1, 5, 1000])
def test_chat_stream_chat_whole_and_responses_items_agree(step):
    chunks = pieces(TEXT, step)
    fmt, streamed = ChatFormat("qwen3"), []
    for i, c in enumerate(chunks):
        last = i == len(chunks) - 1
        delta = CompletionDelta(0, c, [], None, "stop" if last else None, 0, i == 0)
        streamed += fmt.chunk_choices(_Req, 0, None, delta)
    fields = [c["delta"] for c in streamed]
    assert "".join(f.get("reasoning", "") for f in fields) == REASONING
    assert "".join(f.get("content") or "" for f in fields).strip() == "Let me look."
    assert streamed[-1]["finish_reason"] == "tool_calls"

    whole = ChatFormat("qwen3").choice(_Req, 0, None, CompletionOutput(0, TEXT, [], "stop"))["message"]
    assert whole["reasoning"] == REASONING and whole["content"] == "Let me look."
    assert [c["function"]["name"] for c in whole["tool_calls"]] == ["get_weather"]

    items = OutputItems(_Req, "qwen3")
    for c in chunks:
        items.feed(c)
    items.finish()
    reasoning, message, call = items.items
    assert reasoning["content"][0]["text"] == whole["reasoning"]
    assert message["content"][0]["text"].strip() == whole["content"]
    assert (call["name"], call["arguments"]) == ("get_weather", whole["tool_calls"][0]["function"]["arguments"])
