"""The content blocks and small objects of Anthropic's Messages API request (``text``, ``image``,
``tool_use``, ``tool_result``, ``thinking``, ``redacted_thinking``; a message, a tool, ``tool_choice``,
``thinking``, ``output_config``, ``metadata``), as pydantic models; ``protocol`` builds the request of them.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, field_validator

from rawpaged.entrypoints.generation.protocol import OpenAIBaseModel


class TextBlock(OpenAIBaseModel):
    type: Literal["text"]
    text: str


class ImageBlock(OpenAIBaseModel):
    """Accepted by the schema so that it is refused by name (``check``): this server's models read text."""

    type: Literal["image"]
    source: dict[str, Any]


class ToolUseBlock(OpenAIBaseModel):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


def _as_blocks(content):
    """A string content as one text block, so that a list's errors are told by block, not as "not a
    string"."""
    return [{"type": "text", "text": content}] if isinstance(content, str) else content


class ToolResultBlock(OpenAIBaseModel):
    type: Literal["tool_result"]
    tool_use_id: str
    content: list[Annotated[TextBlock | ImageBlock, Field(discriminator="type")]] | None = None
    is_error: bool | None = None

    _blocks = field_validator("content", mode="before")(_as_blocks)


class ThinkingBlock(OpenAIBaseModel):
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(OpenAIBaseModel):
    type: Literal["redacted_thinking"]
    data: str


ContentBlock = Annotated[
    TextBlock | ImageBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | RedactedThinkingBlock,
    Field(discriminator="type"),
]


class Message(OpenAIBaseModel):
    """A turn; a string ``content`` is taken as one text block."""

    role: Literal["user", "assistant"]
    content: list[ContentBlock]

    _blocks = field_validator("content", mode="before")(_as_blocks)


class Tool(OpenAIBaseModel):
    """A custom tool (``type`` absent or ``"custom"``); Anthropic's server tools (web search, code
    execution, ...) have other types and are refused (``check``)."""

    type: str | None = None
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,128}$")
    description: str | None = None
    input_schema: dict[str, Any]
    strict: bool | None = None


class ToolChoice(OpenAIBaseModel):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class Thinking(OpenAIBaseModel):
    type: Literal["enabled", "disabled", "adaptive", "between_tools"]
    budget_tokens: int | None = None
    display: str | None = None


class OutputFormat(OpenAIBaseModel):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(OpenAIBaseModel):
    """``format`` constrains the answer's text to a JSON Schema (structured outputs); ``effort`` is
    accepted and not read."""

    effort: str | None = None
    format: OutputFormat | None = None


class Metadata(OpenAIBaseModel):
    user_id: str | None = None
