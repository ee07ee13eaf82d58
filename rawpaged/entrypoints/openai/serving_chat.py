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
    def logprobs(req, prompt, token_ids, entries, text_offset=0):
        """Chat's ``logprobs`` object for these tokens (None unless asked for)."""
        if req.num_logprobs is None or not token_ids:
            return None
        return protocol.chat_logprobs(prompt.tokenizer, token_ids, entries or [], req.num_logprobs)

    def choice(self, req, index, prompt, output):
        return protocol.chat_choice(
            index, output.text, output.finish_reason, self.logprobs(req, prompt, output.token_ids, output.logprobs)
        )

    @staticmethod
    def opening_choices(req, num_choices):
        return [protocol.chat_chunk_choice(i, {"role": "assistant", "content": ""}, None) for i in range(num_choices)]

    def chunk_choices(self, req, index, prompt, delta):
        lp = self.logprobs(req, prompt, delta.token_ids, delta.logprobs)
        choices = []
        if delta.text or lp is not None:
            choices.append(protocol.chat_chunk_choice(index, {"content": delta.text}, None, lp))
        if delta.finish_reason is not None:
            choices.append(protocol.chat_chunk_choice(index, {}, delta.finish_reason))
        return choices


async def create_chat_completion(request: web.Request) -> web.StreamResponse:
    req = protocol.parse_request(ChatCompletionRequest, await read_body(request), request.app[STATE].limits)
    return await serve_generation(request, req, ChatFormat())
