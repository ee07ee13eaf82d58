"""JSON responses of the routes and the middleware: a body, or an OpenAI error body counted in the
metrics."""

from __future__ import annotations

import json

from aiohttp import web

from rawpaged.entrypoints.http.errors import error_body
from rawpaged.entrypoints.server.state import AppState


def json_response(obj, status: int = 200) -> web.Response:
    """``obj`` as a JSON body (``application/json``) with ``status``."""
    return web.Response(text=json.dumps(obj), status=status, content_type="application/json")


def error_response(
    state: AppState,
    status: int,
    message: str,
    type: str = "invalid_request_error",
    param: str | None = None,
    code: str | None = None,
) -> web.Response:
    """An OpenAI error body with ``status``, counted in the metrics."""
    state.metrics.count_error(status)
    return json_response(error_body(message, type, param, code), status=status)
