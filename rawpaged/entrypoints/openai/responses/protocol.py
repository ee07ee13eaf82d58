"""The Responses API's request (``POST /v1/responses``, OpenAI's newer API, which vLLM also serves), a
generation request of its own: its fields map onto the shared ones (``generation.protocol``) that the
pipeline reads, under its own names (``input``, ``max_output_tokens``, ``text``), so every refusal names
the field the client sent.

Taken: ``input`` (a string, or items: messages with string or ``input_text``/``output_text`` parts,
``function_call`` and ``function_call_output``; ``reasoning`` items are skipped), ``instructions`` (a
system message; not carried over from a previous response, as OpenAI), ``max_output_tokens``,
``temperature``, ``top_p``, ``tools`` (function tools, Responses' flat shape), ``tool_choice``,
``parallel_tool_calls``, ``text.format`` (``text``, ``json_object``, ``json_schema``),
``previous_response_id``, ``store``, ``stream``, ``background`` (with ``store``; not with ``stream``),
``top_logprobs`` and ``include`` (``message.output_text.logprobs`` gives the message's logprobs; the other
values name built-in tools' data this server has none of), ``metadata``, ``user``; ``reasoning`` is accepted and
ignored (a reasoning model's thinking comes back as a ``reasoning`` item with ``--reasoning-parser``).
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import Field, PrivateAttr, model_validator

from rawpaged.entrypoints.generation.chat_messages import ChatMessage
from rawpaged.entrypoints.generation.chat_utils import template_message
from rawpaged.entrypoints.generation.protocol import GenerationRequest, OpenAIBaseModel
from rawpaged.entrypoints.generation.request_body import parse_request
from rawpaged.entrypoints.generation.tool_requests import ToolRequest
from rawpaged.entrypoints.http.errors import ProtocolError
from rawpaged.entrypoints.server.config import Limits


class ResponsesFunctionTool(OpenAIBaseModel):
    type: Literal["function"]
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


#: OpenAI's ``include`` values; only the logprobs one names data this server has
INCLUDABLE = (
    "message.output_text.logprobs",
    "reasoning.encrypted_content",
    "web_search_call.action.sources",
    "code_interpreter_call.outputs",
    "computer_call_output.output.image_url",
    "file_search_call.results",
    "message.input_image.image_url",
    "web_search_call.results",
)
OUTPUT_LOGPROBS = "message.output_text.logprobs"


class Conversation(OpenAIBaseModel):
    """The messages a Responses request runs (``ResponsesRequest.start``), checked as chat's are."""

    expected_types: ClassVar[dict] = {"input": "a non-empty list of {role, content} objects"}

    input: list[ChatMessage] = Field(min_length=1)

    def check(self, limits: Limits) -> None:
        return None


#: the fields of a Responses body, in the order their errors are told (the shared fields it does not
#: name are not read from it)
BODY_FIELDS = ("model", "input", "instructions", "max_output_tokens", "temperature", "top_p", "tools",
               "tool_choice", "parallel_tool_calls", "text", "previous_response_id", "store", "stream", "metadata",
               "user", "reasoning", "background", "top_logprobs", "include")  # fmt: skip


