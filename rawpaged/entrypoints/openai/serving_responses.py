"""``POST /v1/responses`` and ``GET /v1/responses/{id}``: OpenAI's Responses API (what the ``openai`` SDK's
``client.responses.create`` calls), over the chat pipeline.

A request (``protocol_responses``) becomes a chat request (its checks, template, tools and constraints),
runs as one engine request, and its text is answered as output items: a ``reasoning`` item (with
``--reasoning-parser``), a ``message`` with one ``output_text`` part, and a ``function_call`` item per tool
call. ``stream: true`` sends the SDK's server-sent events, ``event: <type>`` then ``data: <json>``:
``response.created``, ``response.in_progress``, per item ``response.output_item.added`` /
``response.content_part.added`` / ``response.output_text.delta`` / ``response.reasoning_text.delta`` /
``response.function_call_arguments.delta`` and their ``.done`` events, then ``response.completed`` (or
``response.incomplete`` at ``max_output_tokens``), each with a ``sequence_number``.

Responses are kept (unless ``store: false``) in a bounded in-memory store (``ResponseStore``, the oldest
dropped first) for ``GET /v1/responses/{id}`` and ``previous_response_id``, which continues that response's
conversation; an id not there is a 404 in OpenAI's shape.
"""

from __future__ import annotations

import json
import time
import uuid
from collections import OrderedDict

from aiohttp import web

from rawpaged.engine.outputs import DeltaTracker
from rawpaged.entrypoints.admission import admit, check_capacity
from rawpaged.entrypoints.app_state import STATE
from rawpaged.entrypoints.http_body import read_body
from rawpaged.entrypoints.http_errors import ProtocolError, error_body
from rawpaged.entrypoints.http_responses import json_response
from rawpaged.entrypoints.openai.engine_requests import submitted
from rawpaged.entrypoints.openai.preprocessing import prepare_prompts
from rawpaged.entrypoints.openai.protocol import ChatCompletionRequest
from rawpaged.entrypoints.openai.protocol_responses import ResponsesRequest, chat_param
from rawpaged.entrypoints.openai.reasoning_parsers import ReasoningParser
from rawpaged.entrypoints.openai.request_body import decode_json, parse_request
from rawpaged.entrypoints.openai.response_writer import check_complete
from rawpaged.errors import EngineError

#: responses kept for retrieval and ``previous_response_id`` (the oldest dropped first)
DEFAULT_STORE_SIZE = 1000


class ResponseStore:
    """Finished responses by id: the response object and its conversation (chat messages, without the
    instructions), at most ``max_items``."""

    def __init__(self, max_items: int = DEFAULT_STORE_SIZE):
        self.max_items = max_items
        self._items: OrderedDict = OrderedDict()

    def put(self, response: dict, conversation: list) -> None:
        self._items[response["id"]] = (response, conversation)
        self._items.move_to_end(response["id"])
        while len(self._items) > self.max_items:
            self._items.popitem(last=False)

    def get(self, response_id: str, param: str | None = None) -> tuple:
        """``(response, conversation)``; a 404 ProtocolError in OpenAI's shape when it is not kept."""
        found = self._items.get(response_id)
        if found is None:
            code = "previous_response_not_found" if param else "response_not_found"
            raise ProtocolError(f"Response with id '{response_id}' not found.", param=param, status=404, code=code)
        return found


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _chat_request(req: ResponsesRequest, history: list, limits) -> ChatCompletionRequest:
    """The chat request ``req`` runs as; its refusals name the Responses field."""
    try:
        return parse_request(ChatCompletionRequest, req.chat_body(history), limits)
    except ProtocolError as e:
        raise ProtocolError(e.message, param=chat_param(e.param), status=e.status, type=e.type, code=e.code) from None


def _response_object(req: ResponsesRequest, rid: str, created: int, model: str, status: str, output: list) -> dict:
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
        "tools": [t.model_dump(exclude_none=True) for t in req.tools or ()],
        "tool_choice": req.tool_choice or "auto",
        "parallel_tool_calls": req.parallel_tool_calls is not False,
        "previous_response_id": req.previous_response_id,
        "store": req.stores,
        "text": {"format": fmt},
        "metadata": req.metadata or {},
        "reasoning": {"effort": None, "summary": None},
        "truncation": "disabled",
        "usage": None,
        "user": req.user,
    }


