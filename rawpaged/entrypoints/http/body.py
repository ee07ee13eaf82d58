"""A POST route's request body, within ``--max-body-size`` (413) and ``--timeout-body`` (408)."""

from __future__ import annotations

import asyncio
import logging

from aiohttp import web

from rawpaged.entrypoints.http.errors import ProtocolError
from rawpaged.entrypoints.http.json_reply import error_response
from rawpaged.entrypoints.server.state import STATE, AppState

logger = logging.getLogger("rawpaged.server")


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
