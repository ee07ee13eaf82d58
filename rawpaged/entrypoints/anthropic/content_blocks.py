"""The Messages API's answer (``serving``): the ``message`` object, its ``usage`` and ``stop_reason``, and a
choice's text as content blocks (``thinking``, ``text``, ``tool_use``) together with the stream events that
build them (``content_block_start``, ``content_block_delta``, ``content_block_stop``), in the order
Anthropic's SDK stream helper rebuilds them. The streamed and the whole answer are one parse
(``ChoiceParser``), so they agree."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import os
import uuid

from rawpaged.engine.stop_strings import find_stop_string
from rawpaged.entrypoints.generation.choice_parser import ChoiceParser
from rawpaged.entrypoints.generation.tool_parsers import DeltaMessage

#: signs thinking blocks (``signature``): a key of this process, so a signature tells the text came from it
_SIGNING_KEY = os.urandom(32)


def new_id(prefix: str) -> str:
    """An Anthropic-style id: ``msg_`` (a message) or ``toolu_`` (a tool use) and 24 hex digits."""
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


def signature(thinking: str) -> str:
    """A thinking block's ``signature``: the base64 HMAC-SHA256 of its text under this process's key."""
    return base64.b64encode(hmac.new(_SIGNING_KEY, thinking.encode(), hashlib.sha256).digest()).decode()


def usage(prompt_tokens: int, output_tokens: int, cached_tokens: int = 0) -> dict:
    """Anthropic's ``usage``, whose input counts add up to the prompt: ``cache_read_input_tokens`` of the
    ``prompt_tokens`` were served from the prefix cache, ``input_tokens`` are the rest;
    ``cache_creation_input_tokens`` is 0 (writing the prefix cache costs nothing extra here)."""
    return {
        "input_tokens": prompt_tokens - cached_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached_tokens,
        "output_tokens": output_tokens,
    }


def message_object(mid: str, model: str, content: list, stop_reason, stop_sequence, usage_: dict) -> dict:
    """A ``message`` object (``stop_reason`` and ``stop_sequence`` null in a stream's ``message_start``)."""
    return {
        "id": mid,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": stop_reason,
        "stop_sequence": stop_sequence,
        "usage": usage_,
    }


class ContentBlocks:
    """A choice's text, fed piece by piece, as Anthropic content blocks and the stream events that build
    them (``feed``, then ``finish``): the choice's ``ChoiceParser`` (reasoning, then ``req``'s tools)
    splits it. A block is open until text of another kind comes; ``blocks`` holds them in order, complete
    once ``finish`` returned (a ``tool_use`` block's ``input`` parsed, a ``thinking`` block signed)."""

    def __init__(self, req, reasoning_parser: str | None):
        self.req = req
        self.parser = ChoiceParser(reasoning_parser, req.tool_parser())
        self.blocks: list = []
        self._open: int | None = None  # index of the open block
        self._calls: dict = {}  # the tool parser's call index -> block index
        self._json: dict = {}  # tool_use block index -> its input's JSON text so far

    def feed(self, text: str, last: bool = False) -> list:
        """The events of a piece of text (``last``: the choice's last piece; the held-back text comes)."""
        return self._emit(self.parser.feed(text, last=last))

    def finish(self) -> list:
        """The held-back text's events, then the open block's closing ones."""
        return self.feed("", last=True) + self._close()

    def _emit(self, message: DeltaMessage) -> list:
        events = []
        if message.reasoning:
            events += self._delta("thinking", "thinking_delta", message.reasoning)
        if message.content:
            events += self._delta("text", "text_delta", message.content)
        for d in message.tool_calls:
            events += self._call_delta(d)
        return events

    def _start(self, block: dict) -> list:
        events = self._close()
        self.blocks.append(block)
        self._open = len(self.blocks) - 1
        return events + [{"type": "content_block_start", "index": self._open, "content_block": dict(block)}]

    def _close(self) -> list:
        if self._open is None:
            return []
        index, block, events = self._open, self.blocks[self._open], []
        self._open = None
        if block["type"] == "thinking":
            block["signature"] = signature(block["thinking"])
            delta = {"type": "signature_delta", "signature": block["signature"]}
            events.append({"type": "content_block_delta", "index": index, "delta": delta})
        elif block["type"] == "tool_use":
            block["input"] = _parsed_input(self._json.get(index, ""))
        return events + [{"type": "content_block_stop", "index": index}]

    def _delta(self, kind: str, delta_type: str, text: str) -> list:
        events = []
        if self._open is None or self.blocks[self._open]["type"] != kind:
            events += self._start({"type": kind, kind: ""} | ({"signature": ""} if kind == "thinking" else {}))
        self.blocks[self._open][kind] += text
        delta = {"type": delta_type, kind: text}
        return events + [{"type": "content_block_delta", "index": self._open, "delta": delta}]

    def _call_delta(self, d: dict) -> list:
        events = []
        index = self._calls.get(d["index"])
        if index is None:
            block = {"type": "tool_use", "id": new_id("toolu"), "name": d["function"]["name"], "input": {}}
            events += self._start(block)
            index = self._calls[d["index"]] = self._open
        partial = d["function"].get("arguments", "")
        if partial:
            self._json[index] = self._json.get(index, "") + partial
            delta = {"type": "input_json_delta", "partial_json": partial}
            events.append({"type": "content_block_delta", "index": index, "delta": delta})
        return events

    def stop(self, choice, tokenizer) -> tuple:
        """``(stop_reason, stop_sequence)`` of the finished ``choice`` (a ``CompletionOutput``):
        ``max_tokens`` when cut off, ``tool_use`` after a call, ``stop_sequence`` with the one of
        ``stop_sequences`` that ended it (the first in its tokens' text: where the engine stopped), else
        ``end_turn``."""
        reason = self.parser.finish_reason(choice.finish_reason)
        if reason == "length":
            return "max_tokens", None
        if reason == "tool_calls":
            return "tool_use", None
        stops = self.req.stop_sequences
        if stops and reason == "stop":
            found = find_stop_string(tokenizer.decode(choice.token_ids), stops, 0)
            if found is not None:
                return "stop_sequence", found[1]
        return "end_turn", None


def _parsed_input(text: str) -> dict:
    """A tool call's arguments (JSON text) as its ``input`` object; {} for none or for text that is not an
    object (the tool parsers emit only objects)."""
    try:
        value = json.loads(text) if text else {}
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}
