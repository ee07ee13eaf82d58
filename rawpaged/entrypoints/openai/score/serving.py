"""``POST /v1/score`` (vLLM's) and ``POST /v1/rerank`` (Jina's shape, as vLLM serves it; also at ``/rerank``
and ``/v2/rerank``), for a decoder model without a classifier head: every distinct text is embedded once
(``embeddings.serving.embed_prompts``, L2-normalized whatever ``--pooler-config`` says) and a pair's score
is the cosine similarity of its two embeddings, in [-1, 1]. The answers say so (``score_method``).
"""

from __future__ import annotations

import asyncio

import numpy as np
from aiohttp import web

from rawpaged.entrypoints.generation.admission import admit
from rawpaged.entrypoints.generation.output_json import new_id, now
from rawpaged.entrypoints.generation.request_body import parse_request
from rawpaged.entrypoints.http.body import read_body
from rawpaged.entrypoints.http.json_reply import json_response
from rawpaged.entrypoints.openai.embeddings.protocol import UsageInfo
from rawpaged.entrypoints.openai.embeddings.serving import embed_prompts, tokenize_inputs
from rawpaged.entrypoints.openai.score.protocol import (
    RerankDocument,
    RerankRequest,
    RerankResponse,
    RerankResult,
    RerankUsage,
    ScoreRequest,
    ScoreResponse,
    ScoreResponseData,
)
from rawpaged.entrypoints.server.state import STATE
from rawpaged.pooling_params import PoolingParams


async def embed_texts(engine, texts: list, fields: list, add_special_tokens: bool, base_id: str) -> tuple:
    """``({text: float32 unit vector}, prompt tokens)`` of the distinct ``texts`` (``fields[i]``: the
    request field ``texts[i]`` came from, named by a refusal)."""
    first = dict(zip(reversed(texts), reversed(fields)))  # each distinct text with the field it first came from
    unique = list(dict.fromkeys(texts))
    prompts = await asyncio.to_thread(tokenize_inputs, engine.tokenizer, unique, add_special_tokens)
    params_of = [first[t] for t in unique]
    outputs = await embed_prompts(engine, prompts, PoolingParams(normalize=True), base_id, params_of)
    vectors = {t: o.outputs.data for t, o in zip(unique, outputs)}
    return vectors, sum(len(o.prompt_token_ids) for o in outputs)


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    """The cosine similarity of two unit vectors (float64 dot product)."""
    return float(np.dot(a.astype(np.float64), b.astype(np.float64)))


async def create_score(request: web.Request) -> web.Response:
    """``POST /v1/score``: ``{"id", "object": "list", "created", "model", "data": [{"index", "object":
    "score", "score"}], "usage", "score_method": "cosine_similarity"}``, a score per pair in order.
    Raises ProtocolError (the middleware answers it)."""
    state = request.app[STATE]
    req = parse_request(ScoreRequest, await read_body(request), state.limits)
    engine = admit(state, req.model)
    pairs = req.pairs()
    texts = [t for pair in pairs for t in pair]
    fields = ["text_1", "text_2"] * len(pairs)
    rid = new_id("score")
    vectors, num_tokens = await embed_texts(engine, texts, fields, req.add_special_tokens, rid)
    body = ScoreResponse(
        id=rid,
        created=now(),
        model=state.model_name,
        data=[ScoreResponseData(index=i, score=cosine(vectors[a], vectors[b])) for i, (a, b) in enumerate(pairs)],
        usage=UsageInfo(prompt_tokens=num_tokens, total_tokens=num_tokens),
    )
    return json_response(body.model_dump())


async def create_rerank(request: web.Request) -> web.Response:
    """``POST /v1/rerank``: ``{"id", "model", "usage": {"total_tokens"}, "results": [{"index", "document":
    {"text"}, "relevance_score"}], "score_method": "cosine_similarity"}``, the ``top_n`` best documents
    first (all with none or 0; ties in input order). Raises ProtocolError (the middleware answers it)."""
    state = request.app[STATE]
    req = parse_request(RerankRequest, await read_body(request), state.limits)
    engine = admit(state, req.model)
    texts = [req.query, *req.documents]
    fields = ["query"] + ["documents"] * len(req.documents)
    rid = new_id("rerank")
    vectors, num_tokens = await embed_texts(engine, texts, fields, req.add_special_tokens, rid)
    scores = [cosine(vectors[req.query], vectors[d]) for d in req.documents]
    order = sorted(range(len(scores)), key=lambda i: -scores[i])[: req.top_n or None]
    results = [
        RerankResult(
            index=i,
            document=RerankDocument(text=req.documents[i]) if req.return_documents else None,
            relevance_score=scores[i],
        )
        for i in order
    ]
    body = RerankResponse(id=rid, model=state.model_name, usage=RerankUsage(total_tokens=num_tokens), results=results)
    return json_response(body.model_dump(exclude_none=True))
