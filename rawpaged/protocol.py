"""The wire protocol: request parsing and validation (-> ``SamplingParams``), OpenAI-shaped responses,
stream chunks and error bodies. Knows JSON shapes, not HTTP or the engine.

Every validation failure raises :class:`ProtocolError`, which carries the HTTP status and the OpenAI error
body ``{"error": {"message", "type", "param", "code"}}`` naming the offending field.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field

from rawpaged.sampling_params import MAX_LOGPROBS, SamplingParams

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
MAX_STOP_STRINGS = 16
MAX_PROMPTS = 64
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


class ProtocolError(Exception):
    """A request the server refuses; ``status`` and ``body()`` are what the client gets."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 type: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.status = status
        self.type = type
        self.code = code

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


@dataclass
class Limits:
    """Server-side limits applied while parsing."""

    max_tokens: int = 4096  # a request asking for more generated tokens gets a 400
    max_n: int = 16  # n and best_of at most
    max_prompts: int = MAX_PROMPTS  # prompts per /v1/completions request at most


@dataclass
class GenerateRequest:
    """A parsed generation request (completions, chat or websocket ``generate``).

    ``prompts`` holds strings or token-id lists (completions); ``messages`` the conversation (chat).
    ``sampling`` are ``SamplingParams`` keyword arguments except ``max_tokens``; ``max_tokens`` is None
    when the client left it out (the server then picks a default that fits the context).
    """

    kind: str  # "completion" or "chat"
    model: str | None = None
    prompts: list = field(default_factory=list)
    messages: list | None = None
    sampling: dict = field(default_factory=dict)
    max_tokens: int | None = None
    max_tokens_param: str = "max_tokens"
    stream: bool = False
    include_usage: bool = False
    echo: bool = False
    logprobs: int | None = None  # top logprobs per token, None for none
    user: str | None = None

    @property
    def prompt_param(self) -> str:
        return "messages" if self.messages is not None else "prompt"

    def sampling_params(self, max_tokens: int) -> SamplingParams:
        """``SamplingParams`` for this request; a ValueError from them becomes a ProtocolError."""
        try:
            return SamplingParams(max_tokens=max_tokens, **self.sampling)
        except ValueError as e:
            name = str(e).split(" ", 1)[0]
            param = self.max_tokens_param if name == "max_tokens" else name
            raise ProtocolError(str(e), param=param if param in self.sampling or param == self.max_tokens_param
                                else None) from None


