"""Step 4 of a generation request, the answer's shapes: OpenAI's response, choice and stream-chunk dicts
(completions and chat), their ``logprobs`` objects and ``usage``, and the two routes' formats
(``CompletionFormat``, ``ChatFormat``: echo, the role chunk, tool calls parsed out of the text) that
``response_writer`` answers in. Knows JSON, not HTTP or the engine.
"""

from __future__ import annotations

import time
import uuid
from typing import Protocol

from rawpaged.engine.outputs import CompletionDelta, CompletionOutput
from rawpaged.entrypoints.openai.tool_parsers import DeltaMessage, extract_tool_calls


def new_id(prefix: str) -> str:
    """A response or request id: ``prefix-`` and 32 hex digits."""
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    """Unix time in whole seconds (a response's ``created``)."""
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    """OpenAI's ``usage``: prompt, completion and total token counts."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def models_response(name: str, created: int, max_model_len: int | None) -> dict:
    """``GET /v1/models``' list with the one model card (its ``max_model_len`` once the model has loaded)."""
    card = {"id": name, "object": "model", "created": created, "owned_by": "rawpaged", "root": name, "parent": None}
    if max_model_len is not None:
        card["max_model_len"] = max_model_len
    return {"object": "list", "data": [card]}


def completion_response(rid: str, created: int, model: str, choices: list, usage_: dict) -> dict:
    """A ``text_completion`` response with its ``choices`` and ``usage``."""
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
    """A completions choice (full or in a chunk): ``{index, text, logprobs, finish_reason}``."""
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
    """A ``text_completion`` stream chunk; ``usage`` only with ``include_usage`` (null until the last)."""
    return _chunk("text_completion", rid, created, model, choices, usage_, include_usage)


def chat_response(rid: str, created: int, model: str, choices: list, usage_: dict) -> dict:
    """A ``chat.completion`` response with its ``choices`` and ``usage``."""
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
    """A ``chat.completion.chunk``; ``usage`` only with ``include_usage`` (null until the last)."""
    return _chunk("chat.completion.chunk", rid, created, model, choices, usage_, include_usage)


def chat_chunk_choice(index: int, delta: dict, finish_reason: str | None, logprobs: dict | None = None) -> dict:
    """A chat chunk's choice: ``{index, delta, logprobs, finish_reason}``."""
    return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}


def token_text(tokenizer, token_id: int) -> str:
    """One token's text, special tokens included (a piece of a character shows as U+FFFD)."""
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


# ------------------------------------------------------------------------------------------ formats
class ResponseFormat(Protocol):
    """The shapes of one route's responses. ``prompt`` arguments are ``preprocessing.PreparedPrompt``s;
    ``req`` arguments ``protocol.GenerationRequest``s."""

    def response(self, rid: str, created: int, model: str, choices: list, usage: dict) -> dict: ...

    def choice(self, req, index: int, prompt, output: CompletionOutput) -> dict:
        """One choice of the full (non-streamed) response."""

    def chunk(
        self, rid: str, created: int, model: str, choices: list, usage: dict | None, include_usage: bool
    ) -> dict: ...

    def opening_choices(self, req, num_choices: int) -> list:
        """Chunk choices sent before any token (chat: the role of every choice)."""

    def chunk_choices(self, req, index: int, prompt, delta: CompletionDelta) -> list:
        """The chunk choices of one delta (its new text and logprobs; then its finish_reason), each sent
        as a chunk of its own."""

    def logprobs(self, req, prompt, token_ids: list, entries: list, text_offset: int) -> dict | None:
        """This route's ``logprobs`` object for ``token_ids`` (None unless asked for)."""


class CompletionFormat:
    """``/v1/completions``' shapes: the prompt echoed with ``echo``, integer ``logprobs``."""

    response = staticmethod(completion_response)
    chunk = staticmethod(completion_chunk)

    @staticmethod
    def logprobs(req, prompt, token_ids, entries, text_offset):
        """Completions' ``logprobs`` object for these tokens (None unless asked for)."""
        if req.num_logprobs is None or not token_ids:
            return None
        return completion_logprobs(prompt.tokenizer, token_ids, entries or [], text_offset)

    def choice(self, req, index, prompt, output):
        prefix = prompt.echo_text if req.echo else ""
        return completion_choice(
            index,
            prefix + output.text,
            output.finish_reason,
            self.logprobs(req, prompt, output.token_ids, output.logprobs, len(prefix)),
        )

    @staticmethod
    def opening_choices(req, num_choices):
        return []

    def chunk_choices(self, req, index, prompt, delta):
        echo = req.echo and delta.first
        lp = self.logprobs(
            req, prompt, delta.token_ids, delta.logprobs, delta.text_offset + (len(prompt.echo_text) if req.echo else 0)
        )
        choices = []
        if delta.text or lp is not None or echo:
            text = prompt.echo_text + delta.text if echo else delta.text
            choices.append(completion_choice(index, text, None, lp))
        if delta.finish_reason is not None:
            choices.append(completion_choice(index, "", delta.finish_reason))
        return choices


class ChatFormat:
    """Chat's shapes for one request. With tools, each choice's text goes through its own tool parser
    (``ChatCompletionRequest.tool_parser``): content and ``tool_calls`` in the message or the deltas,
    and ``finish_reason`` "tool_calls" after a call."""

    response = staticmethod(chat_response)
    chunk = staticmethod(chat_chunk)

    def __init__(self):
        self._parsers: dict = {}  # choice index -> its tool parser (streaming)

    @staticmethod
    def logprobs(req, prompt, token_ids, entries, text_offset=0):
        """Chat's ``logprobs`` object for these tokens (None unless asked for)."""
        if req.num_logprobs is None or not token_ids:
            return None
        return chat_logprobs(prompt.tokenizer, token_ids, entries or [], req.num_logprobs)

    def choice(self, req, index, prompt, output):
        lp = self.logprobs(req, prompt, output.token_ids, output.logprobs)
        parser = req.tool_parser()
        if parser is None:
            return chat_choice(index, output.text, output.finish_reason, lp)
        content, tool_calls = extract_tool_calls(parser, output.text)
        return chat_choice(index, content, parser.finish_reason(output.finish_reason), lp, tool_calls)

    @staticmethod
    def opening_choices(req, num_choices):
        return [chat_chunk_choice(i, {"role": "assistant", "content": ""}, None) for i in range(num_choices)]

    def chunk_choices(self, req, index, prompt, delta):
        lp = self.logprobs(req, prompt, delta.token_ids, delta.logprobs)
        message, finish_reason = self._parse(req, index, delta)
        choices = []
        if message or lp is not None:
            fields = {"content": message.content} if message.content or not message.tool_calls else {}
            if message.tool_calls:
                fields["tool_calls"] = message.tool_calls
            choices.append(chat_chunk_choice(index, fields, None, lp))
        if finish_reason is not None:
            choices.append(chat_chunk_choice(index, {}, finish_reason))
        return choices

    def _parse(self, req, index: int, delta: CompletionDelta) -> tuple:
        """``(DeltaMessage, finish_reason)`` of one delta, through choice ``index``'s tool parser if any."""
        if index not in self._parsers:
            self._parsers[index] = req.tool_parser()
        parser = self._parsers[index]
        if parser is None:
            return DeltaMessage(delta.text), delta.finish_reason
        message = parser.feed(delta.text)
        if delta.finish_reason is None:
            return message, None
        rest = parser.finish()
        message = DeltaMessage(message.content + rest.content, message.tool_calls + rest.tool_calls)
        return message, parser.finish_reason(delta.finish_reason)
