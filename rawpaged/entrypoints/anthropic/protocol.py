"""Anthropic's Messages API request (``POST /v1/messages``, what Anthropic's SDKs and coding agents call;
vLLM and llama.cpp's server serve it too), a generation request of its own: its fields map onto the shared
ones (``generation.protocol``) that the chat pipeline reads, under Anthropic's names (``max_tokens``,
``stop_sequences``, ``system``), so every refusal names the field the client sent. ``count_tokens``'
request (``CountTokensRequest``) is the same conversation without the generation fields.

Taken: ``model`` and ``max_tokens`` (both required, as Anthropic requires them), ``system`` (a string or
text blocks), ``messages`` (``user`` and ``assistant`` turns, content a string or blocks: ``text``,
``tool_use``, ``tool_result``, ``thinking`` and ``redacted_thinking`` (earlier thinking, skipped as chat
templates drop it); ``image`` is refused: the model reads text only), ``tools`` (custom tools:
``name``, ``description``, ``input_schema``), ``tool_choice`` (``auto``, ``any``, ``tool`` with its
``name``, ``none``; ``disable_parallel_tool_use``), ``stop_sequences``, ``temperature``, ``top_p``,
``top_k``, ``metadata``, ``stream``, ``thinking`` (``disabled`` is the chat template's ``enable_thinking``
false; ``budget_tokens`` is not enforced), ``output_config.format`` (a JSON Schema the text follows, as
chat's ``response_format``). ``cache_control`` (on the request, its blocks and tools) and ``service_tier``
are accepted and ignored: the prefix cache works without them. A last ``assistant`` message is continued (Anthropic's
prefill).
"""

from __future__ import annotations

import json
from typing import Any, ClassVar

from pydantic import Field, model_validator

from rawpaged.entrypoints.anthropic.request_blocks import (
    Message,
    Metadata,
    OutputConfig,
    TextBlock,
    Thinking,
    Tool,
    ToolChoice,
)
from rawpaged.entrypoints.generation.chat_messages import ChatMessage, FunctionCall, ToolCall
from rawpaged.entrypoints.generation.chat_utils import template_message
from rawpaged.entrypoints.generation.protocol import MAX_STOP_STRINGS, GenerationRequest, OpenAIBaseModel
from rawpaged.entrypoints.generation.tool_requests import ToolRequest
from rawpaged.entrypoints.http.errors import ProtocolError
from rawpaged.entrypoints.server.config import Limits

#: ``tool_choice`` type -> the shared tool mode (``ToolRequest.tool_mode``)
TOOL_MODES = {"auto": "auto", "any": "required", "tool": "named", "none": "none"}

EXPECTED = {
    "system": "a string or a list of text blocks",
    "messages": "a non-empty list of {role, content} objects",
    "tool_choice": '{"type": "auto" | "any" | "tool" | "none"} ("tool" with its "name")',
    "stop_sequences": "a list of strings",
}


class Conversation:
    """What ``MessagesRequest`` and ``CountTokensRequest`` share: the conversation (``system``,
    ``messages``, ``tools``, ``tool_choice``, ``thinking``) as the chat pipeline renders it."""

    expected_types: ClassVar[dict] = EXPECTED

    @property
    def kind(self) -> str:
        return "chat"

    @property
    def prompt_param(self) -> str:
        return "messages"

    @property
    def add_generation_prompt(self) -> bool:
        """A reply opens unless the last message is the assistant's, which the reply continues."""
        return self.messages[-1].role != "assistant"

    @property
    def continue_final_message(self) -> bool:
        return not self.add_generation_prompt

    @property
    def chat_template_kwargs(self) -> dict | None:
        """``thinking`` as the chat template's ``enable_thinking`` (Qwen3's switch), else None."""
        if self.thinking is None:
            return None
        return {"enable_thinking": self.thinking.type != "disabled"}

    @property
    def tool_mode(self) -> str:
        if not self.tools:
            return "none"
        return TOOL_MODES[self.tool_choice.type if self.tool_choice is not None else "auto"]

    @property
    def named_tool(self) -> str | None:
        return self.tool_choice.name if self.tool_choice is not None and self.tool_choice.type == "tool" else None

    @property
    def parallel_tool_calls(self) -> bool | None:
        return False if self.tool_choice is not None and self.tool_choice.disable_parallel_tool_use else None

    def tool_names(self) -> list:
        return [t.name for t in self.tools or ()]

    def template_tools(self) -> list | None:
        """The tools as OpenAI's function tools (what templates and the forced-call grammar take)."""
        if not self.tools:
            return None
        out = []
        for t in self.tools:
            function = {"name": t.name, "description": t.description, "parameters": t.input_schema}
            out.append({"type": "function", "function": {k: v for k, v in function.items() if v is not None}})
        return out

    def template_messages(self) -> list:
        return [template_message(m) for m in self.chat_messages()]

    def chat_messages(self) -> list:
        """The conversation as chat messages (``ChatMessage``): ``system`` first; a user turn's
        ``tool_result`` blocks as ``tool`` messages, in order with its text; an assistant turn's text and
        ``tool_use`` blocks as one message with ``tool_calls``; thinking blocks dropped."""
        out = []
        if self.system:
            system = self.system if isinstance(self.system, str) else "".join(b.text for b in self.system)
            out.append(ChatMessage(role="system", content=system))
        for m in self.messages:
            if m.role == "assistant":
                out.append(_assistant_message(m.content))
            else:
                out += _user_messages(m.content)
        return out

    def check_conversation(self) -> None:
        """Raises ProtocolError naming the block: an image, a server tool, ``tool_choice`` naming a tool
        not in ``tools``, a continued assistant turn that ends in a tool call."""
        for i, m in enumerate(self.messages):
            for j, block in enumerate(m.content):
                where = f"messages.{i}.content.{j}"
                nested = (block.content or []) if block.type == "tool_result" else []
                if block.type == "image" or any(b.type == "image" for b in nested):
                    raise ProtocolError(
                        f"{where}: image content is not supported: this server's model reads text only",
                        param="messages",
                    )
                if m.role == "user" and block.type in ("tool_use", "thinking", "redacted_thinking"):
                    raise ProtocolError(f"{where}: a {block.type} block belongs to an assistant turn", "messages")
                if m.role == "assistant" and block.type == "tool_result":
                    raise ProtocolError(f"{where}: a tool_result block belongs to a user turn", param="messages")
        last = self.messages[-1]
        if (
            last.role == "assistant"
            and isinstance(last.content, list)
            and any(b.type == "tool_use" for b in last.content)
        ):
            raise ProtocolError(
                "messages: the last message is an assistant turn that ends in tool_use; send its tool_result "
                "in a user turn",
                param="messages",
            )
        for i, t in enumerate(self.tools or ()):
            if t.type not in (None, "custom"):
                raise ProtocolError(
                    f"tools.{i}: tool type {t.type!r} is not supported: this server runs custom tools only "
                    "(name, description, input_schema)",
                    param="tools",
                )
        names = self.tool_names()
        if self.tool_choice is not None and self.tool_choice.type == "tool":
            if not self.tool_choice.name:
                raise ProtocolError('tool_choice of type "tool" needs the "name" of a tool', param="tool_choice")
            if self.tool_choice.name not in names:
                raise ProtocolError(
                    f"tool_choice names the tool {self.tool_choice.name!r}, which is not in tools", "tool_choice"
                )
        if self.tool_choice is not None and self.tool_choice.type == "any" and not self.tools:
            raise ProtocolError('tool_choice "any" needs tools', param="tool_choice")
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ProtocolError(f"tool names must be unique; {duplicates} repeat", param="tools")


