"""Step 4 of a generation request, the answer's shapes: OpenAI's response, choice and stream-chunk dicts
(completions and chat), their ``logprobs`` objects and ``usage``, and the two routes' formats
(``CompletionFormat``, ``ChatFormat``: echo, the role chunk, tool calls parsed out of the text) that
``reply_writer`` answers in. Knows JSON, not HTTP or the engine.
"""

from __future__ import annotations

import functools
import time
import uuid
from typing import Protocol

from rawpaged.engine.outputs import CompletionDelta, CompletionOutput
from rawpaged.entrypoints.generation.choice_parser import ChoiceParser, parse_choice


def new_id(prefix: str) -> str:
    """A response or request id: ``prefix-`` and 32 hex digits."""
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    """Unix time in whole seconds (a response's ``created``)."""
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None) -> dict:
    """OpenAI's ``usage``: prompt, completion and total token counts; with ``cached_tokens`` (the prompt
    tokens served from the prefix cache), also ``prompt_tokens_details`` (``--enable-prompt-tokens-details``,
    as vLLM)."""
    out = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
    if cached_tokens is not None:
        out["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return out


def model_card(
    name: str, created: int, max_model_len: int | None, root: str | None = None, parent: str | None = None
) -> dict:
    """One model card (OpenAI's ``Model`` plus vLLM's ``root``, ``parent`` and, once the model has loaded,
    ``max_model_len``): a LoRA adapter's ``root`` is its path and its ``parent`` the base model's name, as
    vLLM's; the base model's ``root`` is its name (default) and its ``parent`` null."""
    card = {
        "id": name,
        "object": "model",
        "created": created,
        "owned_by": "rawpaged",
        "root": root or name,
        "parent": parent,
    }
    if max_model_len is not None:
        card["max_model_len"] = max_model_len
    return card


def models_response(name: str, created: int, max_model_len: int | None, adapters: list = ()) -> dict:
    """``GET /v1/models``' list: the model's card, then one per LoRA adapter of ``adapters``, each
    ``(name, path, parent)``."""
    cards = [model_card(name, created, max_model_len)]
    cards += [model_card(n, created, max_model_len, root, parent) for n, root, parent in adapters]
    return {"object": "list", "data": cards}


def _fingerprinted(response: dict, system_fingerprint: str | None) -> dict:
    if system_fingerprint is not None:  # a string in OpenAI's schema: omitted rather than null
        response["system_fingerprint"] = system_fingerprint
    return response


def _response(obj: str, rid: str, created: int, model: str, choices: list, usage_: dict, system_fingerprint) -> dict:
    response = {"id": rid, "object": obj, "created": created, "model": model, "choices": choices, "usage": usage_}
    return _fingerprinted(response, system_fingerprint)


def completion_response(
    rid: str, created: int, model: str, choices: list, usage_: dict, system_fingerprint: str | None = None
) -> dict:
    """A ``text_completion`` response with its ``choices``, ``usage`` and ``system_fingerprint``."""
    return _response("text_completion", rid, created, model, choices, usage_, system_fingerprint)


def completion_choice(index: int, text: str, finish_reason: str | None, logprobs: dict | None = None) -> dict:
    """A completions choice (full or in a chunk): ``{index, text, logprobs, finish_reason}``."""
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}


def _chunk(
    obj: str,
    rid: str,
    created: int,
    model: str,
    choices: list,
    usage_: dict | None = None,
    include_usage: bool = False,
    system_fingerprint: str | None = None,
) -> dict:
    """A stream chunk of object ``obj``, its ``choices``; ``usage_`` only with ``include_usage``."""
    chunk = _fingerprinted(
        {"id": rid, "object": obj, "created": created, "model": model, "choices": choices}, system_fingerprint
    )
    if include_usage:
        chunk["usage"] = usage_
    return chunk


#: A ``text_completion`` stream chunk, ``_chunk``'s arguments after the first: ``usage`` only with
#: ``include_usage`` (null until the last).
completion_chunk = functools.partial(_chunk, "text_completion")


