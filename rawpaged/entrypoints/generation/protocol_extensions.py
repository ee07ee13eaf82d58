"""vLLM's extension fields of the request bodies that more than one route shares, as pydantic mixins in
``protocol``'s strict style: the chat-template options of ``/v1/chat/completions`` and ``/tokenize``
(``ChatTemplateOptions``) and the token-id outputs of chat and completions (``TokenIdOutputs``).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from rawpaged.entrypoints.http.errors import ProtocolError


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")  # as protocol.OpenAIBaseModel


class ChatTemplateOptions(_Strict):
    """How a conversation is rendered (vLLM's fields): ``add_generation_prompt`` opens the reply of the
    response role (default); ``continue_final_message`` leaves the last message open, to be continued
    (then ``add_generation_prompt`` must be false)."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False

    def check_template_options(self) -> None:
        """Raises ProtocolError (param ``continue_final_message``) when both options are true, as vLLM."""
        if self.continue_final_message and self.add_generation_prompt:
            raise ProtocolError(
                "continue_final_message and add_generation_prompt cannot both be true (set add_generation_prompt "
                "to false)",
                param="continue_final_message",
            )


class TokenIdOutputs(_Strict):
    """Token ids in the answer (vLLM's fields). ``return_token_ids``: each choice (each chunk's choice
    when streaming) carries ``token_ids``, the ids it generated, and the prompt's ids come as
    ``prompt_token_ids`` (chat: on the response and on each choice's first chunk; completions: on each
    choice and its first chunk). ``return_tokens_as_token_ids``: each ``token`` of the logprobs (top
    candidates and echoed prompt tokens included) is ``"token_id:<id>"``, so tokens that are not valid
    UTF-8 on their own stay tellable apart."""

    return_token_ids: bool | None = None
    return_tokens_as_token_ids: bool | None = None
