"""The tool rules of a request that takes ``tools`` (chat completions and the Responses API): what
``tool_choice`` asks, the choice's tool parser, the constraint a forced call puts on generation, the
checks of ``tools`` and ``tool_choice``, and an engine error about a forced call's schema named as the
client sent it. Each request says how its own shapes name its tools (``tool_names``, ``named_tool``,
``template_tools``)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

from rawpaged.entrypoints.generation.tool_parsers import (
    ForcedToolParser,
    HermesToolParser,
    ToolParser,
    forced_tool_schema,
)
from rawpaged.entrypoints.http.errors import ProtocolError
from rawpaged.errors import InvalidRequestError


class ToolRequest(ABC):
    """A mixin before ``protocol.GenerationRequest`` in a request model's bases: ``tools``,
    ``tool_choice`` and ``parallel_tool_calls`` are its fields, ``tool_names()`` the names of its
    functions, ``named_tool`` the function ``tool_choice`` names (None: it names none). Pydantic's model
    metaclass is an ``ABCMeta``, so a request model that leaves either hook out cannot be instantiated
    (TypeError)."""

    accepts_tools: ClassVar[bool] = True

    @abstractmethod
    def tool_names(self) -> list:
        """The function names of ``tools``, in order (repeats kept)."""

    @property
    @abstractmethod
    def named_tool(self) -> str | None:
        """The function ``tool_choice`` names, or None."""

    @property
    def tool_mode(self) -> str:
        """ "none", "auto", "required" or "named": what ``tool_choice`` asks (OpenAI's default: "auto"
        with tools, "none" without)."""
        if not self.tools:
            return "none"
        if self.named_tool is not None:
            return "named"
        return self.tool_choice or "auto"

    @property
    def forced_tool(self) -> bool:
        """Whether generation is constrained to a tool call."""
        return self.tool_mode in ("required", "named")

    def tool_parser(self) -> ToolParser | None:
        mode = self.tool_mode
        if mode == "auto":
            return HermesToolParser(max_calls=1 if self.parallel_tool_calls is False else None)
        if mode in ("required", "named"):
            return ForcedToolParser(self.named_tool)
        return None

    def structured_outputs_fields(self) -> dict | None:
        fields = super().structured_outputs_fields()
        if not self.forced_tool:
            return fields
        return {
            "json": forced_tool_schema(self.template_tools(), self.named_tool, self.parallel_tool_calls is not False)
        }

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
            what = f"the parameters schema of {self.named_tool!r}"
        else:
            what = "one of the parameters schemas"
        return ProtocolError(f"tools: {what}{rest}", param="tools")

    def check_tools(self) -> None:
        """Raises ProtocolError: ``tool_choice`` without tools, repeated function names, a named function
        not in ``tools``, a forced call with another constraint or with beam search."""
        if self.tool_choice not in (None, "none") and not self.tools:
            raise ProtocolError("tool_choice is only allowed when tools are given", param="tool_choice")
        names = self.tool_names()
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ProtocolError(f"function names in tools must be unique; {duplicates} repeat", param="tools")
        if self.tool_mode == "named" and self.named_tool not in names:
            raise ProtocolError(
                f"tool_choice names the function {self.named_tool!r}, which is not in tools", param="tool_choice"
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