# ------------------------------------------------------------------------------------------ parsing
def parse_json(data: bytes) -> dict:
    """The request body as a JSON object."""
    try:
        body = json.loads(data)
    except (ValueError, UnicodeDecodeError) as e:
        raise ProtocolError(f"request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise ProtocolError("request body must be a JSON object")
    return body


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _opt(body: dict, name: str, check, what: str):
    """``body[name]`` if present and not null, after a type check; None otherwise."""
    v = body.get(name)
    if v is None:
        return None
    if not check(v):
        raise ProtocolError(f"{name} must be {what}, got {json.dumps(v)[:100]}", param=name)
    return v


def _range(name: str, v, lo=None, hi=None, what: str = ""):
    if v is None:
        return
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        raise ProtocolError(f"{name} must be {what}, got {v!r}", param=name)


def _parse_common(body: dict, limits: Limits, kind: str) -> GenerateRequest:
    req = GenerateRequest(kind=kind)
    req.model = _opt(body, "model", lambda v: isinstance(v, str), "a string")
    req.user = _opt(body, "user", lambda v: isinstance(v, str), "a string")

    # max_tokens (chat: max_completion_tokens wins, as in OpenAI's API)
    for name in (("max_completion_tokens", "max_tokens") if kind == "chat" else ("max_tokens",)):
        v = _opt(body, name, _is_int, "an integer")
        if v is not None:
            _range(name, v, 1, None, "an integer >= 1")
            if v > limits.max_tokens:
                raise ProtocolError(f"{name} is {v}; this server allows at most {limits.max_tokens}", param=name)
            req.max_tokens, req.max_tokens_param = v, name
            break

    s = req.sampling
    v = _opt(body, "temperature", _is_num, "a number")
    _range("temperature", v, 0.0, 100.0, "a number in [0, 100]")
    s["temperature"] = 1.0 if v is None else float(v)
    v = _opt(body, "top_p", _is_num, "a number")
    if v is not None and not 0.0 < v <= 1.0:
        raise ProtocolError(f"top_p must be in (0, 1], got {v!r}", param="top_p")
    if v is not None:
        s["top_p"] = float(v)
    v = _opt(body, "top_k", _is_int, "an integer")
    _range("top_k", v, -1, None, "-1 (disabled), 0 (disabled) or a positive integer")
    if v is not None:
        s["top_k"] = v
    v = _opt(body, "min_p", _is_num, "a number")
    _range("min_p", v, 0.0, 1.0, "a number in [0, 1]")
    if v is not None:
        s["min_p"] = float(v)
    v = _opt(body, "n", _is_int, "an integer")
    _range("n", v, 1, limits.max_n, f"an integer in [1, {limits.max_n}]")
    s["n"] = v or 1
    if kind == "completion":
        v = _opt(body, "best_of", _is_int, "an integer")
        _range("best_of", v, s["n"], limits.max_n, f"an integer in [n, {limits.max_n}]")
        if v is not None:
            s["best_of"] = v
    v = _opt(body, "seed", _is_int, "an integer")
    if v is not None:
        _range("seed", v, -(1 << 63), (1 << 64) - 1, "a 64-bit integer")
        s["seed"] = v % (1 << 64)  # negative seeds (valid in OpenAI's API) map to unsigned
    stop = body.get("stop")
    if stop is not None:
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, list) or not all(isinstance(x, str) for x in stop):
            raise ProtocolError("stop must be a string or a list of strings", param="stop")
        if len(stop) > MAX_STOP_STRINGS:
            raise ProtocolError(f"stop has {len(stop)} strings; at most {MAX_STOP_STRINGS}", param="stop")
        if any(x == "" for x in stop):
            raise ProtocolError("stop must not contain empty strings", param="stop")
        if stop:
            s["stop"] = stop
    v = _opt(body, "stop_token_ids", lambda x: isinstance(x, list) and all(_is_int(t) and t >= 0 for t in x),
             "a list of non-negative integers")
    if v:
        s["stop_token_ids"] = list(v)
    v = _opt(body, "ignore_eos", lambda x: isinstance(x, bool), "a boolean")
    if v is not None:
        s["ignore_eos"] = v

    # logprobs: completions take an integer, chat a boolean plus top_logprobs
    if kind == "completion":
        v = _opt(body, "logprobs", _is_int, "an integer")
        _range("logprobs", v, 0, MAX_LOGPROBS, f"an integer in [0, {MAX_LOGPROBS}]")
        req.logprobs = v
    else:
        want = _opt(body, "logprobs", lambda x: isinstance(x, bool), "a boolean")
        top = _opt(body, "top_logprobs", _is_int, "an integer")
        _range("top_logprobs", top, 0, MAX_LOGPROBS, f"an integer in [0, {MAX_LOGPROBS}]")
        if top is not None and not want:
            raise ProtocolError("top_logprobs requires logprobs to be true", param="top_logprobs")
        req.logprobs = (top or 0) if want else None
    if req.logprobs is not None:
        s["logprobs"] = req.logprobs

    stream = _opt(body, "stream", lambda x: isinstance(x, bool), "a boolean")
    req.stream = bool(stream)
    opts = _opt(body, "stream_options", lambda x: isinstance(x, dict), "an object")
    if opts is not None:
        if not req.stream:
            raise ProtocolError("stream_options is only allowed when stream is true", param="stream_options")
        inc = opts.get("include_usage")
        if inc is not None and not isinstance(inc, bool):
            raise ProtocolError("stream_options.include_usage must be a boolean", param="stream_options")
        req.include_usage = bool(inc)
    if req.stream and s.get("best_of", s["n"]) > s["n"]:
        raise ProtocolError("best_of > n cannot be streamed", param="best_of")

    # Beam search, as vLLM's extra parameters: the beam width is best_of (or n); greedy by nature.
    beam = _opt(body, "use_beam_search", lambda x: isinstance(x, bool), "a boolean")
    v = _opt(body, "length_penalty", _is_num, "a number")
    if beam:
        if req.stream:
            raise ProtocolError("beam search cannot be streamed (beams are chosen at the end)",
                                param="use_beam_search")
        s["beam_width"] = max(s.pop("best_of", s["n"]), s["n"], 2)
        s["temperature"] = 0.0
        if v is not None:
            s["length_penalty"] = float(v)
    elif v is not None:
        raise ProtocolError("length_penalty applies to beam search only (use_beam_search: true)",
                            param="length_penalty")

    # Parameters this server does not implement: accepted only at their neutral values.
    for name, neutral in (("presence_penalty", 0), ("frequency_penalty", 0), ("repetition_penalty", 1)):
        v = _opt(body, name, _is_num, "a number")
        if v is not None and v != neutral:
            raise ProtocolError(f"{name} is not supported by this server (only {neutral})", param=name)
    if body.get("logit_bias"):
        raise ProtocolError("logit_bias is not supported by this server", param="logit_bias")
    if body.get("suffix"):
        raise ProtocolError("suffix is not supported by this server", param="suffix")
    if body.get("tools") or body.get("functions"):
        raise ProtocolError("tools are not supported by this server", param="tools")
    fmt = body.get("response_format")
    if fmt is not None and not (isinstance(fmt, dict) and fmt.get("type") == "text"):
        raise ProtocolError("response_format: only {\"type\": \"text\"} is supported", param="response_format")

    # Check the whole set once (cross-field rules live in SamplingParams).
    req.sampling_params(req.max_tokens or 1)
    return req