def chat_response(
    rid: str, created: int, model: str, choices: list, usage_: dict, system_fingerprint: str | None = None
) -> dict:
    """A ``chat.completion`` response with its ``choices``, ``usage`` and ``system_fingerprint``."""
    return _response("chat.completion", rid, created, model, choices, usage_, system_fingerprint)


def chat_choice(
    index: int,
    text: str | None,
    finish_reason: str | None,
    logprobs: dict | None = None,
    tool_calls: list = (),
    reasoning: str | None = None,
    role: str = "assistant",
) -> dict:
    """A chat choice; ``tool_calls`` (OpenAI's ``[{"id", "type", "function"}]``) when any were made;
    ``reasoning`` (vLLM's field) and ``reasoning_content`` (its older name) when a reasoning parser found
    some; ``role``: the message's (vLLM: the last message's when no generation prompt opens a reply)."""
    message = {"role": role, "content": text, "refusal": None}
    if reasoning is not None:
        message["reasoning"] = message["reasoning_content"] = reasoning
    if tool_calls:
        message["tool_calls"] = list(tool_calls)
    return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish_reason}


#: A ``chat.completion.chunk``, ``_chunk``'s arguments after the first: ``usage`` only with ``include_usage``
#: (null until the last).
chat_chunk = functools.partial(_chunk, "chat.completion.chunk")


def chat_chunk_choice(index: int, delta: dict, finish_reason: str | None, logprobs: dict | None = None) -> dict:
    """A chat chunk's choice: ``{index, delta, logprobs, finish_reason}``."""
    return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}


def token_text(tokenizer, token_id: int) -> str:
    """One token's text, special tokens included (a piece of a character shows as U+FFFD)."""
    return tokenizer.decode([token_id], skip_special_tokens=False)


def token_label(tokenizer, token_id: int, as_id: bool = False) -> str:
    """A token as logprobs name it: its text, or with ``as_id`` (vLLM's ``return_tokens_as_token_ids``)
    ``"token_id:<id>"``."""
    return f"token_id:{token_id}" if as_id else token_text(tokenizer, token_id)


def completion_logprobs(tokenizer, token_ids: list, entries: list, text_offset: int = 0, as_ids: bool = False) -> dict:
    """OpenAI's completions ``logprobs`` object for tokens; ``entries[i]`` is the engine's ``{token_id:
    logprob}`` (or ``{token_id: Logprob}``: prompt tokens) for token i (the token itself first, then the top
    ones by rank), or None (the first prompt token: ``token_logprobs`` and ``top_logprobs`` null there, as
    in OpenAI's legacy API and vLLM). ``text_offset``: each token's first character in the text, counted
    from ``text_offset`` by the tokens' texts. Tokens whose texts collide (byte pieces of one character)
    share a ``top_logprobs`` key: the token's own value wins, then the best-ranked. ``as_ids``: tokens and
    keys are ``"token_id:<id>"`` (``token_label``); the offsets still count the texts."""
    tokens, lps, tops, offsets = [], [], [], []
    for tid, entry in zip(token_ids, entries):
        s = token_text(tokenizer, tid)
        tokens.append(token_label(tokenizer, tid, as_ids))
        offsets.append(text_offset)
        text_offset += len(s)
        if entry is None:
            lps.append(None)
            tops.append(None)
            continue
        entry = {t: getattr(lp, "logprob", lp) for t, lp in entry.items()}
        lps.append(entry.get(tid))
        top: dict = {}  # entry: the token first, then by rank: where texts collide, the first stays
        for t, lp in entry.items():
            top.setdefault(token_label(tokenizer, t, as_ids), lp)
        tops.append(top)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}


