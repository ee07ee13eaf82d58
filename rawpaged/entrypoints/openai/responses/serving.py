"""``POST /v1/responses`` and ``GET /v1/responses/{id}``: OpenAI's Responses API (what the ``openai`` SDK's
``client.responses.create`` calls), over the chat pipeline.

A request (``protocol``) becomes a chat request (its checks, template, tools and constraints),
runs as one engine request, and its text is answered as output items (``output_items``): a ``reasoning`` item (with
``--reasoning-parser``), a ``message`` with one ``output_text`` part, and a ``function_call`` item per tool
call. ``stream: true`` sends the SDK's server-sent events, ``event: <type>`` then ``data: <json>``:
``response.created``, ``response.in_progress``, per item ``response.output_item.added`` /
``response.content_part.added`` / ``response.output_text.delta`` / ``response.reasoning_text.delta`` /
``response.function_call_arguments.delta`` and their ``.done`` events, then ``response.completed`` (or
``response.incomplete`` at ``max_output_tokens``), each with a ``sequence_number``.

Responses are kept (unless ``store: false``) in a bounded in-memory store (``ResponseStore``, the oldest
dropped first) for ``GET /v1/responses/{id}`` and ``previous_response_id``, which continues that response's
conversation; an id not there is a 404 in OpenAI's shape.

``background: true`` answers at once with a ``queued`` response, kept in the store, and runs it in a task:
``in_progress``, then ``completed``/``incomplete`` (or ``failed`` with its ``error``); ``POST
/v1/responses/{id}/cancel`` aborts it (``cancelled``, vLLM's semantics: a response that is no longer queued or
in progress is a 400).
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict

from aiohttp import web

from rawpaged.engine.outputs import DeltaTracker
from rawpaged.entrypoints.generation.admission import admit, check_capacity
from rawpaged.entrypoints.generation.engine_requests import add_requests, submitted
from rawpaged.entrypoints.generation.preprocessing import prepare_prompts
from rawpaged.entrypoints.generation.reasoning_parsers import reasoning_token_count
from rawpaged.entrypoints.generation.reply_writer import check_complete
from rawpaged.entrypoints.generation.request_body import decode_json, parse_request
from rawpaged.entrypoints.http.body import read_body
from rawpaged.entrypoints.http.errors import ProtocolError, error_body
from rawpaged.entrypoints.http.json_reply import json_response
from rawpaged.entrypoints.http.sse import typed_event, write_events
from rawpaged.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from rawpaged.entrypoints.openai.responses.output_items import (
    OutputItems,
    conversation_of,
    finished_response,
    item_status,
    new_id,
    output_text_logprobs,
    response_object,
)
from rawpaged.entrypoints.openai.responses.protocol import ResponsesRequest, chat_param
from rawpaged.entrypoints.server.state import STATE
from rawpaged.errors import EngineError

#: responses kept for retrieval and ``previous_response_id`` (the oldest dropped first)
DEFAULT_STORE_SIZE = 1000


class ResponseStore:
    """Finished responses by id: the response object and its conversation (chat messages, without the
    instructions), at most ``max_items``."""

    def __init__(self, max_items: int = DEFAULT_STORE_SIZE):
        self.max_items = max_items
        self._items: OrderedDict = OrderedDict()
        self.tasks: dict = {}  # background response id -> its asyncio task

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


def responses_error(e: ProtocolError) -> ProtocolError:
    """A refusal of the chat request (or of its prompt or constraint, later) as the Responses API names
    things: its ``param`` and the message's leading field (``max_tokens`` -> ``max_output_tokens``,
    ``response_format`` -> ``text``, ``messages`` -> ``input``)."""
    param, message = chat_param(e.param), e.message
    if param != e.param and e.param and message.startswith(e.param.split(".")[0]):
        message = param + message[len(e.param.split(".")[0]) :]
    return ProtocolError(message, param=param, status=e.status, type=e.type, code=e.code, headers=e.headers)


async def create_response(request: web.Request) -> web.StreamResponse:
    """``POST /v1/responses`` (see the module doc). Raises ProtocolError (the middleware answers it): 400
    naming the field, 404 for an unknown ``model`` or ``previous_response_id``, 503 while loading."""
    state = request.app[STATE]
    body = decode_json(await read_body(request))
    req = parse_request(ResponsesRequest, body, state.limits)
    history = []
    if req.previous_response_id is not None:
        _, history = state.responses.get(req.previous_response_id, param="previous_response_id")
    rid, created = new_id("resp"), int(time.time())
    try:  # the chat pipeline's refusals (its request, the prompt's length, a schema) in this API's names
        chat = parse_request(ChatCompletionRequest, req.chat_body(history), state.limits)
        engine = admit(state, req.model)
        prompts = await prepare_prompts(engine, chat, state.limits)
        check_capacity(state, engine, len(prompts))
        # the conversation so far, without the instructions (not carried over, as OpenAI): history + input
        conversation = chat.model_dump(exclude_none=True)["messages"][1 if req.instructions else 0 :]
        if req.background:
            streams = await add_requests(engine, chat, prompts, rid)
            return _start_background(state, engine, req, chat, rid, created, prompts[0], streams, conversation)
        async with submitted(engine, chat, prompts, rid) as streams:
            if req.stream:
                return await _stream(request, state, req, chat, rid, created, prompts[0], streams[0], conversation)
            response, items = await _final_response(state, req, chat, rid, created, prompts[0], streams)
    except ProtocolError as e:
        raise responses_error(e) from None
    if req.stores:
        state.responses.put(response, conversation + conversation_of(items.items))
    return json_response(response)


def _logprobs(req, prompt, token_ids, entries) -> list:
    if not req.wants_logprobs:
        return []
    return output_text_logprobs(prompt.tokenizer, token_ids, entries, req.top_logprobs or 0)


def _token_counts(state, prompt, final, choice) -> tuple:
    """``(input tokens, of them cached, reasoning tokens)`` of a finished request: its prompt, the prompt
    tokens served from the prefix cache (``final``: its last ``RequestOutput``), and the reasoning tokens
    of ``choice`` (with ``--reasoning-parser``)."""
    reasoning = reasoning_token_count(state.reasoning_parser, prompt.tokenizer, choice.token_ids)
    return len(prompt.ids), final.num_cached_tokens, reasoning


async def _final_response(state, req, chat, rid, created, prompt, streams) -> tuple:
    """The finished response of a request that is not streamed, and its ``OutputItems``."""
    final = None
    async for out in streams[0]:
        final = out
    check_complete(streams)
    choice = final.outputs[0]
    items = OutputItems(state.reasoning_parser, chat.tool_parser(), lambda kind, **f: None)
    items.feed(choice.text, _logprobs(req, prompt, choice.token_ids, choice.logprobs))
    items.finish(item_status(choice))
    counts = _token_counts(state, prompt, final, choice)
    return finished_response(req, rid, created, state.model_name, items.items, choice, *counts), items


def _start_background(state, engine, req, chat, rid, created, prompt, streams, conversation) -> web.Response:
    """Keep a ``queued`` response and run the request in a task that keeps its progress and result."""
    queued = response_object(req, rid, created, state.model_name, "queued", [])
    state.responses.put(queued, conversation)

    async def run() -> None:
        try:
            state.responses.put(response_object(req, rid, created, state.model_name, "in_progress", []), conversation)
            response, items = await _final_response(state, req, chat, rid, created, prompt, streams)
            state.responses.put(response, conversation + conversation_of(items.items))
        except EngineError as e:
            failed = response_object(req, rid, created, state.model_name, "failed", [])
            failed["error"] = {"code": "server_error", "message": str(e)}
            state.responses.put(failed, conversation)
        finally:
            for s in streams:
                engine.abort(s.request_id)
            state.responses.tasks.pop(rid, None)

    state.responses.tasks[rid] = asyncio.get_running_loop().create_task(run())
    return json_response(queued)


async def _stream(request, state, req, chat, rid, created, prompt, stream, conversation) -> web.StreamResponse:
    numbered = iter(range(1 << 62))

    def event(kind: str, **fields) -> dict:
        return {"type": kind, "sequence_number": next(numbered), **fields}

    def error_event(e: EngineError) -> bytes:
        return typed_event(event("error", **error_body(str(e), e.type)["error"]))

    events = _events(state, req, chat, rid, created, prompt, stream, conversation, event)
    return await write_events(request, events, error_event)


async def _events(state, req, chat, rid, created, prompt, stream, conversation, event):
    """The stream's events (``sse.typed_event``), numbered by ``event``; the finished response is kept
    (unless ``store: false``)."""
    model = state.model_name
    opening = response_object(req, rid, created, model, "in_progress", [])
    items = OutputItems(state.reasoning_parser, chat.tool_parser(), event)
    tracker = DeltaTracker()
    for e in (event("response.created", response=opening), event("response.in_progress", response=opening)):
        yield typed_event(e)
    last = None
    async for out in stream:
        for d in tracker.deltas(out):
            for e in items.feed(d.text, _logprobs(req, prompt, d.token_ids, d.logprobs)):
                yield typed_event(e)
            if d.finish_reason is not None:
                final, last = out, out.outputs[0]
    if last is None:
        raise EngineError("the request was aborted by the server")
    for e in items.finish(item_status(last)):
        yield typed_event(e)
    counts = _token_counts(state, prompt, final, last)
    response = finished_response(req, rid, created, model, items.items, last, *counts)
    kind = "response.incomplete" if response["status"] == "incomplete" else "response.completed"
    yield typed_event(event(kind, response=response))
    if req.stores:
        state.responses.put(response, conversation + conversation_of(items.items))


async def retrieve_response(request: web.Request) -> web.Response:
    """``GET /v1/responses/{response_id}``: a stored response, or a 404 in OpenAI's shape."""
    state = request.app[STATE]
    response, _ = state.responses.get(request.match_info["response_id"])
    return json_response(response)


async def cancel_response(request: web.Request) -> web.Response:
    """``POST /v1/responses/{response_id}/cancel``: a background response that is queued or in progress is
    aborted and kept as ``cancelled``; any other is a 400, an unknown id a 404 (vLLM's semantics)."""
    state = request.app[STATE]
    rid = request.match_info["response_id"]
    response, conversation = state.responses.get(rid)
    if response["status"] not in ("queued", "in_progress"):
        raise ProtocolError("Cannot cancel a synchronous response.", param="response_id")
    cancelled = dict(response, status="cancelled")
    task = state.responses.tasks.get(rid)
    if task is not None:
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            pass
    state.responses.put(cancelled, conversation)
    return json_response(cancelled)


async def cancel_background_responses(app) -> None:
    """On shutdown: every background response still running is cancelled (its requests aborted)."""
    for task in list(app[STATE].responses.tasks.values()):
        task.cancel()
