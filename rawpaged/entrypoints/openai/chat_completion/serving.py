"""``POST /v1/chat/completions``: OpenAI's chat completions (messages rendered with the model's chat
template, ``logprobs`` + ``top_logprobs``, the role in each choice's first chunk, tool calls), JSON or
server-sent events.

The handler takes a request through its steps in order: the body read (``http.body``) and parsed
(``request_body``), the request admitted (``admission``), its prompt prepared (``preprocessing``) and
submitted (``engine_requests``), and the answer written (``reply_writer``) in ``ChatFormat``'s shapes
(``output_json``).
"""

from __future__ import annotations

from aiohttp import web

from rawpaged.entrypoints.generation.admission import admit, check_capacity, lora_request_of
from rawpaged.entrypoints.generation.engine_requests import submitted
from rawpaged.entrypoints.generation.output_json import ChatFormat, new_id
from rawpaged.entrypoints.generation.preprocessing import prepare_prompts
from rawpaged.entrypoints.generation.reply_writer import write_response
from rawpaged.entrypoints.generation.request_body import parse_request
from rawpaged.entrypoints.http.body import read_body
from rawpaged.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from rawpaged.entrypoints.server.state import STATE


async def create_chat_completion(request: web.Request) -> web.StreamResponse:
    """``POST /v1/chat/completions``; a refusal is raised as ``ProtocolError`` (the middleware answers it)."""
    state = request.app[STATE]
    req = parse_request(ChatCompletionRequest, await read_body(request), state.limits)
    engine = admit(state, req.model)  # before the tokenizer's work
    prompts = await prepare_prompts(engine, req, state.limits)
    check_capacity(state, engine, len(prompts))
    rid, fmt = new_id("chatcmpl"), ChatFormat(state.reasoning_parser)
    async with submitted(engine, req, prompts, rid, lora_request_of(state, req.model)) as streams:
        return await write_response(request, state, req, fmt, rid, prompts, streams)
