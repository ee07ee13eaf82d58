"""The wire protocol's request side, shared: the strict base model, ``GenerationRequest`` (the fields and
rules of completions, chat and the websocket's ``generate``) and the prompt list (as vLLM's
``entrypoints/openai/engine/protocol.py``). Each API's own request is its folder's ``protocol``
(``openai/chat_completion``, ``openai/completion``, ``websocket``). A request says what it asks of the
engine (``sampling_params``). Knows JSON, not HTTP or the engine; the responses' shapes are
``output_json``'s.

Parsing checks JSON types (strict: ``true`` is not a number, ``"1"`` is not an integer) and the rules
that are OpenAI's or this server's (limits, streaming restrictions, refused parameters). Ranges and
cross-field rules are ``SamplingParams``'s: its ``InvalidRequestError`` names the field, which becomes the
error body's ``param``. Every refusal is a :class:`~rawpaged.entrypoints.http.errors.ProtocolError`. From
bytes to a checked model: ``request_body.parse_request``.
"""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict

from rawpaged.entrypoints.generation.sampling import to_sampling_params
from rawpaged.entrypoints.generation.tool_parsers import ToolParser
from rawpaged.entrypoints.http.errors import ProtocolError
from rawpaged.entrypoints.server.config import Limits
from rawpaged.errors import InvalidRequestError
from rawpaged.sampling_params import SamplingParams
from rawpaged.tokenizer import RESERVED_TEMPLATE_KWARGS

MAX_STOP_STRINGS = 16


class OpenAIBaseModel(BaseModel):
    # Unknown fields are ignored, as by OpenAI; known ones must have exactly their JSON type.
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(OpenAIBaseModel):
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None  # vLLM's: with include_usage, running usage in every chunk


