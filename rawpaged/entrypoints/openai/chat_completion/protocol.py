"""The ``POST /v1/chat/completions`` request body (as vLLM's ``entrypoints/openai/chat_completion/protocol.py``)."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import Field

from rawpaged.entrypoints.generation.chat_messages import ChatMessage, ChatTool, NamedToolChoice
from rawpaged.entrypoints.generation.chat_utils import template_message
from rawpaged.entrypoints.generation.protocol import GenerationRequest
from rawpaged.entrypoints.generation.protocol_extensions import ChatTemplateOptions, TokenIdOutputs
from rawpaged.entrypoints.generation.tool_parsers import (
    ForcedToolParser,
    HermesToolParser,
    ToolParser,
    forced_tool_schema,
)
from rawpaged.entrypoints.http.errors import ProtocolError
from rawpaged.entrypoints.server.config import Limits
from rawpaged.errors import InvalidRequestError


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
