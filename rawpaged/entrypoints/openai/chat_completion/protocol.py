"""The ``POST /v1/chat/completions`` request body (as vLLM's ``entrypoints/openai/chat_completion/protocol.py``)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from rawpaged.entrypoints.generation.chat_messages import ChatMessage, ChatTool, NamedToolChoice
from rawpaged.entrypoints.generation.chat_utils import template_message
from rawpaged.entrypoints.generation.protocol import GenerationRequest
from rawpaged.entrypoints.generation.protocol_extensions import ChatTemplateOptions, TokenIdOutputs
from rawpaged.entrypoints.generation.tool_requests import ToolRequest
from rawpaged.entrypoints.http.errors import ProtocolError
from rawpaged.entrypoints.server.config import Limits


class ChatCompletionRequest(ToolRequest, GenerationRequest, ChatTemplateOptions, TokenIdOutputs):
    """A ``POST /v1/chat/completions`` body (with vLLM's ``ChatTemplateOptions``, ``TokenIdOutputs`` and
    ``echo``: the last message's content, when its role is the response role, starts each choice's
    content, as vLLM's).

    Tools: ``tools`` are rendered through the chat template (``rawpaged.entrypoints.generation.chat_utils``), and
    ``tool_choice`` says what is done with them: ``"none"`` (no call is parsed), ``"auto"`` (the default
    with tools: Hermes-style ``<tool_call>`` blocks in the output are parsed), ``"required"`` or
    ``{"type": "function", "function": {"name"}}`` (generation is constrained to a valid call;
    ``rawpaged.entrypoints.generation.tool_parsers.forced_tool_parser``; the rules: ``tool_requests``)."""

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
    def named_tool(self) -> str | None:
        return self.tool_choice.function.name if isinstance(self.tool_choice, NamedToolChoice) else None

    def tool_names(self) -> list:
        return [t.function.name for t in self.tools or ()]

    def template_tools(self) -> list | None:
        return [t.model_dump(exclude_none=True) for t in self.tools] if self.tools else None

    def check(self, limits: Limits) -> None:
        if self.top_logprobs is not None and not self.logprobs:
            raise ProtocolError("top_logprobs requires logprobs to be true", param="top_logprobs")
        self.check_template_options()
        self.check_tools()
        super().check(limits)

    def template_messages(self) -> list:
        return [template_message(m) for m in self.messages]
