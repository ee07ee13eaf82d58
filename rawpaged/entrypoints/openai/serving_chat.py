"""``POST /v1/chat/completions``: OpenAI's chat completions (messages rendered with the model's chat
template, ``logprobs`` + ``top_logprobs``, the role in each choice's first chunk, tool calls), JSON or
server-sent events."""

from __future__ import annotations

from aiohttp import web

from rawpaged.entrypoints.app_state import STATE
from rawpaged.entrypoints.openai import request_body, response_builders
from rawpaged.entrypoints.openai.protocol import ChatCompletionRequest
from rawpaged.entrypoints.openai.serving_engine import read_body, serve_generation
from rawpaged.entrypoints.openai.tool_parsers import DeltaMessage, extract_tool_calls


class ChatFormat:
    """Chat's shapes for one request. With tools, each choice's text goes through its own tool parser
    (``ChatCompletionRequest.tool_parser``): content and ``tool_calls`` in the message or the deltas,
    and ``finish_reason`` "tool_calls" after a call."""

    id_prefix = "chatcmpl"
    response = staticmethod(response_builders.chat_response)
    chunk = staticmethod(response_builders.chat_chunk)

    def __init__(self):
        self._parsers: dict = {}  # choice index -> its tool parser (streaming)

    @staticmethod
    def logprobs(req, prompt, token_ids, entries, text_offset=0):
        """Chat's ``logprobs`` object for these tokens (None unless asked for)."""
        if req.num_logprobs is None or not token_ids:
            return None
        return response_builders.chat_logprobs(prompt.tokenizer, token_ids, entries or [], req.num_logprobs)

    def choice(self, req, index, prompt, output):
        lp = self.logprobs(req, prompt, output.token_ids, output.logprobs)
        parser = req.tool_parser()
        if parser is None:
            return response_builders.chat_choice(index, output.text, output.finish_reason, lp)
        content, tool_calls = extract_tool_calls(parser, output.text)
        return response_builders.chat_choice(index, content, parser.finish_reason(output.finish_reason), lp, tool_calls)

    @staticmethod
    def opening_choices(req, num_choices):
        return [
            response_builders.chat_chunk_choice(i, {"role": "assistant", "content": ""}, None)
            for i in range(num_choices)
        ]

    def chunk_choices(self, req, index, prompt, delta):
        lp = self.logprobs(req, prompt, delta.token_ids, delta.logprobs)
        if index not in self._parsers:
            self._parsers[index] = req.tool_parser()
        parser = self._parsers[index]
        finish_reason = delta.finish_reason
        if parser is None:
            message = DeltaMessage(delta.text)
        else:
            message = parser.feed(delta.text)
            if finish_reason is not None:
                rest = parser.finish()
                message = DeltaMessage(message.content + rest.content, message.tool_calls + rest.tool_calls)
                finish_reason = parser.finish_reason(finish_reason)
        choices = []
        if message or lp is not None:
            fields = {"content": message.content} if message.content or not message.tool_calls else {}
            if message.tool_calls:
                fields["tool_calls"] = message.tool_calls
            choices.append(response_builders.chat_chunk_choice(index, fields, None, lp))
        if finish_reason is not None:
            choices.append(response_builders.chat_chunk_choice(index, {}, finish_reason))
        return choices


async def create_chat_completion(request: web.Request) -> web.StreamResponse:
    req = request_body.parse_request(ChatCompletionRequest, await read_body(request), request.app[STATE].limits)
    return await serve_generation(request, req, ChatFormat())