class GenerationRequest(OpenAIBaseModel):
    """Fields shared by completions, chat and websocket ``generate`` (OpenAI's, plus vLLM's extras
    ``top_k``, ``min_p``, ``repetition_penalty``, ``min_tokens``, ``bad_words``, ``allowed_token_ids``,
    ``prompt_logprobs``, ``stop_token_ids``, ``ignore_eos``, ``include_stop_str_in_output``,
    ``use_beam_search``, ``length_penalty``, ``structured_outputs``). ``logit_bias`` keys are token ids
    as strings, as OpenAI sends them.

    Structured outputs: OpenAI's ``response_format`` (``{"type": "json_object"}``, ``{"type": "json_schema",
    "json_schema": {"name", "schema", "strict"}}``) or vLLM's ``structured_outputs`` (a dict of
    ``StructuredOutputsParams``' fields: ``json``, ``regex``, ``choice``, ``grammar``, ``json_object``,
    ``disable_any_whitespace``), not both."""

    accepts_tools: ClassVar[bool] = False

    model: str | None = None
    user: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    n: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = None
    include_stop_str_in_output: bool | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    use_beam_search: bool | None = None
    length_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, int | float] | None = None
    min_tokens: int | None = None
    bad_words: list[str] | None = None
    allowed_token_ids: list[int] | None = None
    prompt_logprobs: int | None = None
    suffix: str | None = None
    tools: list | None = None
    tool_choice: Any = None
    functions: list | None = None
    response_format: dict | None = None
    structured_outputs: dict | None = None

    # ---------------------------------------------------------------- derived
    @property
    def kind(self) -> str:
        """ "completion" or "chat": the response shapes and the ``max_tokens`` default."""
        return "completion"

    @property
    def prompt_param(self) -> str:
        return "prompt"

    @property
    def max_tokens_param(self) -> str:
        return "max_tokens"

    @property
    def requested_max_tokens(self) -> int | None:
        """``max_tokens`` as sent, or None: the server then picks a default that fits the context."""
        return self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        """Top logprobs per generated token, or None for none."""
        return None

    @property
    def num_prompt_logprobs(self) -> int | None:
        """Top logprobs per prompt token (vLLM's ``prompt_logprobs``), or None for none."""
        return self.prompt_logprobs

    @property
    def echo_only(self) -> bool:
        """Whether the answer is the prompt alone (completions' ``echo`` with ``max_tokens`` 0)."""
        return False

    @property
    def num_choices(self) -> int:
        return 1 if self.n is None else self.n

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    @property
    def include_continuous_usage(self) -> bool:
        """Whether every chunk carries the running ``usage`` (vLLM: ``continuous_usage_stats`` counts only
        with ``include_usage``)."""
        return self.include_usage and bool(self.stream_options.continuous_usage_stats)

    def template_tools(self) -> list | None:
        """The tools for the chat template (OpenAI's dicts), or None."""
        return None

    def tool_parser(self) -> ToolParser | None:
        """A fresh parser of one choice's tool calls, or None when the request has none to parse."""
        return None

    def sampling_params(self, max_tokens: int, defaults: dict | None = None) -> SamplingParams:
        """The engine's ``SamplingParams`` for this request (``sampling.to_sampling_params``; ``defaults``:
        the model's generation config). Raises ProtocolError naming the field as the client sent it."""
        return to_sampling_params(self, max_tokens, defaults)

    def token_logit_bias(self) -> dict | None:
        """``logit_bias`` with integer token ids. Raises ProtocolError naming a key that is not one."""
        if self.logit_bias is None:
            return None
        out = {}
        for key, bias in self.logit_bias.items():
            if not key.strip().lstrip("-").isdigit():
                raise ProtocolError(f"logit_bias key {key!r} is not a token id (an integer as a string)", "logit_bias")
            out[int(key)] = float(bias)
        return out

    def client_error(self, e: InvalidRequestError) -> ProtocolError:
        """An engine refusal as the client sees it: its field (and the message's leading field name) as
        the request named it (``max_completion_tokens``, ``response_format``, ...)."""
        param, message = self.client_param(e.param), str(e)
        if param != e.param and message.startswith(e.param):
            message = param + message[len(e.param) :]
        return ProtocolError(message, param=param)

    def structured_outputs_fields(self) -> dict | None:
        """The ``StructuredOutputsParams`` fields the request asks for, from ``structured_outputs`` or
        ``response_format``; None without a constraint. Raises ProtocolError for a malformed
        ``response_format`` or both fields set."""
        fmt = self.response_format
        kind = None if fmt is None else fmt.get("type")
        if kind not in (None, "text", "json_object", "json_schema"):
            raise ProtocolError(
                'response_format type must be "text", "json_object" or "json_schema"', param="response_format"
            )
        if kind in (None, "text"):
            return self.structured_outputs
        if self.structured_outputs is not None:
            raise ProtocolError("set response_format or structured_outputs, not both", param="response_format")
        if kind == "json_object":
            return {"json_object": True}
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
            raise ProtocolError(
                'response_format json_schema must be {"name": ..., "schema": {...}}', param="response_format"
            )
        return {"json": spec["schema"]}

    def client_param(self, param: str | None) -> str | None:
        """The request field an engine error's ``param`` names, as the client sent it."""
        if param == "max_tokens":
            return self.max_tokens_param
        if param and param.startswith("structured_outputs") and self.structured_outputs is None:
            return "response_format"
        return param

    # ---------------------------------------------------------------- rules
    def check(self, limits: Limits) -> None:
        """OpenAI's and this server's rules, then the engine's own checks on the whole parameter set."""
        max_tokens = self.requested_max_tokens
        if max_tokens is not None and limits.max_tokens is not None and max_tokens > limits.max_tokens:
            raise ProtocolError(
                f"{self.max_tokens_param} is {max_tokens}; this server allows at most {limits.max_tokens}",
                param=self.max_tokens_param,
            )
        for name in ("n", "best_of"):
            value = getattr(self, name, None)
            if value is not None and value > limits.max_n:
                raise ProtocolError(f"{name} is {value}; this server allows at most {limits.max_n}", param=name)
        if self.seed is not None and not -(1 << 63) <= self.seed < 1 << 64:
            raise ProtocolError(f"seed must be a 64-bit integer, got {self.seed}", param="seed")
        if isinstance(self.stop, list) and len(self.stop) > MAX_STOP_STRINGS:
            raise ProtocolError(f"stop has {len(self.stop)} strings; at most {MAX_STOP_STRINGS}", param="stop")
        if self.stream_options is not None and not self.stream:
            raise ProtocolError("stream_options is only allowed when stream is true", param="stream_options")
        if self.stream and (getattr(self, "best_of", None) or self.num_choices) > self.num_choices:
            raise ProtocolError("best_of > n cannot be streamed", param="best_of")
        if self.use_beam_search and self.stream:
            raise ProtocolError("beam search cannot be streamed (beams are chosen at the end)", param="use_beam_search")
        if self.prompt_logprobs is not None and self.stream:
            raise ProtocolError("prompt_logprobs cannot be streamed (as in vLLM)", param="prompt_logprobs")
        if self.length_penalty is not None and not self.use_beam_search:
            raise ProtocolError(
                "length_penalty applies to beam search only (use_beam_search: true)", param="length_penalty"
            )
        self.token_logit_bias()
        if self.suffix:
            raise ProtocolError("suffix is not supported by this server", param="suffix")
        if self.functions:
            raise ProtocolError("functions is deprecated and not supported; use tools", param="functions")
        if not self.accepts_tools:
            for name in ("tools", "tool_choice"):
                if getattr(self, name) is not None:
                    raise ProtocolError(f"{name} is supported by /v1/chat/completions only", param=name)
        reserved = sorted(set(getattr(self, "chat_template_kwargs", None) or ()) & RESERVED_TEMPLATE_KWARGS)
        if reserved:
            raise ProtocolError(f"chat_template_kwargs may not set {reserved}", param="chat_template_kwargs")
        # unset max_tokens: the default is picked per prompt later (16, or what fits); here any value that
        # lets the other fields be checked (min_tokens is checked against the real one then)
        self.sampling_params(max(1, self.min_tokens or 0) if max_tokens is None else max_tokens)


PromptType = str | list[str] | list[int] | list[list[int]]


def prompt_list(prompt, limits: Limits | None = None) -> list:
    """``str | [str] | [int] | [[int]]`` -> a list of prompts (strings or token-id lists)."""
    if isinstance(prompt, str):
        prompts = [prompt]
    elif prompt and isinstance(prompt[0], int):
        prompts = [prompt]
    else:
        prompts = list(prompt)
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ProtocolError("prompt is empty", param="prompt")
    if limits is not None and len(prompts) > limits.max_prompts:
        raise ProtocolError(f"{len(prompts)} prompts in one request; at most {limits.max_prompts}", param="prompt")
    return prompts
