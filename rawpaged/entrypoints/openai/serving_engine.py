"""What the OpenAI routes (and the websocket) share: reading a body, turning a parsed request into
engine requests (prompts tokenized off the event loop, checked by the engine, ``max_tokens`` picked), and
answering with one JSON response or a server-sent-event stream.

The two routes differ only in shapes; each passes a ``ResponseFormat`` (``serving_completion``,
``serving_chat``).
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
from dataclasses import dataclass
from typing import Protocol

from aiohttp import web

from rawpaged.engine.engine_client import EngineClient
from rawpaged.engine.outputs import CompletionDelta, CompletionOutput, DeltaTracker
from rawpaged.entrypoints.admission import check_capacity, check_model, require_engine
from rawpaged.entrypoints.app_state import STATE, AppState
from rawpaged.entrypoints.chat_utils import template_conversation
from rawpaged.entrypoints.http_errors import ProtocolError, error_body
from rawpaged.entrypoints.http_responses import error_response
from rawpaged.entrypoints.openai import response_builders
from rawpaged.entrypoints.openai.protocol import GenerationRequest
from rawpaged.entrypoints.server_config import Limits
from rawpaged.errors import EngineDeadError, EngineError, InvalidRequestError
from rawpaged.sampling_params import SamplingParams

logger = logging.getLogger("rawpaged.server")

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


def _too_large(state: AppState) -> ProtocolError:
    return ProtocolError(f"request body is larger than {state.max_body_size} bytes (--max-body-size)", status=413)


async def expect_handler(request: web.Request) -> web.Response | None:
    """``Expect: 100-continue`` (aiohttp runs this before the middleware): a 413 at once for a
    ``Content-Length`` past ``--max-body-size``, so the client need not send the body; else
    ``100 Continue``, as aiohttp's own handler does."""
    state = request.app[STATE]
    if request.content_length is not None and request.content_length > state.max_body_size:
        e = _too_large(state)
        resp = error_response(state, e.status, e.message, e.type)
        resp.force_close()  # the body the client may still send is not read
        logger.info("%s %s -> 413 %s", request.method, request.rel_url.path, e.message)
        return resp
    expect = request.headers.get("Expect", "")
    if request.version >= (1, 1):
        if expect.lower() != "100-continue":
            raise web.HTTPExpectationFailed(text=f"Unknown Expect: {expect}")
        await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        request.writer.output_size = 0  # the response proper has not started
    return None


async def read_body(request: web.Request) -> bytes:
    """The request body; a 413 past ``--max-body-size``, a 408 (and the connection closed) when it has not
    all arrived within ``--timeout-body``."""
    state = request.app[STATE]
    timeout = state.server.timeout_body
    try:
        return await asyncio.wait_for(request.read(), timeout)
    except web.HTTPRequestEntityTooLarge:
        raise _too_large(state) from None
    except asyncio.TimeoutError:
        raise ProtocolError(
            f"the request body did not arrive within {timeout:g}s (--timeout-body)",
            status=408,
            type="timeout_error",
            close=True,
        ) from None


@dataclass
class PreparedPrompt:
    text: str | None
    ids: list
    params: SamplingParams
    tokenizer: object

    @functools.cached_property
    def echo_text(self) -> str:
        return self.text if self.text is not None else self.tokenizer.decode(self.ids, skip_special_tokens=False)