def _parse_prompts(prompt, limits: Limits) -> list:
    """str | [str] | [int] | [[int]] -> a list of prompts (strings or token-id lists)."""
    bad = ProtocolError("prompt must be a string, a list of strings, a list of token ids or a list of "
                        "token-id lists", param="prompt")
    if prompt is None:
        raise ProtocolError("prompt is required", param="prompt")
    if isinstance(prompt, str):
        prompts = [prompt]
    elif isinstance(prompt, list):
        if not prompt:
            raise ProtocolError("prompt is empty", param="prompt")
        if all(isinstance(p, str) for p in prompt):
            prompts = list(prompt)
        elif all(_is_int(t) for t in prompt):
            prompts = [list(prompt)]
        elif all(isinstance(p, list) and all(_is_int(t) for t in p) for p in prompt):
            prompts = [list(p) for p in prompt]
        else:
            raise bad
    else:
        raise bad
    if len(prompts) > limits.max_prompts:
        raise ProtocolError(f"{len(prompts)} prompts in one request; at most {limits.max_prompts}", param="prompt")
    for p in prompts:
        if len(p) == 0:
            raise ProtocolError("prompt is empty", param="prompt")
    return prompts


def _parse_messages(messages) -> list:
    if not isinstance(messages, list) or not messages:
        raise ProtocolError("messages must be a non-empty list", param="messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ProtocolError(f"messages[{i}] must be an object", param="messages")
        role, content = m.get("role"), m.get("content")
        if role not in CHAT_ROLES:
            raise ProtocolError(f"messages[{i}].role must be one of {', '.join(CHAT_ROLES)}", param="messages")
        if content is None and role == "assistant":
            content = ""
        if isinstance(content, list):  # content parts: only text is supported
            parts = []
            for p in content:
                if not isinstance(p, dict) or p.get("type") != "text" or not isinstance(p.get("text"), str):
                    raise ProtocolError(f"messages[{i}].content: only text parts are supported", param="messages")
                parts.append(p["text"])
            content = "".join(parts)
        if not isinstance(content, str):
            raise ProtocolError(f"messages[{i}].content must be a string or a list of text parts",
                                param="messages")
        out.append({"role": "system" if role == "developer" else role, "content": content})
    return out


def parse_completion_request(body: dict, limits: Limits) -> GenerateRequest:
    """A ``POST /v1/completions`` body."""
    req = _parse_common(body, limits, "completion")
    req.prompts = _parse_prompts(body.get("prompt"), limits)
    req.echo = bool(_opt(body, "echo", lambda x: isinstance(x, bool), "a boolean"))
    return req


def parse_chat_request(body: dict, limits: Limits) -> GenerateRequest:
    """A ``POST /v1/chat/completions`` body."""
    req = _parse_common(body, limits, "chat")
    req.messages = _parse_messages(body.get("messages"))
    return req


def parse_ws_generate(msg: dict, limits: Limits) -> GenerateRequest:
    """A websocket ``{"type": "generate", ...}`` message: ``prompt`` (a string or token ids) or ``messages``,
    plus the completions sampling parameters (``logprobs`` an integer)."""
    has_prompt, has_messages = msg.get("prompt") is not None, msg.get("messages") is not None
    if has_prompt == has_messages:
        raise ProtocolError("exactly one of prompt and messages is required", param="prompt")
    body = {k: v for k, v in msg.items() if k not in ("type", "id", "stream", "stream_options")}
    req = _parse_common(body, limits, "completion")
    if has_messages:
        req.kind = "chat"
        req.messages = _parse_messages(msg["messages"])
    else:
        prompts = _parse_prompts(msg["prompt"], limits)
        if len(prompts) != 1:
            raise ProtocolError("a websocket request takes one prompt", param="prompt")
        req.prompts = prompts
    return req


# -------------------------------------------------------------------------------------- responses
def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def models_response(name: str, created: int, max_model_len: int | None) -> dict:
    card = {"id": name, "object": "model", "created": created, "owned_by": "rawpaged", "root": name,
            "parent": None}
    if max_model_len is not None:
        card["max_model_len"] = max_model_len
    return {"object": "list", "data": [card]}


def completion_response(rid: str, created: int, model: str, choices: list, usage_: dict) -> dict:
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": choices, "usage": usage_, "system_fingerprint": None}


def completion_choice(index: int, text: str, finish_reason: str | None, logprobs: dict | None = None) -> dict:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}


