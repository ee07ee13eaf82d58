"""JSON responses of the routes and the middleware: a body, or an OpenAI error body counted in the
metrics (rewritten in Anthropic's shape on its routes: ``as_anthropic_error``)."""

from __future__ import annotations

import json

from aiohttp import web

from rawpaged.entrypoints.http.errors import ANTHROPIC_STATUS, anthropic_error_body, anthropic_error_type, error_body
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


def as_anthropic_error(response: web.Response) -> None:
    """Rewrite an error ``response`` that is not yet sent, in place (its headers and connection kept), in
    Anthropic's shape: its status as Anthropic's (``ANTHROPIC_STATUS``: 503 -> 529) and the body
    ``{"type": "error", "error": {"type", "message"}}``, the type by that status. A body that is not an
    OpenAI error body (not JSON) keeps its text as the message."""
    status = ANTHROPIC_STATUS.get(response.status, response.status)
    if status != response.status:
        response.set_status(status, "Overloaded" if status == 529 else None)
    message = response.text or response.reason or ""
    try:
        message = json.loads(message)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        pass
    response.text = json.dumps(anthropic_error_body(message, anthropic_error_type(status)))
    response.content_type = "application/json"
