"""Hermes/Qwen-style tool calls (NousResearch's Hermes 2 Pro function-calling format, also Qwen2.5's and
Qwen3's chat templates): each call is a JSON object ``{"name": ..., "arguments": {...}}`` between
``<tool_call>`` and ``</tool_call>``, with any content before the first call."""

from __future__ import annotations

import json

from rawpaged.entrypoints.generation.tool_parsers.abstract_tool_parser import (
    DeltaMessage,
    ToolParser,
    arguments_text,
    tool_call_delta,
)

OPEN, CLOSE = "<tool_call>", "</tool_call>"


def parse_call(body: str) -> tuple | None:
    """``(name, arguments JSON text)`` of one call's body, or None if it is not a call. ``parameters``
    is accepted for ``arguments`` (some fine-tunes write it), and a call without either has ``{}``."""
    try:
        call = json.loads(body)
    except ValueError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not call["name"]:
        return None
    arguments = call.get("arguments", call.get("parameters", {}))
    if not isinstance(arguments, dict):
        return None
    return call["name"], arguments_text(arguments)


class HermesToolParser(ToolParser):
    """``tool_choice: "auto"``: streams content while holding back text that may begin ``<tool_call>``
    (and trailing whitespace, dropped before a call), and emits each call whole once its closing tag
    (or the end of the choice) arrives. A call is read by structure: its JSON object first (a string in
    it may hold ``</tool_call>``), then the closing tag after it. A block that is not a valid call stays
    content, tags and all, through the first closing tag after its JSON (or, when its JSON never ends,
    through the first closing tag). With ``max_calls`` (1 for ``parallel_tool_calls: false``), valid
    calls past it are dropped (vLLM keeps only the first call there too)."""

    def __init__(self, max_calls: int | None = None):
        super().__init__()
        self.max_calls = max_calls
        self.num_dropped = 0
        self._held = ""  # text not yet emitted: a call's body, or content that may begin one
        self._in_call = False
        self._scan = None  # the open call's JSON scanner, once its first character came
        self._after_call = False  # whitespace right after a call is not content
        self._has_content = False
        self._gap = ""  # whitespace before the open call: content again if the call is not valid

    def feed(self, text: str) -> DeltaMessage:
        self._held += text
        out = DeltaMessage()
        while True:
            if self._in_call:
                end = self._call_end()
                if end is None:
                    return out
                body, self._held = self._held[:end], self._held[end + len(CLOSE) :]
                self._in_call, self._scan = False, None
                self._emit_call(body, out, closed=True)
                continue
            start = self._held.find(OPEN)
            if start >= 0:
                before = self._held[:start].rstrip()
                self._gap = self._held[len(before) : start]
                self._emit_content(before, out)
                self._held = self._held[start + len(OPEN) :]
                self._in_call = True
                continue
            keep = _partial_tag_length(self._held)
            cut = len(self._held) - keep
            while cut > 0 and self._held[cut - 1].isspace():
                cut -= 1
            self._emit_content(self._held[:cut], out)
            self._held = self._held[cut:]
            return out

    def finish(self) -> DeltaMessage:
        out = DeltaMessage()
        while self._in_call:
            held, self._held = self._held, ""
            self._in_call, scan, self._scan = False, self._scan, None
            end = held.find(CLOSE)
            if scan is not None and scan.end is None and end >= 0:
                # its JSON never ended: the block ends at its first closing tag, and the rest is read again
                self._emit_call(held[:end], out, closed=True)
                more = self.feed(held[end + len(CLOSE) :])
                out.content += more.content
                out.tool_calls += more.tool_calls
                continue
            self._emit_call(held, out, closed=False)  # no closing tag: still a call if its JSON is whole
            return out
        held, self._held = self._held, ""
        if held.strip() or not self.num_calls:
            self._emit_content(held, out)
        return out

    def _call_end(self) -> int | None:
        """Where the open call's closing tag begins in ``_held``; None while more text is needed."""
        held = self._held
        if self._scan is None:
            first = len(held) - len(held.lstrip())
            if first == len(held):
                return None
            if held[first] != "{":  # not a JSON object: the block ends at the first closing tag
                end = held.find(CLOSE)
                return end if end >= 0 else None
            self._scan = _ObjectScan(first)
        obj_end = self._scan.advance(held)
        if obj_end is None:
            return None
        rest = held[obj_end:]
        tag = len(rest) - len(rest.lstrip())
        if rest.startswith(CLOSE, tag):
            return obj_end + tag
        if CLOSE.startswith(rest[tag:]):  # only whitespace, or the tag's beginning, so far
            return None
        end = held.find(CLOSE, obj_end)  # not a call: content through the next closing tag
        return end if end >= 0 else None

    def _emit_content(self, text: str, out: DeltaMessage) -> None:
        if self._after_call:
            text = text.lstrip()
            if text and self._has_content:  # content on both sides of a call: one line break between
                text = "\n" + text
        if text:
            self._after_call = False
            self._has_content = True
            out.content += text

    def _emit_call(self, body: str, out: DeltaMessage, closed: bool) -> None:
        call = parse_call(body)
        if call is None:
            self._emit_content(self._gap + OPEN + body + (CLOSE if closed else ""), out)
            return
        self._after_call = True
        if self.max_calls is not None and self.num_calls >= self.max_calls:
            self.num_dropped += 1
            return
        out.tool_calls.append(tool_call_delta(self.num_calls, call[0], call[1]))
        self.num_calls += 1


def _partial_tag_length(text: str) -> int:
    """Length of the longest end of ``text`` that is a proper beginning of ``<tool_call>``."""
    for k in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if OPEN.startswith(text[-k:]):
            return k
    return 0


class _ObjectScan:
    """Finds where a JSON object that begins at ``start`` ends, over a text that grows: brackets are
    counted outside strings (escapes skipped). Whether the object is valid JSON is ``parse_call``'s to
    say."""

    def __init__(self, start: int):
        self.pos = start
        self.depth = 0
        self.in_string = False
        self.escaped = False
        self.end = None  # index just past the object, once it closed

    def advance(self, text: str) -> int | None:
        """The index just past the object in ``text`` (a longer version of the text seen before), or None
        while it is still open."""
        while self.end is None and self.pos < len(text):
            c = text[self.pos]
            self.pos += 1
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif c == "\\":
                    self.escaped = True
                elif c == '"':
                    self.in_string = False
            elif c == '"':
                self.in_string = True
            elif c in "{[":
                self.depth += 1
            elif c in "}]":
                self.depth -= 1
                if self.depth == 0:
                    self.end = self.pos
        return self.end
