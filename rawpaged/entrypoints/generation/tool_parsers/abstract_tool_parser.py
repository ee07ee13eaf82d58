"""What every tool parser gives: the text a choice generated, fed piece by piece, comes back as
``DeltaMessage``s (content and OpenAI ``delta.tool_calls`` entries). A full response is the same parse
run over the whole text (``extract_tool_calls``), so streamed and non-streamed answers agree."""

from __future__ import annotations

import abc
import json
import uuid
from dataclasses import dataclass, field


def new_tool_call_id() -> str:
    """A tool call id in OpenAI's form (``call_`` and 24 hex digits)."""
    return "call_" + uuid.uuid4().hex[:24]


def tool_call_delta(index: int, name: str | None, arguments: str, call_id: str | None = None) -> dict:
    """One OpenAI ``delta.tool_calls`` entry. The first entry of a call carries its ``id``, ``type`` and
    ``name``; later ones only more ``arguments`` text."""
    function = {"arguments": arguments} if name is None else {"name": name, "arguments": arguments}
    entry = {"index": index, "function": function}
    if name is not None:
        entry = {"index": index, "id": call_id or new_tool_call_id(), "type": "function", "function": function}
    return entry


def arguments_text(arguments) -> str:
    """A call's ``arguments`` as OpenAI sends them: a JSON string, laid out as constrained generation
    writes JSON (``json.dumps``'s separators, non-ASCII kept)."""
    if isinstance(arguments, str):
        return arguments
    return json.dumps(arguments, ensure_ascii=False)


@dataclass
class DeltaMessage:
    """What one piece of generated text adds to a choice's message."""

    content: str = ""
    tool_calls: list = field(default_factory=list)  # delta.tool_calls entries
    reasoning: str = ""  # a reasoning model's thinking (``reasoning_parsers``)

    def __bool__(self) -> bool:
        return bool(self.content or self.tool_calls or self.reasoning)


class ToolParser(abc.ABC):
    """Splits a choice's generated text into content and tool calls, incrementally. One instance per
    choice: ``feed`` each new piece of text, then ``finish`` once.

    Attributes:
        num_calls: tool calls emitted so far; the choice's ``finish_reason`` "stop" becomes "tool_calls"
            when it is > 0.
    """

    def __init__(self):
        self.num_calls = 0

    @abc.abstractmethod
    def feed(self, text: str) -> DeltaMessage:
        """What the choice's next piece of text adds to its message."""

    @abc.abstractmethod
    def finish(self) -> DeltaMessage:
        """What is still held back when the choice finished (text that only might have begun a call)."""

    def finish_reason(self, reason: str | None) -> str | None:
        """OpenAI's ``finish_reason`` of the choice: ``"tool_calls"`` for a completed call."""
        return "tool_calls" if reason == "stop" and self.num_calls else reason


def extract_tool_calls(parser: ToolParser, text: str) -> tuple:
    """``(content, tool_calls)`` of a whole generated text: the message's ``content`` (None when it is
    only tool calls) and its ``tool_calls`` (``whole_tool_calls``, empty for none)."""
    first, rest = parser.feed(text), parser.finish()
    calls = whole_tool_calls(first.tool_calls + rest.tool_calls)
    joined = first.content + rest.content
    return (joined if joined or not calls else None), calls


def whole_tool_calls(entries: list) -> list:
    """``delta.tool_calls`` entries (``tool_call_delta``) put together as a message's ``tool_calls``:
    OpenAI's ``[{"id", "type", "function": {"name", "arguments"}}]``, by call index."""
    calls: dict = {}
    for d in entries:
        call = calls.get(d["index"])
        if call is None:
            calls[d["index"]] = {"id": d["id"], "type": "function", "function": dict(d["function"])}
        else:
            call["function"]["arguments"] += d["function"]["arguments"]
    return [calls[i] for i in sorted(calls)]
