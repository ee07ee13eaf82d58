"""The answer's shapes: OpenAI's response, choice and stream-chunk dicts (completions and chat), their
``logprobs`` objects and ``usage``. Knows JSON, not HTTP or the engine.
"""

from __future__ import annotations

import time
import uuid


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def models_response(name: str, created: int, max_model_len: int | None) -> dict:
    card = {"id": name, "object": "model", "created": created, "owned_by": "rawpaged", "root": name, "parent": None}
    if max_model_len is not None:
        card["max_model_len"] = max_model_len
    return {"object": "list", "data": [card]}


def completion_response(rid: str, created: int, model: str, choices: list, usage_: dict) -> dict:
    return {
        "id": rid,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": choices,
        "usage": usage_,
        "system_fingerprint": None,
    }


def completion_choice(index: int, text: str, finish_reason: str | None, logprobs: dict | None = None) -> dict:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}


def _chunk(
    obj: str, rid: str, created: int, model: str, choices: list, usage_: dict | None, include_usage: bool
) -> dict:
    chunk = {
        "id": rid,
        "object": obj,
        "created": created,
        "model": model,
        "choices": choices,
        "system_fingerprint": None,
    }
    if include_usage:
        chunk["usage"] = usage_
    return chunk


def completion_chunk(
    rid: str, created: int, model: str, choices: list, usage_: dict | None = None, include_usage: bool = False
) -> dict:
    return _chunk("text_completion", rid, created, model, choices, usage_, include_usage)


def chat_response(rid: str, created: int, model: str, choices: list, usage_: dict) -> dict:
    return {
        "id": rid,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": choices,
        "usage": usage_,
        "system_fingerprint": None,
    }


def chat_choice(
    index: int, text: str | None, finish_reason: str | None, logprobs: dict | None = None, tool_calls: list = ()
) -> dict:
    """A chat choice; ``tool_calls`` (OpenAI's ``[{"id", "type", "function"}]``) when any were made."""
    message = {"role": "assistant", "content": text}
    if tool_calls:
        message["tool_calls"] = list(tool_calls)
    return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish_reason}


def chat_chunk(
    rid: str, created: int, model: str, choices: list, usage_: dict | None = None, include_usage: bool = False
) -> dict:
    return _chunk("chat.completion.chunk", rid, created, model, choices, usage_, include_usage)


def chat_chunk_choice(index: int, delta: dict, finish_reason: str | None, logprobs: dict | None = None) -> dict:
    return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}


def token_text(tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id], skip_special_tokens=False)


def completion_logprobs(tokenizer, token_ids: list, entries: list, text_offset: int = 0) -> dict:
    """OpenAI's completions ``logprobs`` object for generated tokens; ``entries[i]`` is the engine's
    ``{token_id: logprob}`` for token i (the chosen token first, then the top ones by rank). Tokens whose
    texts collide (byte pieces of one character) share a ``top_logprobs`` key: the chosen token's value
    wins, then the best-ranked."""
    tokens, lps, tops, offsets = [], [], [], []
    for tid, entry in zip(token_ids, entries):
        s = token_text(tokenizer, tid)
        tokens.append(s)
        lps.append(entry.get(tid))
        top: dict = {}  # entry: the chosen token first, then by rank: where texts collide, the first stays
        for t, lp in entry.items():
            top.setdefault(token_text(tokenizer, t), lp)
        tops.append(top)
        offsets.append(text_offset)
        text_offset += len(s)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}


def chat_logprobs(tokenizer, token_ids: list, entries: list, top_n: int) -> dict:
    """OpenAI's chat ``logprobs`` object: ``{"content": [{token, logprob, bytes, top_logprobs}]}``.
    ``bytes`` are the token's own bytes (a piece of a character included), so a client can rebuild the
    text from them where ``token`` shows U+FFFD."""
    content = []
    for tid, entry in zip(token_ids, entries):
        top = sorted(entry.items(), key=lambda kv: -kv[1])[:top_n]
        content.append(
            {
                "token": token_text(tokenizer, tid),
                "logprob": entry.get(tid),
                "bytes": list(tokenizer.token_bytes(tid)),
                "top_logprobs": [
                    {"token": token_text(tokenizer, t), "logprob": lp, "bytes": list(tokenizer.token_bytes(t))}
                    for t, lp in top
                ],
            }
        )
    return {"content": content}
