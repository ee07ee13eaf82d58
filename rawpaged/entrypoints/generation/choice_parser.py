"""One choice's generated text as a message: the reasoning parser first (``reasoning_parsers``, with
``--reasoning-parser``), then the choice's tool parser (``tool_parsers``) on the rest, piece by piece. Chat
(whole and streamed), the Responses API and the websocket all parse through ``ChoiceParser``, so a streamed
answer adds up to the whole one."""

from __future__ import annotations

from rawpaged.entrypoints.generation.reasoning_parsers import ReasoningParser
from rawpaged.entrypoints.generation.tool_parsers import DeltaMessage, ToolParser, whole_tool_calls


class ChoiceParser:
    """One choice's text, fed piece by piece (``feed``, the last piece with ``last=True``): each call
    returns the ``DeltaMessage`` it adds (``reasoning``, ``content``, ``tool_calls`` entries as OpenAI's
    ``delta.tool_calls``). Text that may begin a tag or a call is held back until it is known, and given
    with the last piece."""

    def __init__(self, reasoning_parser: str | None, tool_parser: ToolParser | None):
        self.reasoner = ReasoningParser(reasoning_parser) if reasoning_parser else None
        self.tool_parser = tool_parser

    @property
    def reasoned(self) -> bool:
        """Whether any of the text so far was reasoning."""
        return self.reasoner is not None and self.reasoner.reasoned

    def feed(self, text: str, last: bool = False) -> DeltaMessage:
        reasoning, content = "", text
        if self.reasoner is not None:
            reasoning, content = self.reasoner.feed(text)
            if last:
                more_reasoning, more_content = self.reasoner.finish()
                reasoning, content = reasoning + more_reasoning, content + more_content
        if self.tool_parser is None:
            return DeltaMessage(content, reasoning=reasoning)
        message = self.tool_parser.feed(content)
        if not last:
            return DeltaMessage(message.content, message.tool_calls, reasoning)
        rest = self.tool_parser.finish()
        return DeltaMessage(message.content + rest.content, message.tool_calls + rest.tool_calls, reasoning)

    def finish_reason(self, reason: str | None) -> str | None:
        """The choice's ``finish_reason``: "tool_calls" for "stop" after a call (``ToolParser``)."""
        return reason if self.tool_parser is None else self.tool_parser.finish_reason(reason)


def parse_choice(reasoning_parser: str | None, tool_parser: ToolParser | None, text: str) -> tuple:
    """``(reasoning or None, content or None, tool_calls)`` of a whole choice's text, as ``ChoiceParser``
    gives it streamed: ``reasoning`` None when none of it reasoned, ``content`` None when it is only tool
    calls, ``tool_calls`` OpenAI's ``[{"id", "type", "function": {"name", "arguments"}}]``."""
    parser = ChoiceParser(reasoning_parser, tool_parser)
    message = parser.feed(text, last=True)
    calls = whole_tool_calls(message.tool_calls)
    content = message.content if message.content or not calls else None
    return (message.reasoning if parser.reasoned else None), content, calls