def prompt_logprobs_json(entries: list | None) -> list | None:
    """vLLM's ``prompt_logprobs`` field: per prompt token None (the first) or ``{token id: {"logprob",
    "rank", "decoded_token"}}`` (JSON object keys: the ids as strings)."""
    if entries is None:
        return None
    return [
        None
        if e is None
        else {
            str(t): {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": lp.decoded_token} for t, lp in e.items()
        }
        for e in entries
    ]


def chat_logprobs(tokenizer, token_ids: list, entries: list, top_n: int, as_ids: bool = False) -> dict:
    """OpenAI's chat ``logprobs`` object: ``{"content": [{token, logprob, bytes, top_logprobs}], "refusal":
    null}``, ``top_n`` top entries per token (-1: all the entry holds).
    ``bytes`` are the token's own bytes (a piece of a character included), so a client can rebuild the
    text from them where ``token`` shows U+FFFD. ``as_ids``: each ``token`` is ``"token_id:<id>"``."""
    content = []
    for tid, entry in zip(token_ids, entries):
        top = sorted(entry.items(), key=lambda kv: -kv[1])
        top = top if top_n < 0 else top[:top_n]
        content.append(
            {
                "token": token_label(tokenizer, tid, as_ids),
                "logprob": entry.get(tid),
                "bytes": list(tokenizer.token_bytes(tid)),
                "top_logprobs": [
                    {
                        "token": token_label(tokenizer, t, as_ids),
                        "logprob": lp,
                        "bytes": list(tokenizer.token_bytes(t)),
                    }
                    for t, lp in top
                ],
            }
        )
    return {"content": content, "refusal": None}


# ------------------------------------------------------------------------------------------ formats
class ResponseFormat(Protocol):
    """The shapes of one route's responses. ``prompt`` arguments are ``preprocessing.PreparedPrompt``s;
    ``req`` arguments ``protocol.GenerationRequest``s."""

    def response(
        self, rid: str, created: int, model: str, choices: list, usage: dict, system_fingerprint: str | None = None
    ) -> dict: ...

    def choice(self, req, index: int, prompt, output: CompletionOutput) -> dict:
        """One choice of the full (non-streamed) response."""

    def chunk(
        self,
        rid: str,
        created: int,
        model: str,
        choices: list,
        usage: dict | None,
        include_usage: bool,
        system_fingerprint: str | None = None,
    ) -> dict: ...

    def opening_chunks(self, req, prompts: list, make_chunk) -> list:
        """Chunks sent before any token (chat: the role of every choice, then with ``echo`` the echoed
        content); ``make_chunk(choice)`` wraps one chunk choice in a chunk."""

    def chunk_choices(self, req, index: int, prompt, delta: CompletionDelta) -> list:
        """The chunk choices of one delta (its new text and logprobs; then its finish_reason), each sent
        as a chunk of its own."""

    def logprobs(self, req, prompt, token_ids: list, entries: list, text_offset: int) -> dict | None:
        """This route's ``logprobs`` object for ``token_ids`` (None unless asked for)."""

    def add_prompt_fields(self, req, response: dict, prompts: list) -> None:
        """vLLM's ``prompt_logprobs`` and ``prompt_token_ids`` field(s) in a full response, when the request
        asked for them."""


def _wants_ids(req) -> bool:
    """vLLM's ``return_token_ids`` (the websocket's requests have no such field)."""
    return bool(getattr(req, "return_token_ids", None))


def _as_ids(req) -> bool:
    """vLLM's ``return_tokens_as_token_ids``."""
    return bool(getattr(req, "return_tokens_as_token_ids", None))


def _with_ids(choice: dict, req, token_ids, prompt_ids=None) -> dict:
    """``choice`` with vLLM's ``prompt_token_ids`` (when given) and ``token_ids``, if the request asks."""
    if _wants_ids(req):
        if prompt_ids is not None:
            choice["prompt_token_ids"] = list(prompt_ids)
        choice["token_ids"] = list(token_ids)
    return choice


class CompletionFormat:
    """``/v1/completions``' shapes: the prompt echoed with ``echo`` (with ``logprobs``, the prompt tokens'
    logprobs first, the first one null; with ``max_tokens`` 0, the prompt alone), integer ``logprobs``,
    and each choice's ``prompt_logprobs``, ``prompt_token_ids`` and ``token_ids`` (vLLM's fields) when
    asked for (a stream: ``prompt_token_ids`` in each choice's first chunk)."""

    response = staticmethod(completion_response)
    chunk = staticmethod(completion_chunk)

    @staticmethod
    def logprobs(req, prompt, token_ids, entries, text_offset):
        """Completions' ``logprobs`` object for these tokens (None unless asked for)."""
        if req.num_logprobs is None or not token_ids:
            return None
        return completion_logprobs(prompt.tokenizer, token_ids, entries or [], text_offset, _as_ids(req))

    @staticmethod
    def _echo_offset(req, prompt) -> int:
        """Where generated text starts in a choice's text offsets: after the echoed prompt, counted as the
        prompt tokens' texts when their logprobs come first (one run of offsets, as vLLM), else as the
        echoed text."""
        if not req.echo:
            return 0
        if req.num_logprobs is not None and prompt.prompt_logprobs is not None:
            return sum(len(token_text(prompt.tokenizer, t)) for t in prompt.ids)
        return len(prompt.echo_text)

    def _with_echo(self, req, prompt, token_ids, entries, text_offset):
        """The logprobs of a choice's first piece: the echoed prompt's tokens, then ``token_ids``."""
        if req.num_logprobs is None or prompt.prompt_logprobs is None:
            return self.logprobs(req, prompt, token_ids, entries, text_offset + self._echo_offset(req, prompt))
        ids, entries = prompt.ids + list(token_ids), list(prompt.prompt_logprobs) + list(entries or [])
        return completion_logprobs(prompt.tokenizer, ids, entries, 0, _as_ids(req))

    def choice(self, req, index, prompt, output):
        token_ids, entries, text = output.token_ids, output.logprobs, output.text
        if req.echo_only:
            token_ids, entries, text = [], [], ""
        if req.echo:
            lp = self._with_echo(req, prompt, token_ids, entries, 0)
            out = completion_choice(index, prompt.echo_text + text, output.finish_reason, lp)
        else:
            out = completion_choice(
                index, text, output.finish_reason, self.logprobs(req, prompt, token_ids, entries, 0)
            )
        if req.prompt_logprobs is not None:
            out["prompt_logprobs"] = prompt_logprobs_json(prompt.prompt_logprobs)
        return _with_ids(out, req, token_ids, prompt.ids)

    @staticmethod
    def add_prompt_fields(req, response, prompts):
        return None  # per choice, in ``choice``

    @staticmethod
    def opening_chunks(req, prompts, make_chunk):
        return []

    def chunk_choices(self, req, index, prompt, delta):
        echo = req.echo and delta.first
        token_ids, entries, text = delta.token_ids, delta.logprobs, delta.text
        if req.echo_only:
            token_ids, entries, text = [], [], ""
        if echo:
            lp = self._with_echo(req, prompt, token_ids, entries, 0)
        else:
            lp = self.logprobs(req, prompt, token_ids, entries, delta.text_offset + self._echo_offset(req, prompt))
        choices = []
        if text or lp is not None or echo or (_wants_ids(req) and (token_ids or delta.first)):
            choice = completion_choice(index, prompt.echo_text + text if echo else text, None, lp)
            choices.append(_with_ids(choice, req, token_ids, prompt.ids if delta.first else None))
        if delta.finish_reason is not None:
            choices.append(_with_ids(completion_choice(index, "", delta.finish_reason), req, []))
        return choices


class ChatFormat:
    """Chat's shapes for one request. With a reasoning parser (``--reasoning-parser``), each choice's
    ``<think>`` text goes to ``reasoning`` (``reasoning_parsers``) and only the rest on. With tools, that
    text goes through the choice's own tool parser (``ChatCompletionRequest.tool_parser``): content and
    ``tool_calls`` in the message or the deltas, and ``finish_reason`` "tool_calls" after a call. The
    message's role is the request's ``response_role``; with ``echo``, ``echo_text`` starts each choice's
    content (a stream: in a chunk of its own after the roles). vLLM's ``token_ids`` are in each choice,
    ``prompt_token_ids`` in the response (a stream: in each role chunk)."""

    response = staticmethod(chat_response)
    chunk = staticmethod(chat_chunk)

    def __init__(self, reasoning_parser: str | None = None):
        self.reasoning_parser = reasoning_parser
        self._parsers: dict = {}  # choice index -> its ChoiceParser (streaming)

    @staticmethod
    def logprobs(req, prompt, token_ids, entries, text_offset=0):
        """Chat's ``logprobs`` object for these tokens (None unless asked for)."""
        if req.num_logprobs is None or not token_ids:
            return None
        return chat_logprobs(prompt.tokenizer, token_ids, entries or [], req.num_logprobs, _as_ids(req))

    @staticmethod
    def add_prompt_fields(req, response, prompts):
        """vLLM's top-level ``prompt_logprobs`` and ``prompt_token_ids`` of a chat response (one
        conversation: one prompt)."""
        if req.prompt_logprobs is not None:
            response["prompt_logprobs"] = prompt_logprobs_json(prompts[0].prompt_logprobs)
        if _wants_ids(req):
            response["prompt_token_ids"] = list(prompts[0].ids)

    def choice(self, req, index, prompt, output):
        lp = self.logprobs(req, prompt, output.token_ids, output.logprobs)
        parser = req.tool_parser()
        reasoning, text, tool_calls = parse_choice(self.reasoning_parser, parser, output.text)
        finish_reason = output.finish_reason if parser is None else parser.finish_reason(output.finish_reason)
        if req.echo_text:
            text = req.echo_text + (text or "")
        out = chat_choice(index, text, finish_reason, lp, tool_calls, reasoning, req.response_role)
        return _with_ids(out, req, output.token_ids)

    @staticmethod
    def opening_chunks(req, prompts, make_chunk):
        chunks = []
        for i in range(req.num_choices):
            chunk = make_chunk(chat_chunk_choice(i, {"role": req.response_role, "content": ""}, None))
            if _wants_ids(req):
                chunk["prompt_token_ids"] = list(prompts[0].ids)
            chunks.append(chunk)
        if req.echo_text:
            chunks += [
                make_chunk(chat_chunk_choice(i, {"content": req.echo_text}, None)) for i in range(req.num_choices)
            ]
        return chunks

    def chunk_choices(self, req, index, prompt, delta):
        lp = self.logprobs(req, prompt, delta.token_ids, delta.logprobs)
        message, finish_reason = self._parse(req, index, delta)
        choices = []
        if message or lp is not None or (_wants_ids(req) and delta.token_ids):
            fields = {}
            if message.reasoning:
                fields["reasoning"] = fields["reasoning_content"] = message.reasoning
            if message.content or not (message.tool_calls or message.reasoning):
                fields["content"] = message.content
            if message.tool_calls:
                fields["tool_calls"] = message.tool_calls
            choices.append(_with_ids(chat_chunk_choice(index, fields, None, lp), req, delta.token_ids))
        if finish_reason is not None:
            choices.append(_with_ids(chat_chunk_choice(index, {}, finish_reason), req, []))
        return choices

    def _parse(self, req, index: int, delta: CompletionDelta) -> tuple:
        """``(DeltaMessage, finish_reason)`` of one delta, through choice ``index``'s ``ChoiceParser``."""
        if index not in self._parsers:
            self._parsers[index] = ChoiceParser(self.reasoning_parser, req.tool_parser())
        parser, last = self._parsers[index], delta.finish_reason is not None
        message = parser.feed(delta.text, last)
        return message, (parser.finish_reason(delta.finish_reason) if last else None)