def _chunk(obj: str, rid: str, created: int, model: str, choices: list, usage_: dict | None,
           include_usage: bool) -> dict:
    chunk = {"id": rid, "object": obj, "created": created, "model": model, "choices": choices,
             "system_fingerprint": None}
    if include_usage:
        chunk["usage"] = usage_
    return chunk


def completion_chunk(rid: str, created: int, model: str, choices: list, usage_: dict | None = None,
                     include_usage: bool = False) -> dict:
    return _chunk("text_completion", rid, created, model, choices, usage_, include_usage)


def chat_response(rid: str, created: int, model: str, choices: list, usage_: dict) -> dict:
    return {"id": rid, "object": "chat.completion", "created": created, "model": model,
            "choices": choices, "usage": usage_, "system_fingerprint": None}


def chat_choice(index: int, text: str, finish_reason: str | None, logprobs: dict | None = None) -> dict:
    return {"index": index, "message": {"role": "assistant", "content": text}, "logprobs": logprobs,
            "finish_reason": finish_reason}


def chat_chunk(rid: str, created: int, model: str, choices: list, usage_: dict | None = None,
               include_usage: bool = False) -> dict:
    return _chunk("chat.completion.chunk", rid, created, model, choices, usage_, include_usage)


def chat_chunk_choice(index: int, delta: dict, finish_reason: str | None, logprobs: dict | None = None) -> dict:
    return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}


def token_text(tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id], skip_special_tokens=False)


def completion_logprobs(tokenizer, token_ids: list, entries: list, text_offset: int = 0) -> dict:
    """OpenAI's completions ``logprobs`` object for generated tokens; ``entries[i]`` is the engine's
    ``{token_id: logprob}`` for token i (the chosen token first, then the top ones)."""
    tokens, lps, tops, offsets = [], [], [], []
    for tid, entry in zip(token_ids, entries):
        s = token_text(tokenizer, tid)
        tokens.append(s)
        lps.append(entry.get(tid))
        tops.append({token_text(tokenizer, t): lp for t, lp in entry.items()})
        offsets.append(text_offset)
        text_offset += len(s)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}


def chat_logprobs(tokenizer, token_ids: list, entries: list, top_n: int) -> dict:
    """OpenAI's chat ``logprobs`` object: ``{"content": [{token, logprob, bytes, top_logprobs}]}``."""
    content = []
    for tid, entry in zip(token_ids, entries):
        s = token_text(tokenizer, tid)
        top = sorted(entry.items(), key=lambda kv: -kv[1])[:top_n]
        content.append({
            "token": s, "logprob": entry.get(tid), "bytes": list(s.encode("utf-8")),
            "top_logprobs": [{"token": (ts := token_text(tokenizer, t)), "logprob": lp,
                              "bytes": list(ts.encode("utf-8"))} for t, lp in top],
        })
    return {"content": content}
