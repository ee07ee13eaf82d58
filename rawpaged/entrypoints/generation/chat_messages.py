"""The conversation's pieces as pydantic models: messages (with their text parts and the assistant's tool
calls), tool definitions and a named tool choice; shared by chat completions, tokenize and the websocket."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from rawpaged.entrypoints.generation.protocol import OpenAIBaseModel


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
