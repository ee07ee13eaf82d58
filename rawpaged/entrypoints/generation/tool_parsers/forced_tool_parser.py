"""``tool_choice: "required"`` or a named function: generation is constrained (by the structured-output
grammar) to JSON that is a valid call, so any model calls a tool, trained for it or not (as vLLM forces
them).

- A named function: the output is its ``arguments`` object, valid against its ``parameters`` schema.
- ``"required"``: the output is a JSON array of ``{"name", "arguments"}`` objects, one or more (one
  with ``parallel_tool_calls: false``), each name from the list with arguments valid against its schema.

Arguments follow the parameters schema as the structured outputs compile it: strict by default (an object
that lists its properties admits no other key unless it says ``additionalProperties``;
``rawpaged.structured_output.json_schema.no_additional_properties``), so a small model cannot go on
inventing keys; ``--no-disable-additional-properties`` follows the letter of JSON Schema.
"""

from __future__ import annotations

import json

from rawpaged.entrypoints.generation.tool_parsers.abstract_tool_parser import (
    DeltaMessage,
    ToolParser,
    arguments_text,
    tool_call_delta,
)

#: A function without ``parameters`` has an empty parameter list (OpenAI's rule): its arguments are ``{}``.
NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}


def _parameters(tool: dict) -> dict:
    return tool["function"].get("parameters") or NO_PARAMETERS


def _nested(schema, name: str):
    """``schema`` moved to ``#/$defs/<name>`` of an enclosing schema: its local ``$ref`` pointers (to
    its own ``$defs``, or ``#`` for recursion) are rewritten to point under there."""
    if isinstance(schema, dict):
        return {
            k: (
                "#/$defs/" + name + v[1:]
                if k == "$ref" and isinstance(v, str) and v.startswith("#")
                else _nested(v, name)
            )
            for k, v in schema.items()
        }
    if isinstance(schema, list):
        return [_nested(v, name) for v in schema]
    return schema


def forced_tool_schema(tools: list, name: str | None, parallel_tool_calls: bool = True) -> dict:
    """The JSON Schema generation is constrained to.

    Args:
        tools: OpenAI tools, ``[{"type": "function", "function": {"name", "parameters"?}}]``.
        name: the named function (which must be in ``tools``), or None for ``"required"``.
        parallel_tool_calls: with ``"required"``, whether more than one call may be made.
    """
    if name is not None:
        return next(_parameters(t) for t in tools if t["function"]["name"] == name)
    names = [t["function"]["name"] for t in tools]
    calls = [
        {
            "type": "object",
            "properties": {"name": {"const": n}, "arguments": {"$ref": f"#/$defs/{n}"}},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for n in names
    ]
    schema = {
        "type": "array",
        "minItems": 1,
        "items": calls[0] if len(calls) == 1 else {"anyOf": calls},
        # each function's parameters as a definition of its own, so that their $refs still resolve
        "$defs": {n: _nested(_parameters(t), n) for n, t in zip(names, tools)},
    }
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
