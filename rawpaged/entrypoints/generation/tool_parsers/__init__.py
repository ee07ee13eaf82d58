"""Tool calls in generated text: a parser per ``tool_choice`` (as vLLM's ``entrypoints/openai/tool_parsers``).

- ``"auto"``: :class:`HermesToolParser` finds Hermes/Qwen-style ``<tool_call>{...}</tool_call>`` blocks.
- ``"required"`` or a named function: generation is constrained to JSON (``forced_tool_schema``), and
  :class:`ForcedToolParser` reads the calls from it.
"""

from rawpaged.entrypoints.generation.tool_parsers.abstract_tool_parser import (
    DeltaMessage,
    ToolParser,
    extract_tool_calls,
    new_tool_call_id,
    whole_tool_calls,
)
from rawpaged.entrypoints.generation.tool_parsers.forced_tool_parser import ForcedToolParser, forced_tool_schema
from rawpaged.entrypoints.generation.tool_parsers.hermes_tool_parser import HermesToolParser

__all__ = [
    "DeltaMessage",
    "ForcedToolParser",
    "HermesToolParser",
    "ToolParser",
    "extract_tool_calls",
    "forced_tool_schema",
    "new_tool_call_id",
    "whole_tool_calls",
]
