"""The Responses API's answer (``serving``): the ``response`` object, its ``usage``, and a choice's
text as output items (``reasoning``, ``message``, ``function_call``) together with the stream events that
build them, in the order the ``openai`` SDK's stream helper rebuilds them; and output items as the chat
messages a continuation (``previous_response_id``) sends back."""

from __future__ import annotations

import itertools
import uuid

from rawpaged.entrypoints.generation.choice_parser import ChoiceParser
from rawpaged.entrypoints.generation.output_json import chat_logprobs
from rawpaged.entrypoints.generation.reasoning_parsers import reasoning_token_count
from rawpaged.entrypoints.generation.tool_parsers import DeltaMessage
from rawpaged.entrypoints.openai.responses.protocol import ResponsesRequest


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def response_object(req: ResponsesRequest, rid: str, created: int, model: str, status: str, output: list) -> dict:
    fmt = (req.text or {}).get("format") or {"type": "text"}
    return {
        "id": rid,
        "object": "response",
        "created_at": created,
        "status": status,
        "model": model,
        "output": output,
        "error": None,
        "incomplete_details": None,
        "instructions": req.instructions,
        "max_output_tokens": req.max_output_tokens,
        "temperature": req.temperature if req.temperature is not None else 1.0,
        "top_p": req.top_p if req.top_p is not None else 1.0,
        "tools": [t.model_dump() for t in req.tools or ()],  # strict and parameters: required, nullable
        "tool_choice": req.tool_choice or "auto",
        "parallel_tool_calls": req.parallel_tool_calls is not False,
        "previous_response_id": req.previous_response_id,
        "store": req.stores,
        "text": {"format": fmt},
        "metadata": req.metadata or {},
        "reasoning": {"effort": None, "summary": None},
        "truncation": "disabled",
        "background": bool(req.background),
        "top_logprobs": req.top_logprobs or 0,
        "usage": None,
    } | ({"user": req.user} if req.user is not None else {})  # an optional string: omitted, not null


def usage(input_tokens: int, output_tokens: int, cached_tokens: int = 0, reasoning_tokens: int = 0) -> dict:
    """The Responses API's ``usage``: ``cached_tokens`` of the input were served from the prefix cache
    (none are written to a cache OpenAI bills: ``cache_write_tokens`` 0), ``reasoning_tokens`` of the output
    were reasoning (``reasoning_parsers.reasoning_token_count``)."""
    return {
        "input_tokens": input_tokens,
        "input_tokens_details": {"cached_tokens": cached_tokens, "cache_write_tokens": 0},
        "output_tokens": output_tokens,
        "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
        "total_tokens": input_tokens + output_tokens,
    }


