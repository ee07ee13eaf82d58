"""The websocket's ``generate`` message as a pydantic model."""

from __future__ import annotations

from typing import Any

from pydantic import Field

from rawpaged.entrypoints.generation.chat_messages import ChatMessage
from rawpaged.entrypoints.generation.chat_utils import template_message
from rawpaged.entrypoints.generation.protocol import GenerationRequest, prompt_list
from rawpaged.entrypoints.http.errors import ProtocolError
from rawpaged.entrypoints.server.config import Limits


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
        return prompt_list(self.prompt)

    def template_messages(self) -> list:
        return [template_message(m) for m in self.messages]