class ResponsesRequest(ToolRequest, GenerationRequest):
    """A ``POST /v1/responses`` body (see the module doc). ``check`` (at parsing) holds this API's own
    rules; ``start`` takes the conversation and checks the rest, as chat does."""

    body_fields: ClassVar[tuple] = BODY_FIELDS
    chat_template_kwargs: ClassVar[None] = None

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[ResponsesFunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    previous_response_id: str | None = None
    store: bool | None = None
    stream: bool | None = None
    metadata: dict[str, Any] | None = None
    user: str | None = None
    reasoning: dict[str, Any] | None = None
    background: bool | None = None
    top_logprobs: int | None = None
    include: list[str] | None = None
    _messages: list = PrivateAttr(default_factory=list)

    @model_validator(mode="before")
    @classmethod
    def _body_fields_only(cls, body):
        return {k: v for k, v in body.items() if k in BODY_FIELDS} if isinstance(body, dict) else body

    @property
    def kind(self) -> str:
        return "chat"

    @property
    def prompt_param(self) -> str:
        return "input"

    @property
    def max_tokens_param(self) -> str:
        return "max_output_tokens"

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_output_tokens

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.wants_logprobs else None

    @property
    def named_tool(self) -> str | None:
        return self.tool_choice["name"] if isinstance(self.tool_choice, dict) else None

    def tool_names(self) -> list:
        return [t.name for t in self.tools or ()]

    def template_tools(self) -> list | None:
        if not self.tools:
            return None
        return [
            {"type": "function", "function": t.model_dump(exclude_none=True, exclude={"type", "strict"})}
            for t in self.tools
        ]

    def template_messages(self) -> list:
        return [template_message(m) for m in self._messages]

    def client_param(self, param: str | None) -> str | None:
        param = super().client_param(param)
        return "text" if param == "response_format" else param

    def check(self, limits: Limits) -> None:
        """This API's own rules (``start`` checks the rest)."""
        if isinstance(self.input, list) and not self.input:
            raise ProtocolError("input is empty", param="input")
        if self.input == "":
            raise ProtocolError("input is empty", param="input")
        if isinstance(self.tool_choice, dict) and not (
            self.tool_choice.get("type") == "function" and isinstance(self.tool_choice.get("name"), str)
        ):
            raise ProtocolError(
                'tool_choice must be "none", "auto", "required" or {"type": "function", "name"}', "tool_choice"
            )
        if self.background and self.store is False:
            raise ProtocolError("background responses are kept: background needs store true", param="background")
        if self.background and self.stream:
            raise ProtocolError("background with stream is not supported; poll GET /v1/responses/{id}", "background")
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= 20:
            raise ProtocolError(f"top_logprobs must be in [0, 20], got {self.top_logprobs}", param="top_logprobs")
        for value in self.include or ():
            if value not in INCLUDABLE:
                raise ProtocolError(f"include: {value!r} is not one of {', '.join(INCLUDABLE)}", param="include")
        fmt = (self.text or {}).get("format")
        if fmt is not None and (
            not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema")
        ):
            raise ProtocolError('text.format type must be "text", "json_object" or "json_schema"', param="text")
        if isinstance(fmt, dict) and fmt.get("type") == "json_schema" and not isinstance(fmt.get("schema"), dict):
            raise ProtocolError('text.format json_schema needs a "schema" object', param="text")

    @property
    def stores(self) -> bool:
        return self.store is not False

    @property
    def wants_logprobs(self) -> bool:
        """Whether the message's ``output_text`` carries logprobs (``include`` names them, as vLLM)."""
        return OUTPUT_LOGPROBS in (self.include or ())

    def input_messages(self) -> list:
        """``input`` as chat messages. Raises ProtocolError naming ``input[i]`` for an item it cannot take."""
        if isinstance(self.input, str):
            return [{"role": "user", "content": self.input}]
        messages = []
        for i, item in enumerate(self.input):
            kind = item.get("type", "message" if "role" in item else None)
            where = f"input[{i}]"
            if kind == "message":
                messages.append({"role": item.get("role"), "content": _text_of(item.get("content"), where)})
            elif kind == "function_call":
                call = {
                    "id": _str(item, "call_id", where),
                    "type": "function",
                    "function": {"name": _str(item, "name", where), "arguments": _str(item, "arguments", where)},
                }
                last = messages[-1] if messages else None
                if last is not None and last["role"] == "assistant" and last.get("tool_calls") is not None:
                    last["tool_calls"].append(call)  # parallel calls: one assistant turn
                else:
                    messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
            elif kind == "function_call_output":
                output = item.get("output")
                content = output if isinstance(output, str) else _text_of(output, where)
                messages.append({"role": "tool", "tool_call_id": _str(item, "call_id", where), "content": content})
            elif kind == "reasoning":
                continue  # thinking of an earlier turn: not sent back to the model, as chat templates drop it
            else:
                raise ProtocolError(
                    f"{where} has type {kind!r}; this server takes message, function_call, function_call_output "
                    "and reasoning items",
                    param="input",
                )
        return messages

    def start(self, history: list, limits: Limits) -> list:
        """Take the conversation, ``instructions`` as the system message, then ``history`` (a previous
        response's conversation), then this input, and check it (its messages as chat's, the tools, the
        shared fields' rules). Returns the conversation without the instructions (not carried over, as
        OpenAI), as chat message dicts. Raises ProtocolError naming the field."""
        messages = ([{"role": "system", "content": self.instructions}] if self.instructions else []) + history
        self._messages = parse_request(Conversation, {"input": messages + self.input_messages()}, limits).input
        self.response_format = self._response_format()
        self.check_tools()
        GenerationRequest.check(self, limits)
        return [m.model_dump(exclude_none=True) for m in self._messages][1 if self.instructions else 0 :]

    def _response_format(self) -> dict | None:
        """``text.format`` as the shared ``response_format``."""
        fmt = (self.text or {}).get("format")
        if isinstance(fmt, dict) and fmt.get("type") == "json_object":
            return {"type": "json_object"}
        if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
            spec = {"name": fmt.get("name", "output"), "schema": fmt["schema"], "strict": fmt.get("strict")}
            return {"type": "json_schema", "json_schema": spec}
        return None


def _str(item: dict, key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise ProtocolError(f"{where}.{key} must be a string", param="input")
    return value


def _text_of(content, where: str) -> str:
    """A message's content as text: a string, or the texts of its ``input_text``/``output_text`` parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(
        isinstance(p, dict)
        and p.get("type") in ("input_text", "output_text", "text")
        and isinstance(p.get("text"), str)
        for p in content
    ):
        return "".join(p["text"] for p in content)
    raise ProtocolError(f"{where}.content must be a string or a list of input_text parts", param="input")
