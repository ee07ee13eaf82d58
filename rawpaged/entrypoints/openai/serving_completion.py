"""``POST /v1/completions``: OpenAI's legacy completions (prompts as strings or token ids, ``echo``,
integer ``logprobs``, ``best_of``), JSON or server-sent events."""

from __future__ import annotations

from aiohttp import web

from rawpaged.entrypoints.openai import protocol
from rawpaged.entrypoints.openai.protocol import CompletionRequest
from rawpaged.entrypoints.openai.serving_engine import read_body, serve_generation
from rawpaged.entrypoints.server_state import STATE


class CompletionFormat:
    id_prefix = "cmpl"
    response = staticmethod(protocol.completion_response)
    chunk = staticmethod(protocol.completion_chunk)

    @staticmethod
    def _logprobs(req, prompt, token_ids, entries, offset):
        if req.num_logprobs is None:
            return None
        return protocol.completion_logprobs(prompt.tokenizer, token_ids, entries or [], offset)

    def choice(self, req, index, prompt, output):
        prefix = prompt.echo_text if req.echo else ""
        return protocol.completion_choice(
            index,
            prefix + output.text,
            output.finish_reason,
            self._logprobs(req, prompt, output.token_ids, output.logprobs, len(prefix)),
        )

    @staticmethod
    def opening_choices(req, num_choices):
        return []

    def chunk_choice(self, req, index, prompt, delta):
        echo = len(prompt.echo_text) if req.echo else 0
        lp = (
            self._logprobs(req, prompt, delta.token_ids, delta.logprobs, echo + delta.text_offset)
            if delta.token_ids
            else None
        )
        if not delta.text and delta.finish_reason is None and lp is None:
            return None
        text = prompt.echo_text + delta.text if req.echo and delta.first else delta.text
        return protocol.completion_choice(index, text, delta.finish_reason, lp)


async def create_completion(request: web.Request) -> web.StreamResponse:
    req = protocol.parse_request(CompletionRequest, await read_body(request), request.app[STATE].limits)
    return await serve_generation(request, req, CompletionFormat())
