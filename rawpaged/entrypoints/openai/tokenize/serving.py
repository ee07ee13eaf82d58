"""vLLM's tokenizer routes (``vllm/entrypoints/openai/serving_tokenization.py``): ``POST /tokenize``,
``POST /detokenize`` and ``GET /tokenizer_info``, at the server's root as vLLM has them (lm-evaluation-harness'
``tokenizer_backend="remote"`` calls all three).

Each reads the served model's tokenizer only: nothing is queued, so there is no capacity check, but the
routes answer 503 while the model loads (``admission.require_engine``) and 404 for an unknown ``model``.
Tokenizing and decoding run in a worker thread, as a generation request's prompt does (``preprocessing``).
"""

from __future__ import annotations

import asyncio

from aiohttp import web

from rawpaged.entrypoints.generation.admission import check_model, require_engine
from rawpaged.entrypoints.generation.preprocessing import encode_conversation
from rawpaged.entrypoints.generation.request_body import decode_json, parse_request
from rawpaged.entrypoints.http.body import read_body
from rawpaged.entrypoints.http.errors import ProtocolError
from rawpaged.entrypoints.http.json_reply import json_response
from rawpaged.entrypoints.openai.tokenize.protocol import (
    DetokenizeRequest,
    TokenizeChatRequest,
    TokenizeRequest,
    tokenize_request_model,
)
from rawpaged.entrypoints.server.state import STATE
from rawpaged.tokenizer import Tokenizer

#: the fields of an HF ``AddedToken`` as ``tokenizer_config.json`` writes one (``{"content": "<s>", ...}``)
_ADDED_TOKEN_FIELDS = frozenset({"__type", "content", "lstrip", "rstrip", "normalized", "single_word", "special"})


async def create_tokenize(request: web.Request) -> web.Response:
    """``POST /tokenize``: ``{"count": int, "max_model_len": int, "tokens": [int], "token_strs": [str] | null}``
    (``token_strs`` with ``return_token_strs``: each token as the vocabulary spells it). Raises
    ProtocolError (the middleware answers it): 400 naming the field, 404, 503 while loading."""
    state = request.app[STATE]
    body = decode_json(await read_body(request))
    req = parse_request(tokenize_request_model(body), body, state.limits)
    check_model(state, req.model)
    engine = require_engine(state)
    ids = await asyncio.to_thread(tokenize, engine.tokenizer, req)
    return json_response(
        {
            "count": len(ids),
            "max_model_len": engine.max_model_len,
            "tokens": ids,
            "token_strs": engine.tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None,
        }
    )


async def create_detokenize(request: web.Request) -> web.Response:
    """``POST /detokenize``: ``{"prompt": str}``, the text of ``tokens`` with special tokens written out (as
    HF's ``decode`` and vLLM give it). Raises ProtocolError: 400 naming ``tokens`` for an id that is not
    in the tokenizer's vocabulary, 404, 503 while loading."""
    state = request.app[STATE]
    req = parse_request(DetokenizeRequest, await read_body(request), state.limits)
    check_model(state, req.model)
    engine = require_engine(state)
    return json_response({"prompt": await asyncio.to_thread(detokenize, engine.tokenizer, req.tokens)})


async def get_tokenizer_info(request: web.Request) -> web.Response:
    """``GET /tokenizer_info``: the tokenizer's configuration (``tokenizer_info``). Raises ProtocolError:
    503 while loading."""
    engine = require_engine(request.app[STATE])
    return json_response(tokenizer_info(engine.tokenizer, engine.max_model_len))


def tokenize(tok: Tokenizer, req: TokenizeRequest) -> list:
    """The token ids (``[int]``) of a ``/tokenize`` request: its chat rendered and tokenized as
    ``/v1/chat/completions`` does (``preprocessing.encode_conversation``), or its prompt as ``Tokenizer.encode``
    tokenizes a raw prompt. Raises ProtocolError naming ``messages`` when the conversation cannot be
    rendered."""
    if isinstance(req, TokenizeChatRequest):
        _, ids = encode_conversation(
            tok,
            req,
            add_generation_prompt=req.add_generation_prompt,
            continue_final_message=req.continue_final_message,
            add_special_tokens=req.add_special_tokens,
        )
        return ids
    return tok.encode(req.prompt, req.add_special_tokens)


def detokenize(tok: Tokenizer, tokens: list) -> str:
    """The text of ``tokens`` (``[int]``), special tokens included.

    Raises:
        ProtocolError: 400 naming ``tokens`` (and the index) for the first id the vocabulary lacks.
    """
    for i, piece in enumerate(tok.convert_ids_to_tokens(tokens)):
        if piece is None:
            raise ProtocolError(
                f"tokens[{i}] is {tokens[i]}, not a token id of this model's tokenizer "
                f"(its vocabulary has {tok.vocab_size} tokens)",
                param="tokens",
            )
    return tok.decode(tokens, skip_special_tokens=False)


def tokenizer_info(tok: Tokenizer, max_model_len: int) -> dict:
    """The tokenizer's configuration as vLLM's ``/tokenizer_info`` gives it: ``tokenizer_config.json``'s
    fields, added tokens as their text (``{"content": "<s>", ...}`` -> ``"<s>"``) and server file paths
    left out, plus ``tokenizer_class`` (str), ``chat_template`` (the template the server renders with, or
    None), ``bos_token``/``eos_token``/``pad_token``/``unk_token`` (str or None, always present),
    ``model_max_length`` (the served context, ``max_model_len``) and ``added_tokens_decoder``
    (``{"<id>": "<text>"}``)."""
    info = {k: _added_token_text(v) for k, v in tok.config.items() if not (k.endswith("_file") or k == "name_or_path")}
    for name in ("pad_token", "unk_token"):
        info.setdefault(name, None)
    info.update(
        tokenizer_class=info.get("tokenizer_class") or "PreTrainedTokenizerFast",
        chat_template=tok.chat_template,
        bos_token=tok.bos_token,
        eos_token=tok.eos_token,
        model_max_length=max_model_len,
        added_tokens_decoder={str(i): text for i, text in tok.added_tokens().items()},
    )
    return info


def _added_token_text(value):
    """``value`` with every AddedToken object (``{"content": ..., "special": ...}``) as its text, at any depth."""
    if isinstance(value, dict):
        if isinstance(value.get("content"), str) and set(value) <= _ADDED_TOKEN_FIELDS:
            return value["content"]
        return {k: _added_token_text(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_added_token_text(v) for v in value]
    return value
