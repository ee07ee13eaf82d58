"""Step 4 of a generation request, over HTTP: the engine's outputs (``engine_requests``' streams) answered in
a route's shapes (``output_json``), as one JSON response or, with ``stream``, as server-sent events
(``http.sse``) ending in ``data: [DONE]``."""

from __future__ import annotations

import asyncio
import json

from aiohttp import web

from rawpaged.engine.outputs import DeltaTracker
from rawpaged.entrypoints.generation.admission import served_model_name
from rawpaged.entrypoints.generation.output_json import ResponseFormat, now, usage
from rawpaged.entrypoints.http.sse import data_event, write_events
from rawpaged.entrypoints.server.state import AppState
from rawpaged.errors import EngineDeadError


async def write_response(
    request: web.Request, state: AppState, req, fmt: ResponseFormat, rid: str, prompts: list, streams: list
) -> web.StreamResponse:
    """The answer to ``req`` (a ``protocol.GenerationRequest``) whose ``prompts`` run as ``streams``: JSON,
    or SSE with ``req.stream``; ``X-Rawpaged-Replica`` names the data-parallel replicas that served it.
    Raises ``EngineError`` when the engine fails before a JSON answer (a stream reports it in an event)."""
    headers = replica_header(streams)
    if req.stream:
        return await _stream_response(request, state, req, fmt, rid, prompts, streams, headers)
    response = await _full_response(state, req, fmt, rid, prompts, streams)
    response.headers.update(headers)
    return response


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


async def last_output(stream):
    """The last ``RequestOutput`` of one request's ``stream``; an ``EngineDeadError`` when the stream
    ended before the request finished."""
    final = None
    async for out in stream:
        final = out
    check_complete([stream])
    return final


async def stream_deltas(stream):
    """Yield ``(RequestOutput, CompletionDelta)`` for each new piece of a request's ``stream``
    (``DeltaTracker``)."""
    tracker = DeltaTracker()
    async for out in stream:
        for d in tracker.deltas(out):
            yield out, d


def check_complete(streams: list) -> None:
    """An ``EngineDeadError`` when a stream ended before its request finished (the server aborted it)."""
    for s in streams:
        if not s.finished:
            raise EngineDeadError("the request was aborted by the server")


async def _full_response(state: AppState, req, fmt: ResponseFormat, rid, prompts, streams) -> web.Response:
    final = {}
    async for i, out in merge_streams(streams):
        final[i] = out
        prompts[i].prompt_logprobs = out.prompt_logprobs
    check_complete(streams)
    n = req.num_choices
    created = now()

    def render() -> str:  # in a worker: n=8 x 512 tokens with 20 logprobs each is 5 MB of JSON
        choices, completion_tokens = [], 0
        for i, p in enumerate(prompts):
            for c in sorted(final[i].outputs, key=lambda c: c.index):
                completion_tokens += 0 if req.echo_only else len(c.token_ids)
                choices.append(fmt.choice(req, i * n + c.index, p, c))
        totals = usage(sum(len(p.ids) for p in prompts), completion_tokens, cached_tokens(state, final.values()))
        model = served_model_name(state, req.model)
        response = fmt.response(rid, created, model, choices, totals, state.system_fingerprint)
        fmt.add_prompt_fields(req, response, prompts)
        return dumps_by_part(response, "choices")

    return web.Response(text=await asyncio.to_thread(render), content_type="application/json")


def cached_tokens(state: AppState, finals) -> int | None:
    """The prompt tokens served from the prefix cache over the requests' final outputs ``finals``, when
    usage reports them (``--enable-prompt-tokens-details``), else None."""
    if not state.server.enable_prompt_tokens_details:
        return None
    return sum(out.num_cached_tokens for out in finals)


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
    chunks = _chunks(state, req, fmt, rid, prompts, streams)
    return await write_events(request, chunks, done=True, headers=headers)


async def _chunks(state: AppState, req, fmt: ResponseFormat, rid, prompts, streams):
    """The stream's events (``sse.data_event``), one choice per chunk, as OpenAI streams n > 1 (clients
    read choices[0]); the usage chunk last with ``include_usage``."""
    created = now()
    model = served_model_name(state, req.model)
    n = req.num_choices
    trackers = [DeltaTracker() for _ in prompts]
    completion_tokens, finals, fingerprint = 0, {}, state.system_fingerprint
    generated = [0] * (len(prompts) * n)  # tokens sent per choice (vLLM's continuous_usage_stats)

    def chunk(choice: dict) -> dict:
        """One choice's chunk; with ``continuous_usage_stats``, the running usage of that choice."""
        index = choice["index"]
        running = usage(len(prompts[index // n].ids), generated[index]) if req.include_continuous_usage else None
        return fmt.chunk(rid, created, model, [choice], running, req.include_usage, fingerprint)

    for opening in fmt.opening_chunks(req, prompts, chunk):
        yield data_event(opening)
    async for i, out in merge_streams(streams):
        prompts[i].prompt_logprobs = out.prompt_logprobs
        for d in trackers[i].deltas(out):
            if not req.echo_only:
                generated[i * n + d.index] += len(d.token_ids)
            for choice in fmt.chunk_choices(req, i * n + d.index, prompts[i], d):
                yield data_event(chunk(choice))
        if out.finished:
            finals[i] = out
            if not req.echo_only:
                completion_tokens += sum(len(c.token_ids) for c in out.outputs)
    check_complete(streams)
    if req.include_usage:
        totals = usage(sum(len(p.ids) for p in prompts), completion_tokens, cached_tokens(state, finals.values()))
        yield data_event(fmt.chunk(rid, created, model, [], totals, True, fingerprint))