def _assistant_message(blocks: list) -> ChatMessage:
    text = "".join(b.text for b in blocks if b.type == "text")
    calls = [
        ToolCall(id=b.id, function=FunctionCall(name=b.name, arguments=json.dumps(b.input, ensure_ascii=False)))
        for b in blocks
        if b.type == "tool_use"
    ]
    return ChatMessage(role="assistant", content=text if text or not calls else None, tool_calls=calls or None)


def _user_messages(blocks: list) -> list:
    """A user turn's blocks as chat messages: runs of text as user messages, each ``tool_result`` as a
    ``tool`` message (its text; ``is_error`` results marked as errors)."""
    out, text = [], None
    for b in blocks:
        if b.type == "text":
            text = (text or "") + b.text
        elif b.type == "tool_result":
            if text is not None:
                out.append(ChatMessage(role="user", content=text))
                text = None
            content = "".join(p.text for p in b.content or ())
            if b.is_error:
                content = f"Error: {content}"
            out.append(ChatMessage(role="tool", tool_call_id=b.tool_use_id, content=content))
    if text is not None or not out:
        out.append(ChatMessage(role="user", content=text or ""))
    return out


#: the fields of a Messages body, in the order their errors are told (the shared fields it does not name
#: are not read from it)
BODY_FIELDS = ("model", "max_tokens", "messages", "system", "tools", "tool_choice", "stop_sequences",
               "temperature", "top_p", "top_k", "metadata", "stream", "thinking", "output_config",
               "service_tier", "cache_control")  # fmt: skip


class MessagesRequest(Conversation, ToolRequest, GenerationRequest):
    """A ``POST /v1/messages`` body (see the module doc). ``check`` holds this API's own rules, then the
    shared ones under this API's field names."""

    body_fields: ClassVar[tuple] = BODY_FIELDS

    model: str
    max_tokens: int
    messages: list[Message] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    metadata: Metadata | None = None
    stream: bool | None = None
    thinking: Thinking | None = None
    output_config: OutputConfig | None = None
    service_tier: str | None = None  # accepted: one tier here
    cache_control: dict[str, Any] | None = None  # accepted: the prefix cache works without it

    @model_validator(mode="before")
    @classmethod
    def _body_fields_only(cls, body):
        return {k: v for k, v in body.items() if k in BODY_FIELDS} if isinstance(body, dict) else body

    def client_param(self, param: str | None) -> str | None:
        param = super().client_param(param)
        return {"stop": "stop_sequences", "response_format": "output_config"}.get(param, param)

    def check(self, limits: Limits) -> None:
        self.check_conversation()
        if self.stop_sequences is not None and len(self.stop_sequences) > MAX_STOP_STRINGS:
            raise ProtocolError(
                f"stop_sequences has {len(self.stop_sequences)} strings; at most {MAX_STOP_STRINGS}",
                param="stop_sequences",
            )
        if self.thinking is not None and self.thinking.type == "enabled" and self.thinking.budget_tokens is None:
            raise ProtocolError('thinking of type "enabled" needs budget_tokens', param="thinking")
        self.stop = self.stop_sequences
        fmt = self.output_config.format if self.output_config is not None else None
        if fmt is not None:
            if self.tool_mode in ("required", "named"):
                raise ProtocolError(
                    'output_config.format cannot be set with tool_choice "any" or "tool" (the answer is a call)',
                    param="output_config",
                )
            self.response_format = {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt.schema_}}
        GenerationRequest.check(self, limits)


class CountTokensRequest(Conversation, OpenAIBaseModel):
    """A ``POST /v1/messages/count_tokens`` body: the conversation of a Messages request (its other
    fields are ignored)."""

    model: str
    messages: list[Message] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None

    def check(self, limits: Limits) -> None:
        self.check_conversation()
