"""``POST /v1/chat/completions``: OpenAI's chat completions (messages rendered with the model's chat
template, ``logprobs`` + ``top_logprobs``, the role in each choice's first chunk), JSON or server-sent
events."""

from __future__ import annotations

from aiohttp import web

from rawpaged.entrypoints.openai import protocol
from rawpaged.entrypoints.openai.protocol import ChatCompletionRequest
from rawpaged.entrypoints.openai.serving_engine import read_body, serve_generation
from rawpaged.entrypoints.server_state import STATE


class ChatFormat:
    id_prefix = "chatcmpl"
    response = staticmethod(protocol.chat_response)
    chunk = staticmethod(protocol.chat_chunk)

    @staticmethod
    def _logprobs(req, prompt, token_ids, entries):
        if req.num_logprobs is None:
            return None
        return protocol.chat_logprobs(prompt.tokenizer, token_ids, entries or [], req.num_logprobs)

    def choice(self, req, index, prompt, output):
        return protocol.chat_choice(
            index, output.text, output.finish_reason, self._logprobs(req, prompt, output.token_ids, output.logprobs)
        )

    @staticmethod
    def opening_choices(req, num_choices):
        return [protocol.chat_chunk_choice(i, {"role": "assistant", "content": ""}, None) for i in range(num_choices)]

    def chunk_choice(self, req, index, prompt, delta):
        lp = self._logprobs(req, prompt, delta.token_ids, delta.logprobs) if delta.token_ids else None
        if not delta.text and delta.finish_reason is None and lp is None:
            return None
        return protocol.chat_chunk_choice(index, {"content": delta.text} if delta.text else {}, delta.finish_reason, lp)


async def create_chat_completion(request: web.Request) -> web.StreamResponse:
    req = protocol.parse_request(ChatCompletionRequest, await read_body(request), request.app[STATE].limits)
    return await serve_generation(request, req, ChatFormat())
