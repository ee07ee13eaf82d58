"""``POST /v1/responses`` and ``GET /v1/responses/{id}``: OpenAI's Responses API (what the ``openai`` SDK's
``client.responses.create`` calls), over the generation pipeline chat runs.

A request (``protocol``: its fields mapped onto the shared ones, so the pipeline's checks, template,
tools and constraints are chat's) runs as one engine request, and its text is answered as output items
(``output_items``): a ``reasoning`` item (with ``--reasoning-parser``), a ``message`` with one
``output_text`` part, and a ``function_call`` item per tool call. ``stream: true`` sends the SDK's
server-sent events (``http.sse``), ``event: <type>`` then ``data: <json>``:
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

from rawpaged.entrypoints.generation.admission import admit, check_capacity, lora_request_of, served_model_name
from rawpaged.entrypoints.generation.engine_requests import add_requests, submitted
from rawpaged.entrypoints.generation.preprocessing import prepare_prompts
from rawpaged.entrypoints.generation.reply_writer import last_output, stream_deltas
from rawpaged.entrypoints.generation.request_body import parse_request
from rawpaged.entrypoints.http.body import read_body
from rawpaged.entrypoints.http.errors import ProtocolError, error_body
from rawpaged.entrypoints.http.json_reply import json_response
from rawpaged.entrypoints.http.sse import typed_event, write_events
from rawpaged.entrypoints.openai.responses.output_items import (
    OutputItems,
    conversation_of,
    item_status,
    new_id,
    response_object,
)
from rawpaged.entrypoints.openai.responses.protocol import ResponsesRequest
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


async def create_response(request: web.Request) -> web.StreamResponse:
    """``POST /v1/responses`` (see the module doc). Raises ProtocolError (the middleware answers it): 400
    naming the field, 404 for an unknown ``model`` or ``previous_response_id``, 503 while loading."""
    state = request.app[STATE]
    req = parse_request(ResponsesRequest, await read_body(request), state.limits)
    history = []
    if req.previous_response_id is not None:
        _, history = state.responses.get(req.previous_response_id, param="previous_response_id")
    conversation = req.start(history, state.limits)  # history + input, without the instructions
    engine = admit(state, req.model)
    prompts = await prepare_prompts(engine, req, state.limits)
    check_capacity(state, engine, len(prompts))
    rid, created = new_id("resp"), int(time.time())
    items = OutputItems(req, state.reasoning_parser)
    if req.background:
        streams = await add_requests(engine, req, prompts, rid, lora_request=lora_request_of(state, req.model))
        return _start_background(state, engine, items, rid, created, prompts[0], streams, conversation)
    async with submitted(engine, req, prompts, rid, lora_request_of(state, req.model)) as streams:
        if req.stream:
            return await _stream(request, state, items, rid, created, prompts[0], streams[0], conversation)
        response = await _final_response(state, items, rid, created, prompts[0], streams[0])
    if req.stores:
        state.responses.put(response, conversation + conversation_of(items.items))
    return json_response(response)


async def _final_response(state, items, rid, created, prompt, stream) -> dict:
    """The finished response of a request that is not streamed (its items in ``items``)."""
    final = await last_output(stream)
    choice = final.outputs[0]
    items.feed(choice.text, items.logprobs(prompt, choice.token_ids, choice.logprobs))
    items.finish(item_status(choice))
    return items.response(rid, created, served_model_name(state, items.req.model), final, prompt)


def _start_background(state, engine, items, rid, created, prompt, streams, conversation) -> web.Response:
    """Keep a ``queued`` response and run the request in a task that keeps its progress and result."""
    req = items.req
    model = served_model_name(state, req.model)
    queued = response_object(req, rid, created, model, "queued", [])
    state.responses.put(queued, conversation)

    async def run() -> None:
        try:
            state.responses.put(response_object(req, rid, created, model, "in_progress", []), conversation)
            response = await _final_response(state, items, rid, created, prompt, streams[0])
            state.responses.put(response, conversation + conversation_of(items.items))
        except EngineError as e:
            failed = response_object(req, rid, created, model, "failed", [])
            failed["error"] = {"code": "server_error", "message": str(e)}
            state.responses.put(failed, conversation)
        finally:
            for s in streams:
                engine.abort(s.request_id)
            state.responses.tasks.pop(rid, None)

    state.responses.tasks[rid] = asyncio.get_running_loop().create_task(run())
    return json_response(queued)


async def _stream(request, state, items, rid, created, prompt, stream, conversation) -> web.StreamResponse:
    def error_event(e: EngineError) -> bytes:
        return typed_event(items.event("error", **error_body(str(e), e.type)["error"]))

    events = _events(state, items, rid, created, prompt, stream, conversation)
    return await write_events(request, events, error_event)


async def _events(state, items, rid, created, prompt, stream, conversation):
    """The stream's events (``sse.typed_event``), numbered by ``items``; the finished response is kept
    (unless ``store: false``)."""
    req = items.req
    model = served_model_name(state, req.model)
    opening = response_object(req, rid, created, model, "in_progress", [])
    for e in (items.event("response.created", response=opening), items.event("response.in_progress", response=opening)):
        yield typed_event(e)
    final = None
    async for out, d in stream_deltas(stream):
        for e in items.feed(d.text, items.logprobs(prompt, d.token_ids, d.logprobs)):
            yield typed_event(e)
        if d.finish_reason is not None:
            final = out
    if final is None:
        raise EngineError("the request was aborted by the server")
    for e in items.finish(item_status(final.outputs[0])):
        yield typed_event(e)
    response = items.response(rid, created, model, final, prompt)
    kind = "response.incomplete" if response["status"] == "incomplete" else "response.completed"
    yield typed_event(items.event(kind, response=response))
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
