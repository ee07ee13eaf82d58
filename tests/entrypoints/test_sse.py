"""The one server-sent-events writer (``http.sse``): the exact bytes of ``data:`` and ``event:`` events,
chat's ``[DONE]``, an engine failure as the last event, and a client that leaves mid-stream."""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("aiohttp")  # absent on some hosts (the GPU host has no package index)

import aiohttp
from aiohttp import web
from aiohttp.test_utils import TestServer

from rawpaged.entrypoints.http.sse import DONE, data_event, typed_event, write_events
from rawpaged.errors import EngineError, ReplicaUnavailableError


def test_event_bytes():
    assert data_event({"a": 1, "b": "é"}) == b'data: {"a": 1, "b": "\\u00e9"}\n\n'
    assert typed_event({"type": "response.created", "n": 0}) == (
        b'event: response.created\ndata: {"type": "response.created", "n": 0}\n\n'
    )
    assert DONE == b"data: [DONE]\n\n"


async def _body_of(events, **kwargs) -> tuple:
    """The status, headers and raw body a client reads from ``write_events(request, events(), ...)``."""

    async def handler(request):
        return await write_events(request, events(), **kwargs)

    app = web.Application()
    app.router.add_get("/", handler)
    async with TestServer(app) as server, aiohttp.ClientSession() as s, s.get(server.make_url("/")) as r:
        return r.status, r.headers, await r.read()


async def _two_then(error=None):
    yield data_event({"i": 0})
    yield data_event({"i": 1})
    if error is not None:
        raise error


def test_a_stream_of_data_events_ends_with_done():
    status, headers, body = asyncio.run(_body_of(_two_then, done=True, headers={"X-Rawpaged-Replica": "1"}))
    assert status == 200 and headers["Content-Type"] == "text/event-stream"
    assert headers["Cache-Control"] == "no-cache" and headers["X-Rawpaged-Replica"] == "1"
    assert body == b'data: {"i": 0}\n\ndata: {"i": 1}\n\ndata: [DONE]\n\n'


def test_an_engine_failure_is_the_last_event_before_done():
    _, _, body = asyncio.run(_body_of(lambda: _two_then(ReplicaUnavailableError("gone")), done=True))
    error = b'{"error": {"message": "gone", "type": "service_unavailable_error", "param": null, "code": null}}'
    assert body == b'data: {"i": 0}\n\ndata: {"i": 1}\n\ndata: ' + error + b"\n\ndata: [DONE]\n\n"


def test_a_typed_stream_has_its_own_error_event_and_no_done():
    def error_event(e):
        return typed_event({"type": "error", "message": str(e)})

    _, _, body = asyncio.run(_body_of(lambda: _two_then(EngineError("boom")), error_event=error_event))
    assert body.endswith(b'data: {"i": 1}\n\nevent: error\ndata: {"type": "error", "message": "boom"}\n\n')
    assert b"[DONE]" not in body


def test_a_client_that_leaves_ends_the_writing_quietly():
    """A write that finds the client gone (aiohttp's ``ConnectionError``) ends the stream: no error event,
    no ``[DONE]``, and the handler returns rather than raising."""

    async def left():
        yield data_event({"i": 0})
        raise ConnectionResetError("the client went away")

    status, _, body = asyncio.run(_body_of(left, done=True))
    assert status == 200 and body == b'data: {"i": 0}\n\n'
