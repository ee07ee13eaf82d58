"""Server-sent events, the one writer every streamed HTTP answer uses (chat, completions, Responses): the
``data:`` and ``event:`` lines of one event, chat's closing ``data: [DONE]``, an engine failure as the
stream's last event, and a client that left (the stream just ends; the caller aborts its requests)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable

from aiohttp import web

from rawpaged.entrypoints.http.errors import error_body
from rawpaged.errors import EngineError

HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
#: the end of an OpenAI chat or completions stream
DONE = b"data: [DONE]\n\n"


def data_event(obj) -> bytes:
    """One event of ``data`` only: ``data: <json>`` and a blank line (chat and completions chunks)."""
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def typed_event(obj: dict) -> bytes:
    """One event named by ``obj["type"]``: ``event: <type>``, ``data: <json>`` and a blank line (the
    Responses API's events)."""
    return f"event: {obj['type']}\ndata: {json.dumps(obj)}\n\n".encode()


def error_data_event(e: EngineError) -> bytes:
    """An engine failure as chat's and completions' last chunk: the OpenAI error body as ``data``."""
    return data_event(error_body(str(e), e.type))


async def write_events(
    request: web.Request,
    events: AsyncIterator[bytes],
    error_event: Callable[[EngineError], bytes] = error_data_event,
    done: bool = False,
    headers: dict | None = None,
) -> web.StreamResponse:
    """Answer ``request`` with a 200 ``text/event-stream`` (``headers`` added) carrying ``events`` (each an
    encoded event: ``data_event``, ``typed_event``) as they come. An ``EngineError`` raised by ``events``
    ends the stream with ``error_event(e)``; ``done``: ``DONE`` closes it (after the error too). A client
    that disconnects (``ConnectionError``) ends the writing quietly."""
    resp = web.StreamResponse(status=200, headers={**HEADERS, **(headers or {})})
    await resp.prepare(request)
    closing = []
    try:
        async for event in events:
            await resp.write(event)
    except EngineError as e:  # ReplicaUnavailableError and ServerShuttingDownError are 503s
        closing.append(error_event(e))
    except ConnectionError:
        return resp
    if done:
        closing.append(DONE)
    try:
        for event in closing:
            await resp.write(event)
        await resp.write_eof()
    except ConnectionError:
        pass
    return resp
