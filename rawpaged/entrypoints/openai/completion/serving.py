"""``POST /v1/completions``: OpenAI's legacy completions (prompts as strings or token ids, ``echo``,
integer ``logprobs``, ``best_of``), JSON or server-sent events.

The handler takes a request through the steps ``chat_completion.serving``'s does, in the same order, answering in
``CompletionFormat``'s shapes (``output_json``).
"""

from __future__ import annotations

from aiohttp import web

from rawpaged.entrypoints.generation.admission import admit, check_capacity, lora_request_of
from rawpaged.entrypoints.generation.engine_requests import submitted
from rawpaged.entrypoints.generation.output_json import CompletionFormat, new_id
from rawpaged.entrypoints.generation.preprocessing import prepare_prompts
from rawpaged.entrypoints.generation.reply_writer import write_response
from rawpaged.entrypoints.generation.request_body import parse_request
from rawpaged.entrypoints.http.body import read_body
from rawpaged.entrypoints.openai.completion.protocol import CompletionRequest
from rawpaged.entrypoints.server.state import STATE


async def create_completion(request: web.Request) -> web.StreamResponse:
    """``POST /v1/completions``; a refusal is raised as ``ProtocolError`` (the middleware answers it)."""
    state = request.app[STATE]
    req = parse_request(CompletionRequest, await read_body(request), state.limits)
    engine = admit(state, req.model)  # before the tokenizer's work
    prompts = await prepare_prompts(engine, req, state.limits)
    check_capacity(state, engine, len(prompts))
    rid = new_id("cmpl")
    async with submitted(engine, req, prompts, rid, lora_request_of(state, req.model)) as streams:
        return await write_response(request, state, req, CompletionFormat(), rid, prompts, streams)
