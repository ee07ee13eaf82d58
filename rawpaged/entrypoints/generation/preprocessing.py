"""Step 2 of a generation request: a checked request (``protocol``) becomes the engine's inputs. Each prompt
is tokenized (chat: its messages rendered with the chat template first) in a worker thread, checked with
the engine's own checks, and gets its ``max_tokens`` and ``SamplingParams`` (``sampling``).
"""

from __future__ import annotations

import asyncio
import functools
from dataclasses import dataclass

from rawpaged.engine.engine_client import EngineClient
from rawpaged.entrypoints.generation.chat_utils import template_conversation
from rawpaged.entrypoints.generation.sampling import to_sampling_params
from rawpaged.entrypoints.http.errors import ProtocolError
from rawpaged.entrypoints.server.config import Limits
from rawpaged.errors import InvalidRequestError
from rawpaged.sampling_params import SamplingParams

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


@dataclass
class PreparedPrompt:
    """One prompt ready for the engine: its text (None when sent as token ids), token ids and parameters;
    ``prompt_logprobs`` are the engine's (``RequestOutput.prompt_logprobs``) once its outputs bring them."""

    text: str | None
    ids: list
    params: SamplingParams
    tokenizer: object
    prompt_logprobs: list | None = None

    @functools.cached_property
    def echo_text(self) -> str:
        return self.text if self.text is not None else self.tokenizer.decode(self.ids, skip_special_tokens=False)


async def prepare_prompts(engine: EngineClient, req, limits: Limits) -> list:
    """``req``'s prompts (a ``protocol.GenerationRequest``) as ``PreparedPrompt``s, in order.

    Tokenizes in a worker thread (a long prompt or chat template must not stall the event loop), checks each
    prompt with the engine's own checks, picks ``max_tokens`` (``pick_max_tokens``) and builds its
    ``SamplingParams`` with the model's generation config as defaults. Raises ProtocolError naming the
    field."""
    tok = engine.tokenizer
    max_len = engine.max_model_len
    items = await asyncio.to_thread(_tokenize, tok, req, limits, max_len)
    defaults = engine.default_sampling_params
    out = []
    for text, ids in items:
        try:
            engine.check_prompt(ids)
        except InvalidRequestError as e:
            raise ProtocolError(str(e), param=req.prompt_param) from None
        max_tokens = pick_max_tokens(req, limits, len(ids), max_len)
        out.append(PreparedPrompt(text, list(ids), to_sampling_params(req, max_tokens, defaults), tok))
    return out


def pick_max_tokens(req, limits: Limits, num_prompt_tokens: int, max_len: int) -> int:
    """The client's ``max_tokens`` (a ProtocolError, in vLLM's words, when the prompt and it do not fit
    the context); else, capped by the room left in the context, 16 for completions and for chat the
    server's ``--max-tokens-limit`` (none by default: all the room left, as vLLM)."""
    room = max_len - num_prompt_tokens
    requested = req.requested_max_tokens
    if requested is None:
        default = DEFAULT_COMPLETION_MAX_TOKENS if req.kind == "completion" else limits.max_tokens
        return room if default is None else min(default, room)
    if requested > room:
        raise ProtocolError(
            f"'max_tokens' or 'max_completion_tokens' is too large: {requested}. This model's maximum context "
            f"length is {max_len} tokens and your request has {num_prompt_tokens} input tokens ({requested} > "
            f"{max_len} - {num_prompt_tokens}).",
            param=req.max_tokens_param,
        )
    return requested


def encode_conversation(tok, req, max_len: int | None = None, **options) -> tuple:
    """``(text, token ids)`` of ``req``'s conversation (its ``template_messages()``, ``template_tools()``
    and ``chat_template_kwargs``): tools written into the messages where the template does not render
    them (``chat_utils.template_conversation``), then rendered and tokenized by ``Tokenizer.encode_chat``
    (``options``: its keyword options, e.g. ``add_generation_prompt``). With ``max_len``, a conversation
    whose text cannot fit the context is refused before the tokenizer's work. Raises ProtocolError
    naming the request's prompt field (``messages``; the Responses API's ``input``)."""
    try:
        messages, tools = template_conversation(req.template_messages(), req.template_tools(), tok.supports_tools)
        if max_len is not None:
            text = "".join(m["content"] for m in messages if isinstance(m.get("content"), str))
            _check_length(tok, text, req, max_len)
        return tok.encode_chat(messages, template_kwargs=req.chat_template_kwargs, tools=tools, **options)
    except ValueError as e:
        raise ProtocolError(str(e), param=getattr(req, "prompt_param", "messages")) from None


def _tokenize(tok, req, limits: Limits, max_len: int) -> list:
    """``[(text or None, token ids)]``, one per prompt; chat: the one rendered conversation."""
    if req.kind == "chat":
        options = {
            "add_generation_prompt": getattr(req, "add_generation_prompt", True),  # the websocket's has neither
            "continue_final_message": getattr(req, "continue_final_message", False),
        }
        return [encode_conversation(tok, req, max_len, **options)]
    prompts = req.prompts(limits)
    for p in prompts:
        if isinstance(p, str):
            _check_length(tok, p, req, max_len)
    return [(p, tok.encode(p)) if isinstance(p, str) else (None, p) for p in prompts]


def _check_length(tok, text: str, req, max_len: int) -> None:
    """A ProtocolError for a text that cannot fit the context, before the tokenizer's seconds on it."""
    at_least = tok.min_num_tokens(text)
    if at_least >= max_len:
        raise ProtocolError(
            f"this model's maximum context length (max_model_len) is {max_len} tokens; the prompt's "
            f"{len(text)} characters are at least {at_least} tokens",
            param=req.prompt_param,
        )
