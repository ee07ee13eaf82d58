"""The wire protocol's request side: request bodies as pydantic models (as vLLM's
``entrypoints/openai/protocol.py``), each with the rules it must meet and what it asks of the engine
(``sampling_params``). Knows JSON, not HTTP or the engine; the responses' shapes are ``output_json``'s.

Parsing checks JSON types (strict: ``true`` is not a number, ``"1"`` is not an integer) and the rules
that are OpenAI's or this server's (limits, streaming restrictions, refused parameters). Ranges and
cross-field rules are ``SamplingParams``'s: its ``InvalidRequestError`` names the field, which becomes the
error body's ``param``. Every refusal is a :class:`~rawpaged.entrypoints.http.errors.ProtocolError`. From
bytes to a checked model: ``request_body.parse_request``.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from rawpaged.entrypoints.generation.chat_utils import template_message
from rawpaged.entrypoints.generation.protocol_extensions import ChatTemplateOptions, TokenIdOutputs
from rawpaged.entrypoints.generation.sampling import to_sampling_params
from rawpaged.entrypoints.generation.tool_parsers import (
    ForcedToolParser,
    HermesToolParser,
    ToolParser,
    forced_tool_schema,
)
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


class TextContentPart(OpenAIBaseModel):
    type: Literal["text"]
    text: str


class FunctionCall(OpenAIBaseModel):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(OpenAIBaseModel):
    """A call in an assistant message sent back in the conversation."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(OpenAIBaseModel):
    """One conversation message. An assistant message may carry ``tool_calls`` instead of content; a
    ``tool`` message answers the call ``tool_call_id``."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

    @model_validator(mode="after")
    def _content_required(self):
        if self.content is None and self.role != "assistant":
            raise ValueError("content is required (a string or a list of text parts)")
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("tool_calls are only allowed in assistant messages")
        if self.role == "tool" and self.tool_call_id is None:
            raise ValueError("a tool message needs the tool_call_id it answers")
        return self


class FunctionDefinition(OpenAIBaseModel):
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")  # OpenAI's rule for function names
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON Schema; None: the function takes any object
    strict: bool | None = None


class ChatTool(OpenAIBaseModel):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(OpenAIBaseModel):
    name: str


class NamedToolChoice(OpenAIBaseModel):
    type: Literal["function"]
    function: NamedFunction


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


def _prompt_list(prompt, limits: Limits | None = None) -> list:
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


class CompletionRequest(GenerationRequest, TokenIdOutputs):
    """A ``POST /v1/completions`` body (with vLLM's ``TokenIdOutputs``)."""

    prompt: PromptType
    echo: bool | None = None
    best_of: int | None = None
    logprobs: int | None = None

    @property
    def num_logprobs(self) -> int | None:
        return self.logprobs

    @property
    def num_prompt_logprobs(self) -> int | None:
        """``prompt_logprobs``, else with ``echo`` the ``logprobs`` count (the echoed tokens get theirs, as
        in OpenAI's legacy API and vLLM)."""
        if self.prompt_logprobs is None and self.echo:
            return self.logprobs
        return self.prompt_logprobs

    @property
    def echo_only(self) -> bool:
        return bool(self.echo) and self.max_tokens == 0

    @property
    def requested_max_tokens(self) -> int | None:
        """``max_tokens``; 0 with ``echo`` returns the prompt alone, from a one-token generation (vLLM's way),
        so 1 here."""
        return 1 if self.echo_only else self.max_tokens

    def prompts(self, limits: Limits) -> list:
        return _prompt_list(self.prompt, limits)

    def check(self, limits: Limits) -> None:
        super().check(limits)
        self.prompts(limits)


class ChatCompletionRequest(GenerationRequest, ChatTemplateOptions, TokenIdOutputs):
    """A ``POST /v1/chat/completions`` body (with vLLM's ``ChatTemplateOptions``, ``TokenIdOutputs`` and
    ``echo``: the last message's content, when its role is the response role, starts each choice's
    content, as vLLM's).

    Tools: ``tools`` are rendered through the chat template (``rawpaged.entrypoints.generation.chat_utils``), and
    ``tool_choice`` says what is done with them: ``"none"`` (no call is parsed), ``"auto"`` (the default
    with tools: Hermes-style ``<tool_call>`` blocks in the output are parsed), ``"required"`` or
    ``{"type": "function", "function": {"name"}}`` (generation is constrained to a valid call;
    ``rawpaged.entrypoints.generation.tool_parsers.forced_tool_parser``)."""

    accepts_tools: ClassVar[bool] = True

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    echo: bool | None = None

    @property
    def kind(self) -> str:
        return "chat"

    @property
    def prompt_param(self) -> str:
        return "messages"

    @property
    def max_tokens_param(self) -> str:  # max_completion_tokens wins, as in OpenAI's API
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def response_role(self) -> str:
        """The role of the answer (vLLM's): "assistant" when a generation prompt opens its turn, else
        that of the last message, which the answer continues."""
        return "assistant" if self.add_generation_prompt else self.messages[-1].role

    @property
    def echo_text(self) -> str:
        """What ``echo`` puts before each choice's content: the last message's content when its role is
        the response role (text parts joined as the template sees them), else ""."""
        if not self.echo or self.messages[-1].role != self.response_role:
            return ""
        return template_message(self.messages[-1])["content"]

    @property
    def tool_mode(self) -> str:
        """ "none", "auto", "required" or "named": what ``tool_choice`` asks (OpenAI's default: "auto"
        with tools, "none" without)."""
        if not self.tools:
            return "none"
        if isinstance(self.tool_choice, NamedToolChoice):
            return "named"
        return self.tool_choice or "auto"

    @property
    def forced_tool(self) -> bool:
        """Whether generation is constrained to a tool call."""
        return self.tool_mode in ("required", "named")

    def template_tools(self) -> list | None:
        return [t.model_dump(exclude_none=True) for t in self.tools] if self.tools else None

    def tool_parser(self) -> ToolParser | None:
        mode = self.tool_mode
        if mode == "auto":
            return HermesToolParser(max_calls=1 if self.parallel_tool_calls is False else None)
        if mode in ("required", "named"):
            return ForcedToolParser(self.tool_choice.function.name if mode == "named" else None)
        return None

    def structured_outputs_fields(self) -> dict | None:
        fields = super().structured_outputs_fields()
        if not self.forced_tool:
            return fields
        name = self.tool_choice.function.name if self.tool_mode == "named" else None
        return {"json": forced_tool_schema(self.template_tools(), name, self.parallel_tool_calls is not False)}

    def client_param(self, param: str | None) -> str | None:
        if param == "logprobs":
            return "top_logprobs"
        if param and param.startswith("structured_outputs") and self.forced_tool:
            return "tools"
        return super().client_param(param)

    def client_error(self, e: InvalidRequestError) -> ProtocolError:
        if not (self.forced_tool and e.param and e.param.startswith("structured_outputs")):
            return super().client_error(e)
        message = str(e)
        rest = message[len(e.param) :] if message.startswith(e.param) else ": " + message
        if self.tool_mode == "named":
            what = f"the parameters schema of {self.tool_choice.function.name!r}"
        else:
            what = "one of the parameters schemas"
        return ProtocolError(f"tools: {what}{rest}", param="tools")

    def check(self, limits: Limits) -> None:
        if self.top_logprobs is not None and not self.logprobs:
            raise ProtocolError("top_logprobs requires logprobs to be true", param="top_logprobs")
        self.check_template_options()
        self._check_tools()
        super().check(limits)

    def _check_tools(self) -> None:
        if self.tool_choice not in (None, "none") and not self.tools:
            raise ProtocolError("tool_choice is only allowed when tools are given", param="tool_choice")
        names = [t.function.name for t in self.tools or ()]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ProtocolError(f"function names in tools must be unique; {duplicates} repeat", param="tools")
        if self.tool_mode == "named" and self.tool_choice.function.name not in names:
            raise ProtocolError(
                f"tool_choice names the function {self.tool_choice.function.name!r}, which is not in tools",
                param="tool_choice",
            )
        if self.forced_tool:
            choice = '"required"' if self.tool_mode == "required" else "naming a function"
            if self.response_format is not None or self.structured_outputs is not None:
                raise ProtocolError(
                    f"tool_choice {choice} constrains the output to a call, so response_format and "
                    "structured_outputs cannot be set with it",
                    param="tool_choice",
                )
            if self.use_beam_search:
                raise ProtocolError(f"tool_choice {choice} cannot be combined with beam search", param="tool_choice")

    def template_messages(self) -> list:
        return [template_message(m) for m in self.messages]


class WebSocketGenerateRequest(GenerationRequest):
    """A websocket ``{"type": "generate", "id": ...}`` message: ``prompt`` (a string or token ids) or
    ``messages`` (rendered with the chat template), plus the completions parameters (``logprobs`` an
    integer). A socket always streams: the caller drops ``stream`` and ``stream_options``."""

    prompt: str | list[int] | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    chat_template_kwargs: dict[str, Any] | None = None
    best_of: int | None = None
    logprobs: int | None = None

    @property
    def kind(self) -> str:
        return "chat" if self.messages is not None else "completion"

    @property
    def prompt_param(self) -> str:
        return "messages" if self.messages is not None else "prompt"

    @property
    def num_logprobs(self) -> int | None:
        return self.logprobs

    def check(self, limits: Limits) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise ProtocolError("exactly one of prompt and messages is required", param="prompt")
        super().check(limits)

    def prompts(self, limits: Limits) -> list:
        return _prompt_list(self.prompt)

    def template_messages(self) -> list:
        return [template_message(m) for m in self.messages]
