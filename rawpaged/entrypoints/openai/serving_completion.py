"""``POST /v1/completions``: OpenAI's legacy completions (prompts as strings or token ids, ``echo``,
integer ``logprobs``, ``best_of``), JSON or server-sent events."""

from __future__ import annotations

from aiohttp import web

from rawpaged.entrypoints.app_state import STATE
from rawpaged.entrypoints.openai import request_body, response_builders
from rawpaged.entrypoints.openai.protocol import CompletionRequest
from rawpaged.entrypoints.openai.serving_engine import read_body, serve_generation


class CompletionFormat:
    id_prefix = "cmpl"
    response = staticmethod(response_builders.completion_response)
    chunk = staticmethod(response_builders.completion_chunk)

    @staticmethod
    def logprobs(req, prompt, token_ids, entries, text_offset):
        """Completions' ``logprobs`` object for these tokens (None unless asked for)."""
        if req.num_logprobs is None or not token_ids:
            return None
        return response_builders.completion_logprobs(prompt.tokenizer, token_ids, entries or [], text_offset)

    def choice(self, req, index, prompt, output):
        prefix = prompt.echo_text if req.echo else ""
        return response_builders.completion_choice(
            index,
            prefix + output.text,
            output.finish_reason,
            self.logprobs(req, prompt, output.token_ids, output.logprobs, len(prefix)),
        )

    @staticmethod
    def opening_choices(req, num_choices):
        return []

    def chunk_choices(self, req, index, prompt, delta):
        echo = req.echo and delta.first
        lp = self.logprobs(
            req, prompt, delta.token_ids, delta.logprobs, delta.text_offset + (len(prompt.echo_text) if req.echo else 0)
        )
        choices = []
        if delta.text or lp is not None or echo:
            text = prompt.echo_text + delta.text if echo else delta.text
            choices.append(response_builders.completion_choice(index, text, None, lp))
        if delta.finish_reason is not None:
            choices.append(response_builders.completion_choice(index, "", delta.finish_reason))
        return choices


async def create_completion(request: web.Request) -> web.StreamResponse:
    req = request_body.parse_request(CompletionRequest, await read_body(request), request.app[STATE].limits)
    return await serve_generation(request, req, CompletionFormat())