async def prepare_prompts(engine: EngineClient, req: GenerationRequest, limits: Limits) -> list:
    """Tokenize (in a worker thread: a long prompt or chat template must not stall the event loop),
    check each prompt with the engine's own checks, pick ``max_tokens`` (the client's, refused beyond the
    context; else 16 for completions, for chat whatever fits up to the server's limit) and build its
    ``SamplingParams``. Raises ProtocolError naming the field."""
    tok = engine.tokenizer
    max_len = engine.max_model_len

    def check_length(text: str) -> None:  # before the tokenizer's seconds on a prompt that cannot fit
        at_least = tok.min_num_tokens(text)
        if at_least >= max_len:
            raise ProtocolError(
                f"this model's maximum context length (max_model_len) is {max_len} tokens; the prompt's "
                f"{len(text)} characters are at least {at_least} tokens",
                param=req.prompt_param,
            )

    def work():
        if req.kind == "chat":
            try:
                messages, tools = template_conversation(
                    req.template_messages(), req.template_tools(), tok.supports_tools
                )
                check_length("".join(m["content"] for m in messages if isinstance(m.get("content"), str)))
                return [tok.encode_chat(messages, True, req.chat_template_kwargs, tools)]
            except ValueError as e:
                raise ProtocolError(str(e), param="messages") from None
        prompts = req.prompts(limits)
        for p in prompts:
            if isinstance(p, str):
                check_length(p)
        return [(p, tok.encode(p)) if isinstance(p, str) else (None, p) for p in prompts]

    items = await asyncio.to_thread(work)
    defaults = engine.default_sampling_params
    out = []
    for text, ids in items:
        try:
            engine.check_prompt(ids)
        except InvalidRequestError as e:
            raise ProtocolError(str(e), param=req.prompt_param) from None
        room = max_len - len(ids)
        requested = req.requested_max_tokens
        if requested is None:
            default = DEFAULT_COMPLETION_MAX_TOKENS if req.kind == "completion" else limits.max_tokens
            max_tokens = min(default, room)
        elif requested > room:
            raise ProtocolError(
                f"this model's maximum context length is {max_len} tokens; the prompt has "
                f"{len(ids)} tokens and {req.max_tokens_param} asks for {requested} more",
                param=req.max_tokens_param,
            )
        else:
            max_tokens = requested
        out.append(PreparedPrompt(text, list(ids), req.sampling_params(max_tokens, defaults), tok))
    return out


async def add_requests(
    engine: EngineClient, req: GenerationRequest, prompts: list, base_id: str, log_label: str | None = None
) -> list:
    """One engine request per prompt (ids ``base_id``, or ``base_id-i`` for several); their streams. On
    any failure every request added so far is aborted. ``log_label`` is added to their log lines."""
    streams = []
    try:
        for i, p in enumerate(prompts):
            rid = base_id if len(prompts) == 1 else f"{base_id}-{i}"
            prompt = {"prompt_token_ids": p.ids, "prompt": p.text}
            streams.append(await engine.add_request(prompt, p.params, rid, log_label=log_label))
    except BaseException as e:
        for s in streams:
            engine.abort(s.request_id)
        if isinstance(e, InvalidRequestError):
            if e.param == "prompt":
                raise ProtocolError(str(e), param=req.prompt_param) from None
            raise req.client_error(e) from None
        raise
    return streams


async def merge_streams(streams: list):
    """Yield ``(prompt_index, RequestOutput)`` from several streams as they come."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i, s):
        try:
            async for out in s:
                queue.put_nowait((i, out, None))
            queue.put_nowait((i, None, None))
        except Exception as e:  # noqa: BLE001
            queue.put_nowait((i, None, e))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            i, out, err = await queue.get()
            if err is not None:
                raise err
            if out is None:
                remaining -= 1
                continue
            yield i, out
    finally:
        for t in tasks:
            t.cancel()


def check_complete(streams: list) -> None:
    for s in streams:
        if not s.finished:
            raise EngineDeadError("the request was aborted by the server")


# ------------------------------------------------------------------------------------------ responses
class ResponseFormat(Protocol):
    """The shapes of one route's responses."""

    id_prefix: str

    def response(self, rid: str, created: int, model: str, choices: list, usage: dict) -> dict: ...

    def choice(self, req: GenerationRequest, index: int, prompt: PreparedPrompt, output: CompletionOutput) -> dict:
        """One choice of the full (non-streamed) response."""

    def chunk(
        self, rid: str, created: int, model: str, choices: list, usage: dict | None, include_usage: bool
    ) -> dict: ...

    def opening_choices(self, req: GenerationRequest, num_choices: int) -> list:
        """Chunk choices sent before any token (chat: the role of every choice)."""

    def chunk_choices(self, req: GenerationRequest, index: int, prompt: PreparedPrompt, delta: CompletionDelta) -> list:
        """The chunk choices of one delta (its new text and logprobs; then its finish_reason), each sent
        as a chunk of its own."""

    def logprobs(
        self, req: GenerationRequest, prompt: PreparedPrompt, token_ids: list, entries: list, text_offset: int
    ) -> dict | None:
        """This route's ``logprobs`` object for ``token_ids`` (None unless asked for)."""


