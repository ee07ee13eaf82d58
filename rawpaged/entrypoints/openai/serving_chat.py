"""``POST /v1/chat/completions``: OpenAI's chat completions (messages rendered with the model's chat
template, ``logprobs`` + ``top_logprobs``, the role in each choice's first chunk, tool calls), JSON or
server-sent events.

The handler takes a request through its steps in order: the body read (``http_body``) and parsed
(``request_body``), the request admitted (``admission``), its prompt prepared (``preprocessing``) and
submitted (``engine_requests``), and the answer written (``response_writer``) in ``ChatFormat``'s shapes
(``response_builders``).
"""

from __future__ import annotations

from aiohttp import web

from rawpaged.entrypoints.admission import admit, check_capacity
from rawpaged.entrypoints.app_state import STATE
from rawpaged.entrypoints.http_body import read_body
from rawpaged.entrypoints.openai.engine_requests import submitted
from rawpaged.entrypoints.openai.preprocessing import prepare_prompts
from rawpaged.entrypoints.openai.protocol import ChatCompletionRequest
from rawpaged.entrypoints.openai.request_body import parse_request
from rawpaged.entrypoints.openai.response_builders import ChatFormat, new_id
from rawpaged.entrypoints.openai.response_writer import write_response


async def create_chat_completion(request: web.Request) -> web.StreamResponse:
    """``POST /v1/chat/completions``; a refusal is raised as ``ProtocolError`` (the middleware answers it)."""
    state = request.app[STATE]
    req = parse_request(ChatCompletionRequest, await read_body(request), state.limits)
    engine = admit(state, req.model)  # before the tokenizer's work
    prompts = await prepare_prompts(engine, req, state.limits)
    check_capacity(state, engine, len(prompts))
    rid = new_id("chatcmpl")
    async with submitted(engine, req, prompts, rid) as streams:
        fmt = ChatFormat(state.reasoning_parser)
        return await write_response(request, state, req, fmt, rid, prompts, streams)
