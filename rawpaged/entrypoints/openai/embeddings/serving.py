"""``POST /v1/embeddings`` (OpenAI's; vLLM's ``serving_embedding``): each input becomes one pooling request
(prefill only, batched with whatever else the engine runs), and the answer lists their vectors in input
order, as floats or base64.

A request's inputs count as one toward the server's queue limit (``check_capacity``); each is checked by
the engine before any is queued (empty, ids outside the vocabulary, longer than ``max_model_len``, over the
pool), and a refusal aborts the ones already queued: nothing stays allocated. ``embed_prompts`` is shared
with ``/v1/score`` and ``/v1/rerank`` (``openai.score``).
"""

from __future__ import annotations

import asyncio

from aiohttp import web

from rawpaged.engine.engine_client import EngineClient
from rawpaged.entrypoints.generation.admission import admit
from rawpaged.entrypoints.generation.output_json import new_id, now
from rawpaged.entrypoints.generation.request_body import parse_request
from rawpaged.entrypoints.http.body import read_body
from rawpaged.entrypoints.http.errors import ProtocolError
from rawpaged.entrypoints.http.json_reply import json_response
from rawpaged.entrypoints.openai.embeddings.protocol import (
    EmbeddingRequest,
    EmbeddingResponse,
    EmbeddingResponseData,
    UsageInfo,
    encode_embedding,
)
from rawpaged.entrypoints.server.state import STATE
from rawpaged.errors import InvalidRequestError
from rawpaged.pooling_params import PoolingParams


def tokenize_inputs(tokenizer, items: list, add_special_tokens: bool = True) -> list:
    """``[(text or None, token ids)]`` of inputs that are strings (encoded) or token-id lists (as given)."""
    out = []
    for item in items:
        if isinstance(item, str):
            out.append((item, tokenizer.encode(item, add_special_tokens=add_special_tokens)))
        else:
            out.append((None, list(item)))
    return out


async def embed_prompts(
    engine: EngineClient, prompts: list, params: PoolingParams, base_id: str, params_of: list | None = None
) -> list:
    """The ``PoolingRequestOutput`` of each of ``prompts`` (``[(text or None, token ids)]``), in order.

    All are submitted at once (ids ``base_id-i``), so that the engine thread queues them together before its
    next step and they are prefilled in as few steps as the token budget allows (one by one, each add would
    wait for the step in flight); then awaited. Every one is aborted when this ends, however it ends (a no-op
    for finished ones), so a refusal leaves nothing queued. The engine's refusal (``InvalidRequestError``, the
    first in input order) becomes a ProtocolError naming the client's field: for a prompt, ``params_of[i]``
    (the field prompt ``i`` came from; default "input"), else the engine's (``dimensions``)."""
    adds = [
        engine.add_request({"prompt_token_ids": ids, "prompt": text}, params, f"{base_id}-{i}")
        for i, (text, ids) in enumerate(prompts)
    ]
    added = await asyncio.gather(*adds, return_exceptions=True)
    streams = [s for s in added if not isinstance(s, BaseException)]
    try:
        for i, result in enumerate(added):
            if isinstance(result, InvalidRequestError):
                field = params_of[i] if params_of else "input"
                raise ProtocolError(str(result), param=field if result.param == "prompt" else result.param)
            if isinstance(result, BaseException):
                raise result
        return await asyncio.gather(*(_final(s) for s in streams))
    finally:
        for s in streams:
            engine.abort(s.request_id)


async def _final(stream):
    last = None
    async for out in stream:
        last = out
    if last is None:  # aborted: the server is draining or the client left
        raise ProtocolError("the request was aborted", status=503, type="service_unavailable_error")
    return last


async def create_embedding(request: web.Request) -> web.Response:
    """``POST /v1/embeddings``: ``{"id", "object": "list", "created", "model", "data": [{"index", "object":
    "embedding", "embedding"}], "usage": {"prompt_tokens", "total_tokens"}}``. Raises ProtocolError (the
    middleware answers it): 400 naming the field, 404 for another model, 503 while loading or full."""
    state = request.app[STATE]
    req = parse_request(EmbeddingRequest, await read_body(request), state.limits)
    engine = admit(state, req.model)
    try:
        params = req.pooling_params()
    except ValueError as e:
        raise ProtocolError(str(e), param=str(e).split(" ", 1)[0]) from None
    prompts = await asyncio.to_thread(tokenize_inputs, engine.tokenizer, req.items(), req.add_special_tokens)
    rid = new_id("embd")
    outputs = await embed_prompts(engine, prompts, params, rid)
    num_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    body = EmbeddingResponse(
        id=rid,
        created=now(),
        model=state.model_name,
        data=[
            EmbeddingResponseData(index=i, embedding=encode_embedding(o.outputs.data, req.encoding_format))
            for i, o in enumerate(outputs)
        ],
        usage=UsageInfo(prompt_tokens=num_tokens, total_tokens=num_tokens),
    )
    return json_response(body.model_dump())