async def serve_generation(request: web.Request, req: GenerationRequest, fmt: ResponseFormat) -> web.StreamResponse:
    """Run ``req`` on the engine and answer in ``fmt``'s shapes: JSON, or SSE with ``stream``. The
    engine requests are aborted when the handler ends (a no-op for finished ones; frees the blocks of a
    client that left)."""
    state = request.app[STATE]
    check_model(state, req.model)
    engine = require_engine(state)
    check_capacity(state, engine)  # before the tokenizer's work
    prompts = await prepare_prompts(engine, req, state.limits)
    check_capacity(state, engine, len(prompts))
    rid = response_builders.new_id(fmt.id_prefix)
    streams = await add_requests(engine, req, prompts, rid)
    headers = replica_header(streams)
    try:
        if req.stream:
            return await _stream_response(request, state, req, fmt, rid, prompts, streams, headers)
        response = await _full_response(state, req, fmt, rid, prompts, streams)
        response.headers.update(headers)
        return response
    finally:
        for s in streams:
            engine.abort(s.request_id)


async def _full_response(state: AppState, req, fmt: ResponseFormat, rid, prompts, streams) -> web.Response:
    final = {}
    async for i, out in merge_streams(streams):
        final[i] = out
    check_complete(streams)
    n = req.num_choices
    created = response_builders.now()

    def render() -> str:  # in a worker: n=8 x 512 tokens with 20 logprobs each is 5 MB of JSON
        choices, completion_tokens = [], 0
        for i, p in enumerate(prompts):
            for c in sorted(final[i].outputs, key=lambda c: c.index):
                completion_tokens += len(c.token_ids)
                choices.append(fmt.choice(req, i * n + c.index, p, c))
        usage = response_builders.usage(sum(len(p.ids) for p in prompts), completion_tokens)
        return dumps_by_part(fmt.response(rid, created, state.model_name, choices, usage), "choices")

    return web.Response(text=await asyncio.to_thread(render), content_type="application/json")


def dumps_by_part(obj: dict, key: str) -> str:
    """``json.dumps(obj)``, with each item of the list ``obj[key]`` encoded by its own call: the C encoder
    holds the GIL for a whole call (0.12 s for 5 MB), so in a worker thread this lets the event loop run
    between the items."""
    parts = []
    for k, v in obj.items():
        text = "[" + ", ".join(json.dumps(item) for item in v) + "]" if k == key else json.dumps(v)
        parts.append(f"{json.dumps(k)}: {text}")
    return "{" + ", ".join(parts) + "}"


def replica_header(streams: list) -> dict:
    """``X-Rawpaged-Replica``: the data-parallel replica(s) serving the request's prompts, comma-separated
    (none with a single engine)."""
    replicas = [str(s.replica) for s in streams if s.replica is not None]
    return {"X-Rawpaged-Replica": ",".join(dict.fromkeys(replicas))} if replicas else {}


async def _stream_response(request, state: AppState, req, fmt: ResponseFormat, rid, prompts, streams, headers):
    resp = web.StreamResponse(
        status=200,
        headers={
            "Content-Type": "text/event-stream",
            "Cache-Control": "no-cache",
            "X-Accel-Buffering": "no",
            **headers,
        },
    )
    await resp.prepare(request)
    created = response_builders.now()
    model = state.model_name
    n = req.num_choices

    async def send(obj) -> None:
        await resp.write(b"data: " + json.dumps(obj).encode() + b"\n\n")

    trackers = [DeltaTracker() for _ in prompts]
    completion_tokens = 0
    try:
        # One choice per chunk, as OpenAI streams n > 1 (clients read choices[0]).
        for choice in fmt.opening_choices(req, len(prompts) * n):
            await send(fmt.chunk(rid, created, model, [choice], None, req.include_usage))
        async for i, out in merge_streams(streams):
            for d in trackers[i].deltas(out):
                for choice in fmt.chunk_choices(req, i * n + d.index, prompts[i], d):
                    await send(fmt.chunk(rid, created, model, [choice], None, req.include_usage))
            if out.finished:
                completion_tokens += sum(len(c.token_ids) for c in out.outputs)
        check_complete(streams)
        if req.include_usage:
            usage = response_builders.usage(sum(len(p.ids) for p in prompts), completion_tokens)
            await send(fmt.chunk(rid, created, model, [], usage, True))
    except EngineError as e:  # ReplicaUnavailableError and ServerShuttingDownError are 503s
        error = error_body(str(e), e.type)
    except ConnectionError:
        return resp  # the client left; the caller aborts its requests
    else:
        error = None
    try:
        if error is not None:
            await send(error)
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
    except ConnectionError:
        pass
    return resp
