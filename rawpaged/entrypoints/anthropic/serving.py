"""``POST /v1/messages`` and ``POST /v1/messages/count_tokens``: Anthropic's Messages API over the chat
pipeline (template, tools, reasoning, constraints, checks), one generation each, as JSON or as Anthropic's
named server-sent events: ``message_start``, ``ping``, then each content block's ``content_block_start``,
``content_block_delta`` (``text_delta``, ``thinking_delta`` and its ``signature_delta``,
``input_json_delta``) and ``content_block_stop``, then ``message_delta`` (``stop_reason``, the usage) and
``message_stop``; an engine failure ends the stream with an ``error`` event. Errors are in Anthropic's shape
(the middleware rewrites them on these routes: ``http.errors.is_anthropic_path``). The
``anthropic-version`` and ``anthropic-beta`` headers are accepted and not read.
"""

from __future__ import annotations

import asyncio

from aiohttp import web

from rawpaged.entrypoints.anthropic.content_blocks import ContentBlocks, message_object, new_id, usage
from rawpaged.entrypoints.anthropic.protocol import CountTokensRequest, MessagesRequest
from rawpaged.entrypoints.generation.admission import (
    admit,
    check_capacity,
    check_model,
    lora_request_of,
    require_engine,
    served_model_name,
)
from rawpaged.entrypoints.generation.engine_requests import submitted
from rawpaged.entrypoints.generation.preprocessing import encode_conversation, prepare_prompts
from rawpaged.entrypoints.generation.reply_writer import last_output, stream_deltas
from rawpaged.entrypoints.generation.request_body import parse_request
from rawpaged.entrypoints.http.body import read_body
from rawpaged.entrypoints.http.errors import anthropic_error_body, anthropic_error_type
from rawpaged.entrypoints.http.json_reply import json_response
from rawpaged.entrypoints.http.sse import typed_event, write_events
from rawpaged.entrypoints.server.state import STATE
from rawpaged.errors import EngineError


async def create_message(request: web.Request) -> web.StreamResponse:
    """``POST /v1/messages`` (see the module doc). Raises ProtocolError (the middleware answers it in
    Anthropic's shape): 400 naming the field, 404 for an unknown ``model``, 529 while loading or full."""
    state = request.app[STATE]
    req = parse_request(MessagesRequest, await read_body(request), state.limits)
    engine = admit(state, req.model)
    prompts = await prepare_prompts(engine, req, state.limits)
    check_capacity(state, engine, len(prompts))
    mid, blocks = new_id("msg"), ContentBlocks(req, state.reasoning_parser)
    async with submitted(engine, req, prompts, mid, lora_request_of(state, req.model)) as streams:
        if req.stream:
            events = _events(state, blocks, mid, prompts[0], streams[0], served_model_name(state, req.model))
            return await write_events(request, events, _error_event)
        final = await last_output(streams[0])
    choice = final.outputs[0]
    blocks.feed(choice.text)
    blocks.finish()
    stop_reason, stop_sequence = blocks.stop(choice, prompts[0].tokenizer)
    used = usage(len(prompts[0].ids), len(choice.token_ids), final.num_cached_tokens)
    model = served_model_name(state, req.model)
    return json_response(message_object(mid, model, blocks.blocks, stop_reason, stop_sequence, used))


def _error_event(e: EngineError) -> bytes:
    """An engine failure as a stream's last event: Anthropic's ``error`` event."""
    status = 529 if e.status == 503 else e.status
    return typed_event(anthropic_error_body(str(e), anthropic_error_type(status)))


async def _events(state, blocks: ContentBlocks, mid: str, prompt, stream, model: str):
    """The stream's events (``sse.typed_event``). ``message_start`` waits for the first output, which
    brings the prefix cache's hits for its ``usage``."""
    started, final = False, None
    async for out, d in stream_deltas(stream):
        if not started:
            opening = message_object(mid, model, [], None, None, usage(len(prompt.ids), 0, out.num_cached_tokens))
            yield typed_event({"type": "message_start", "message": opening})
            yield typed_event({"type": "ping"})
            started = True
        for e in blocks.feed(d.text):
            yield typed_event(e)
        if d.finish_reason is not None:
            final = out
    if final is None:
        raise EngineError("the request was aborted by the server")
    for e in blocks.finish():
        yield typed_event(e)
    choice = final.outputs[0]
    stop_reason, stop_sequence = blocks.stop(choice, prompt.tokenizer)
    used = usage(len(prompt.ids), len(choice.token_ids), final.num_cached_tokens)
    yield typed_event(
        {"type": "message_delta", "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence}, "usage": used}
    )
    yield typed_event({"type": "message_stop"})


async def count_tokens(request: web.Request) -> web.Response:
    """``POST /v1/messages/count_tokens``: ``{"input_tokens": int}``, the tokens of the conversation as
    ``/v1/messages`` renders it (system, tools and messages through the chat template, with the reply's
    opening). Nothing is queued; 503 (529 here) while the model loads, 404 for an unknown ``model``."""
    state = request.app[STATE]
    req = parse_request(CountTokensRequest, await read_body(request), state.limits)
    check_model(state, req.model)
    engine = require_engine(state)
    options = {"add_generation_prompt": req.add_generation_prompt, "continue_final_message": req.continue_final_message}
    _, ids = await asyncio.to_thread(encode_conversation, engine.tokenizer, req, None, **options)
    return json_response({"input_tokens": len(ids)})
