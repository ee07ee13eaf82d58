"""``POST /v1/completions``: OpenAI's legacy completions (prompts as strings or token ids, ``echo``,
integer ``logprobs``, ``best_of``), JSON or server-sent events.

The handler takes a request through the steps ``serving_chat``'s does, in the same order, answering in
``CompletionFormat``'s shapes (``response_builders``).
"""

from __future__ import annotations

from aiohttp import web

from rawpaged.entrypoints.admission import admit, check_capacity
from rawpaged.entrypoints.app_state import STATE
from rawpaged.entrypoints.http_body import read_body
from rawpaged.entrypoints.openai.engine_requests import submitted
from rawpaged.entrypoints.openai.preprocessing import prepare_prompts
from rawpaged.entrypoints.openai.protocol import CompletionRequest
from rawpaged.entrypoints.openai.request_body import parse_request
from rawpaged.entrypoints.openai.response_builders import CompletionFormat, new_id
from rawpaged.entrypoints.openai.response_writer import write_response


async def create_completion(request: web.Request) -> web.StreamResponse:
    """``POST /v1/completions``; a refusal is raised as ``ProtocolError`` (the middleware answers it)."""
    state = request.app[STATE]
    req = parse_request(CompletionRequest, await read_body(request), state.limits)
    engine = admit(state, req.model)  # before the tokenizer's work
    prompts = await prepare_prompts(engine, req, state.limits)
    check_capacity(state, engine, len(prompts))
    rid = new_id("cmpl")
    async with submitted(engine, req, prompts, rid) as streams:
        return await write_response(request, state, req, CompletionFormat(), rid, prompts, streams)