def _usage(input_tokens: int, output_tokens: int) -> dict:
    return {
        "input_tokens": input_tokens,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": output_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": input_tokens + output_tokens,
    }


class OutputItems:
    """A choice's text, fed piece by piece, as Responses output items and the stream events that build them
    (``feed``, then ``finish``): the reasoning parser first, then the tool parser on the rest. ``items``
    holds the items in output order, complete once ``finish`` returned."""

    def __init__(self, reasoning_parser: str | None, tool_parser, next_event):
        self.reasoner = ReasoningParser(reasoning_parser) if reasoning_parser else None
        self.tool_parser = tool_parser
        self.event = next_event  # (type, **fields) -> the event dict, numbered
        self.items: list = []
        self._reasoning = self._message = None
        self._calls: dict = {}  # tool parser's call index -> item

    def _add(self, item: dict) -> list:
        self.items.append(item)
        return [self.event("response.output_item.added", output_index=len(self.items) - 1, item=dict(item))]

    def _index(self, item) -> int:
        return next(i for i, it in enumerate(self.items) if it is item)

    def feed(self, text: str) -> list:
        reasoning, content = self.reasoner.feed(text) if self.reasoner else ("", text)
        return self._emit(reasoning, content)

    def _emit(self, reasoning: str, content: str, last: bool = False) -> list:
        events = []
        if reasoning:
            if self._reasoning is None:
                self._reasoning = {"type": "reasoning", "id": _new_id("rs"), "summary": [], "status": "in_progress"}
                events += self._add(self._reasoning)
                self._reasoning["content"] = [{"type": "reasoning_text", "text": ""}]
            self._reasoning["content"][0]["text"] += reasoning
            events.append(
                self.event(
                    "response.reasoning_text.delta",
                    item_id=self._reasoning["id"],
                    output_index=self._index(self._reasoning),
                    content_index=0,
                    delta=reasoning,
                )
            )
        if self.tool_parser is None:
            text, calls = content, []
        else:
            message = self.tool_parser.feed(content)
            text, calls = message.content, list(message.tool_calls)
            if last:
                rest = self.tool_parser.finish()
                text, calls = text + rest.content, calls + list(rest.tool_calls)
        if text:
            if self._message is None:
                self._message = {
                    "type": "message",
                    "id": _new_id("msg"),
                    "status": "in_progress",
                    "role": "assistant",
                    "content": [],
                }
                events += self._add(self._message)
                part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
                self._message["content"].append(part)
                events.append(
                    self.event(
                        "response.content_part.added",
                        item_id=self._message["id"],
                        output_index=self._index(self._message),
                        content_index=0,
                        part=dict(part),
                    )
                )
            self._message["content"][0]["text"] += text
            events.append(
                self.event(
                    "response.output_text.delta",
                    item_id=self._message["id"],
                    output_index=self._index(self._message),
                    content_index=0,
                    delta=text,
                    logprobs=[],
                )
            )
        for d in calls:
            item = self._calls.get(d["index"])
            if item is None:
                item = {
                    "type": "function_call",
                    "id": _new_id("fc"),
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
                events.append(
                    self.event(
                        "response.function_call_arguments.delta",
                        item_id=item["id"],
                        output_index=self._index(item),
                        delta=delta,
                    )
                )
        return events

    def finish(self) -> list:
        """The held-back text, then every item's closing events, in output order."""
        reasoning, content = self.reasoner.finish() if self.reasoner else ("", "")
        events = self._emit(reasoning, content, last=True)
        for index, item in enumerate(self.items):
            item["status"] = "completed"
            if item["type"] == "reasoning":
                events.append(
                    self.event(
                        "response.reasoning_text.done",
                        item_id=item["id"],
                        output_index=index,
                        content_index=0,
                        text=item["content"][0]["text"],
                    )
                )
            elif item["type"] == "message":
                part = item["content"][0]
                events.append(
                    self.event(
                        "response.output_text.done",
                        item_id=item["id"],
                        output_index=index,
                        content_index=0,
                        text=part["text"],
                        logprobs=[],
                    )
                )
                events.append(
                    self.event(
                        "response.content_part.done", item_id=item["id"], output_index=index, content_index=0, part=part
                    )
                )
            else:
                events.append(
                    self.event(
                        "response.function_call_arguments.done",
                        item_id=item["id"],
                        output_index=index,
                        name=item["name"],
                        arguments=item["arguments"],
                    )
                )
            events.append(self.event("response.output_item.done", output_index=index, item=item))
        return events


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


async def create_response(request: web.Request) -> web.StreamResponse:
    """``POST /v1/responses`` (see the module doc). Raises ProtocolError (the middleware answers it): 400
    naming the field, 404 for an unknown ``model`` or ``previous_response_id``, 503 while loading."""
    state = request.app[STATE]
    body = decode_json(await read_body(request))
    req = parse_request(ResponsesRequest, body, state.limits)
    history = []
    if req.previous_response_id is not None:
        _, history = state.responses.get(req.previous_response_id, param="previous_response_id")
    chat = _chat_request(req, history, state.limits)
    engine = admit(state, req.model)
    prompts = await prepare_prompts(engine, chat, state.limits)
    check_capacity(state, engine, len(prompts))
    rid, created = _new_id("resp"), int(time.time())
    # the conversation so far, without the instructions (not carried over, as OpenAI): history + input
    conversation = chat.model_dump(exclude_none=True)["messages"][1 if req.instructions else 0 :]
    async with submitted(engine, chat, prompts, rid) as streams:
        if req.stream:
            return await _stream(request, state, req, chat, rid, created, prompts[0], streams[0], conversation)
        final = None
        async for out in streams[0]:
            final = out
        check_complete(streams)
        choice = final.outputs[0]
        items = OutputItems(state.reasoning_parser, chat.tool_parser(), lambda kind, **f: None)
        items.feed(choice.text)
        items.finish()
        response = _finished(req, rid, created, state.model_name, items.items, choice, len(prompts[0].ids))
        if req.stores:
            state.responses.put(response, conversation + conversation_of(items.items))
        return json_response(response)


def _finished(req, rid, created, model, items, choice, input_tokens) -> dict:
    cut = choice.finish_reason == "length"
    response = _response_object(req, rid, created, model, "incomplete" if cut else "completed", items)
    response["usage"] = _usage(input_tokens, len(choice.token_ids))
    if cut:
        response["incomplete_details"] = {"reason": "max_output_tokens"}
    return response


async def _stream(request, state, req, chat, rid, created, prompt, stream, conversation) -> web.StreamResponse:
    resp = web.StreamResponse(
        status=200,
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )
    await resp.prepare(request)
    numbered = iter(range(1 << 62))

    def event(kind: str, **fields) -> dict:
        return {"type": kind, "sequence_number": next(numbered), **fields}

    async def send(events: list) -> None:
        for e in events:
            await resp.write(f"event: {e['type']}\ndata: {json.dumps(e)}\n\n".encode())

    model = state.model_name
    opening = _response_object(req, rid, created, model, "in_progress", [])
    items = OutputItems(state.reasoning_parser, chat.tool_parser(), event)
    tracker = DeltaTracker()
    try:
        await send([event("response.created", response=opening), event("response.in_progress", response=opening)])
        last = None
        async for out in stream:
            for d in tracker.deltas(out):
                await send(items.feed(d.text))
                if d.finish_reason is not None:
                    last = out.outputs[0]
        if last is None:
            raise EngineError("the request was aborted by the server")
        await send(items.finish())
        response = _finished(req, rid, created, model, items.items, last, len(prompt.ids))
        kind = "response.incomplete" if response["status"] == "incomplete" else "response.completed"
        await send([event(kind, response=response)])
        if req.stores:
            state.responses.put(response, conversation + conversation_of(items.items))
    except EngineError as e:
        await send([event("error", **error_body(str(e), e.type)["error"])])
    except ConnectionError:
        return resp
    try:
        await resp.write_eof()
    except ConnectionError:
        pass
    return resp


async def retrieve_response(request: web.Request) -> web.Response:
    """``GET /v1/responses/{response_id}``: a stored response, or a 404 in OpenAI's shape."""
    state = request.app[STATE]
    response, _ = state.responses.get(request.match_info["response_id"])
    return json_response(response)