class OutputItems:
    """A choice's text, fed piece by piece, as Responses output items and the stream events that build them
    (``feed``, then ``finish``): the choice's ``ChoiceParser`` (reasoning, then ``req``'s tools) splits it.
    ``items`` holds the items in output order, complete once ``finish`` returned."""

    def __init__(self, req: ResponsesRequest, reasoning_parser: str | None):
        self.req = req
        self.reasoning_parser = reasoning_parser
        self.parser = ChoiceParser(reasoning_parser, req.tool_parser())
        self._numbers = itertools.count()
        self.items: list = []
        self._reasoning = self._message = None
        self._calls: dict = {}  # tool parser's call index -> item
        self._logprobs: list = []  # output_text logprobs not yet sent with a delta

    def response(self, rid: str, created: int, model: str, final, prompt) -> dict:
        """The final ``response`` object once ``finish`` returned (``finished_response``)."""
        return finished_response(self.req, rid, created, model, self.items, final, prompt, self.reasoning_parser)

    def event(self, kind: str, **fields) -> dict:
        """A stream event of type ``kind``, numbered (``sequence_number``) in the order they are made."""
        return {"type": kind, "sequence_number": next(self._numbers), **fields}

    def logprobs(self, prompt, token_ids: list, entries: list | None) -> list:
        """``output_text.logprobs`` entries of a piece's tokens when the request asks for them, else []."""
        if not self.req.wants_logprobs:
            return []
        return output_text_logprobs(prompt.tokenizer, token_ids, entries, self.req.top_logprobs or 0)

    def _add(self, item: dict) -> list:
        self.items.append(item)
        return [self.event("response.output_item.added", output_index=len(self.items) - 1, item=dict(item))]

    def _index(self, item) -> int:
        return next(i for i, it in enumerate(self.items) if it is item)

    def feed(self, text: str, logprobs: list = ()) -> list:
        """Events for a piece of text; ``logprobs``: its tokens' ``output_text`` logprob entries (sent
        with the next text delta)."""
        self._logprobs += logprobs
        return self._emit(self.parser.feed(text))

    def _emit(self, message: DeltaMessage) -> list:
        """The events of what a piece of text added: reasoning, then text, then tool calls."""
        events = self._reasoning_delta(message.reasoning) if message.reasoning else []
        if message.content:
            events += self._text_delta(message.content)
        for d in message.tool_calls:
            events += self._call_delta(d)
        return events

    def _reasoning_delta(self, reasoning: str) -> list:
        events = []
        if self._reasoning is None:
            self._reasoning = {"type": "reasoning", "id": new_id("rs"), "summary": [], "status": "in_progress"}
            events += self._add(self._reasoning)
            self._reasoning["content"] = [{"type": "reasoning_text", "text": ""}]
        self._reasoning["content"][0]["text"] += reasoning
        where = {"item_id": self._reasoning["id"], "output_index": self._index(self._reasoning), "content_index": 0}
        return events + [self.event("response.reasoning_text.delta", **where, delta=reasoning)]

    def _text_delta(self, text: str) -> list:
        events = []
        if self._message is None:
            self._message = {"type": "message", "id": new_id("msg"), "status": "in_progress", "role": "assistant"}
            self._message["content"] = []
            events += self._add(self._message)
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            self._message["content"].append(part)
            where = {"item_id": self._message["id"], "output_index": self._index(self._message), "content_index": 0}
            events.append(self.event("response.content_part.added", **where, part=dict(part)))
        self._message["content"][0]["text"] += text
        sent, self._logprobs = self._logprobs, []
        self._message["content"][0]["logprobs"] += sent
        where = {"item_id": self._message["id"], "output_index": self._index(self._message), "content_index": 0}
        return events + [self.event("response.output_text.delta", **where, delta=text, logprobs=sent)]

    def _call_delta(self, d: dict) -> list:
        events = []
        item = self._calls.get(d["index"])
        if item is None:
            item = {
                "type": "function_call",
                "id": new_id("fc"),
                "call_id": d["id"],
                "name": d["function"]["name"],
                "arguments": "",
                "status": "in_progress",
            }
            self._calls[d["index"]] = item
            events += self._add(item)
        delta = d["function"].get("arguments", "")
        if delta:
            item["arguments"] += delta
            where = {"item_id": item["id"], "output_index": self._index(item)}
            events.append(self.event("response.function_call_arguments.delta", **where, delta=delta))
        return events

    def finish(self, status: str = "completed") -> list:
        """The held-back text, then every item's closing events, in output order; the items' ``status``
        (``incomplete`` when ``max_output_tokens`` cut the output, as OpenAI marks them)."""
        events = self._emit(self.parser.feed("", last=True))
        if self._message is not None:
            self._message["content"][0]["logprobs"] += self._logprobs
        self._logprobs = []
        for index, item in enumerate(self.items):
            item["status"] = status
            events += self._done(index, item)
        return events

    def _done(self, index: int, item: dict) -> list:
        """The closing events of the finished ``item`` at ``output_index`` ``index``."""
        where = {"item_id": item["id"], "output_index": index}
        if item["type"] == "reasoning":
            text = item["content"][0]["text"]
            events = [self.event("response.reasoning_text.done", **where, content_index=0, text=text)]
        elif item["type"] == "message":
            part = item["content"][0]
            events = [
                self.event(
                    "response.output_text.done", **where, content_index=0, text=part["text"], logprobs=part["logprobs"]
                ),
                self.event("response.content_part.done", **where, content_index=0, part=part),
            ]
        else:
            args = {"name": item["name"], "arguments": item["arguments"]}
            events = [self.event("response.function_call_arguments.done", **where, **args)]
        return events + [self.event("response.output_item.done", output_index=index, item=item)]


def output_text_logprobs(tokenizer, token_ids: list, entries: list | None, top_n: int) -> list:
    """``output_text.logprobs`` entries for tokens: ``{token, logprob, bytes, top_logprobs}`` as chat's
    (empty without ``entries``)."""
    if not entries:
        return []
    return chat_logprobs(tokenizer, token_ids, entries, top_n)["content"]


def conversation_of(items: list) -> list:
    """A response's output items as the chat messages a continuation sends back (reasoning dropped)."""
    text = "".join(p["text"] for it in items if it["type"] == "message" for p in it["content"])
    calls = [
        {"id": it["call_id"], "type": "function", "function": {"name": it["name"], "arguments": it["arguments"]}}
        for it in items
        if it["type"] == "function_call"
    ]
    message = {"role": "assistant", "content": text or None}
    if calls:
        message["tool_calls"] = calls
    return [message]


def item_status(choice) -> str:
    """An output item's final ``status`` for a choice that ended with ``choice.finish_reason``."""
    return "incomplete" if choice.finish_reason == "length" else "completed"


def finished_response(req, rid, created, model, items, final, prompt, reasoning_parser=None):
    """The final ``response`` object of a request whose last ``RequestOutput`` is ``final`` (its choice
    ended), its ``usage`` counted from the ``prompt``'s tokens (``final.num_cached_tokens`` of them from
    the prefix cache) and the choice's tokens (those of its reasoning, by ``reasoning_parser``)."""
    choice = final.outputs[0]
    cut = choice.finish_reason == "length"
    response = response_object(req, rid, created, model, "incomplete" if cut else "completed", items)
    reasoning = reasoning_token_count(reasoning_parser, prompt.tokenizer, choice.token_ids)
    response["usage"] = usage(len(prompt.ids), len(choice.token_ids), final.num_cached_tokens, reasoning)
    if cut:
        response["incomplete_details"] = {"reason": "max_output_tokens"}
    return response
