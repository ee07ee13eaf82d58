"""``tool_choice: "required"`` or a named function: generation is constrained (by the structured-output
grammar) to JSON that is a valid call, so any model calls a tool, trained for it or not (as vLLM forces
them).

- A named function: the output is its ``arguments`` object, valid against its ``parameters`` schema.
- ``"required"``: the output is a JSON array of ``{"name", "arguments"}`` objects, one or more (one
  with ``parallel_tool_calls: false``), each name from the list with arguments valid against its schema.
"""

from __future__ import annotations

import json

from rawpaged.entrypoints.openai.tool_parsers.abstract_tool_parser import (
    DeltaMessage,
    ToolParser,
    arguments_text,
    tool_call_delta,
)

ANY_OBJECT = {"type": "object"}  # a function without a parameters schema takes any object


def _parameters(tool: dict) -> dict:
    return tool["function"].get("parameters") or ANY_OBJECT


def forced_tool_schema(tools: list, name: str | None, parallel_tool_calls: bool = True) -> dict:
    """The JSON Schema generation is constrained to.

    Args:
        tools: OpenAI tools, ``[{"type": "function", "function": {"name", "parameters"?}}]``.
        name: the named function (which must be in ``tools``), or None for ``"required"``.
        parallel_tool_calls: with ``"required"``, whether more than one call may be made.
    """
    if name is not None:
        return next(_parameters(t) for t in tools if t["function"]["name"] == name)
    calls = [
        {
            "type": "object",
            "properties": {"name": {"const": t["function"]["name"]}, "arguments": _parameters(t)},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for t in tools
    ]
    schema = {"type": "array", "minItems": 1, "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}
    if not parallel_tool_calls:
        schema["maxItems"] = 1
    return schema


class ForcedToolParser(ToolParser):
    """Reads the constrained output. A named call streams its arguments as they are generated; the
    calls of ``"required"`` are emitted whole at the end. Output cut short (``max_tokens``) that is not
    valid JSON is returned as content, with ``finish_reason "length"``."""

    def __init__(self, name: str | None):
        super().__init__()
        self._name = name
        self._held = ""

    def feed(self, text: str) -> DeltaMessage:
        out = DeltaMessage()
        if not text:
            return out
        if self._name is not None:
            out.tool_calls.append(tool_call_delta(0, None if self.num_calls else self._name, text))
            self.num_calls = 1
        else:
            self._held += text
        return out

    def finish(self) -> DeltaMessage:
        out = DeltaMessage()
        held, self._held = self._held, ""
        if self._name is not None or not held:
            return out
        try:
            calls = json.loads(held)
        except ValueError:
            calls = None
        if not isinstance(calls, list) or not all(_is_call(c) for c in calls):
            out.content = held
            return out
        for call in calls:
            out.tool_calls.append(tool_call_delta(self.num_calls, call["name"], arguments_text(call["arguments"])))
            self.num_calls += 1
        return out


def _is_call(value) -> bool:
    return isinstance(value, dict) and isinstance(value.get("name"), str) and "arguments" in value
