"""The ``POST /v1/completions`` request body (as vLLM's ``entrypoints/openai/completion/protocol.py``)."""

from __future__ import annotations

from rawpaged.entrypoints.generation.protocol import GenerationRequest, PromptType, prompt_list
from rawpaged.entrypoints.generation.protocol_extensions import TokenIdOutputs
from rawpaged.entrypoints.server.config import Limits


class CompletionRequest(GenerationRequest, TokenIdOutputs):
    """A ``POST /v1/completions`` body (with vLLM's ``TokenIdOutputs``)."""

    prompt: PromptType
    echo: bool | None = None
    best_of: int | None = None
    logprobs: int | None = None

    @property
    def num_logprobs(self) -> int | None:
        return self.logprobs

    @property
    def num_prompt_logprobs(self) -> int | None:
        """``prompt_logprobs``, else with ``echo`` the ``logprobs`` count (the echoed tokens get theirs, as
        in OpenAI's legacy API and vLLM)."""
        if self.prompt_logprobs is None and self.echo:
            return self.logprobs
        return self.prompt_logprobs

    @property
    def echo_only(self) -> bool:
        return bool(self.echo) and self.max_tokens == 0

    @property
    def requested_max_tokens(self) -> int | None:
        """``max_tokens``; 0 with ``echo`` returns the prompt alone, from a one-token generation (vLLM's way),
        so 1 here."""
        return 1 if self.echo_only else self.max_tokens

    def prompts(self, limits: Limits) -> list:
        return prompt_list(self.prompt, limits)

    def check(self, limits: Limits) -> None:
        super().check(limits)
        self.prompts(limits)
