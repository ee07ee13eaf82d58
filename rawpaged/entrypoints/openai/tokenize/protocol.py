"""The request bodies of vLLM's tokenizer routes (``serving``), as pydantic models in
``generation.protocol``'s strict style (vLLM's ``TokenizeCompletionRequest``, ``TokenizeChatRequest`` and
``DetokenizeRequest``).

``POST /tokenize`` takes a raw ``prompt`` or chat ``messages``, never both: ``tokenize_request_model`` picks
the model from the body's keys. Every refusal is a
:class:`~rawpaged.entrypoints.http.errors.ProtocolError` naming the field.
"""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import Field

from rawpaged.entrypoints.generation.chat_messages import ChatMessage, ChatTool
from rawpaged.entrypoints.generation.chat_utils import template_message
from rawpaged.entrypoints.generation.protocol import OpenAIBaseModel
from rawpaged.entrypoints.generation.protocol_extensions import ChatTemplateOptions
from rawpaged.entrypoints.http.errors import ProtocolError
from rawpaged.entrypoints.server.config import Limits
from rawpaged.tokenizer import RESERVED_TEMPLATE_KWARGS


class TokenizeCompletionRequest(OpenAIBaseModel):
    """A ``POST /tokenize`` body with a raw ``prompt``: special-token text in it becomes the special
    token, and ``add_special_tokens`` (default true) adds what the tokenizer adds to a text (Llama 3's
    BOS)."""

    #: what a field must be, for ``request_body``'s messages (``prompt`` is a string here, not a list)
    expected_types: ClassVar[dict] = {"prompt": "a string"}

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool | None = False

    def check(self, limits: Limits) -> None:
        """Nothing beyond the JSON types."""


class TokenizeChatRequest(OpenAIBaseModel, ChatTemplateOptions):
    """A ``POST /tokenize`` body with chat ``messages``, rendered with the chat template as
    ``/v1/chat/completions`` renders them (contents literal, ``tools`` rendered or written into the
    system message). ``add_special_tokens`` (default false) adds the tokenizer's own on top of the
    template's; ``continue_final_message`` leaves the last message open (then ``add_generation_prompt``
    must be false)."""

    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_special_tokens: bool = False
    return_token_strs: bool | None = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ChatTool] | None = None

    def check(self, limits: Limits) -> None:
        """Raises ProtocolError for ``continue_final_message`` with ``add_generation_prompt`` or
        ``chat_template_kwargs`` that set a variable the server sets."""
        self.check_template_options()
        reserved = sorted(set(self.chat_template_kwargs or ()) & RESERVED_TEMPLATE_KWARGS)
        if reserved:
            raise ProtocolError(f"chat_template_kwargs may not set {reserved}", param="chat_template_kwargs")

    def template_messages(self) -> list:
        """The messages as chat templates take them (``chat_utils.template_message``)."""
        return [template_message(m) for m in self.messages]

    def template_tools(self) -> list | None:
        """The tools for the chat template (OpenAI's dicts), or None."""
        return [t.model_dump(exclude_none=True) for t in self.tools] if self.tools else None


TokenizeRequest = TokenizeCompletionRequest | TokenizeChatRequest


def tokenize_request_model(body) -> type:
    """The model of a decoded ``POST /tokenize`` body: ``TokenizeChatRequest`` when it has ``messages``,
    else ``TokenizeCompletionRequest`` (also for a body that is not an object, which that model refuses).

    Raises:
        ProtocolError: the body (an object) has both ``prompt`` and ``messages``, or neither.
    """
    if not isinstance(body, dict):
        return TokenizeCompletionRequest
    if ("prompt" in body) == ("messages" in body):
        raise ProtocolError(
            f"exactly one of prompt and messages is required, got {'both' if 'prompt' in body else 'neither'}",
            param="prompt",
        )
    return TokenizeChatRequest if "messages" in body else TokenizeCompletionRequest


class DetokenizeRequest(OpenAIBaseModel):
    """A ``POST /detokenize`` body: ``tokens``, ids of the tokenizer's vocabulary (checked against it by
    the route)."""

    expected_types: ClassVar[dict] = {"tokens": "a list of token ids (integers)"}

    model: str | None = None
    tokens: list[int]

    def check(self, limits: Limits) -> None:
        """Nothing beyond the JSON types: the ids are checked against the vocabulary by the route."""
