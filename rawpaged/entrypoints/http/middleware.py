"""What every request goes through before and after its route: the request middleware and the
response-prepare hook of the app (``app.create_app``).

Before the route: the connection gate counts it; a ``Host`` this server does not answer for (``hosts``), a
refused ``Origin`` (``cors``), a drain in progress and a missing API key (``auth``) are refused; a CORS
preflight is answered. After: a ``ProtocolError``, an ``EngineError`` or aiohttp's own HTTP errors become
OpenAI error bodies (Anthropic's on its routes: ``errors.is_anthropic_path``), anything else a 500, and each
refusal gets one log line.
"""

from __future__ import annotations

import asyncio
import json
import logging

from aiohttp import web

from rawpaged.entrypoints.http import cors, hosts, playground
from rawpaged.entrypoints.http.auth import headers_carry_key, unauthorized
from rawpaged.entrypoints.http.errors import ProtocolError, is_anthropic_path
from rawpaged.entrypoints.http.json_reply import as_anthropic_error, error_response
from rawpaged.entrypoints.server.state import STATE, AppState
from rawpaged.errors import EngineError

logger = logging.getLogger("rawpaged.server")

OPEN_PATHS = ("/health", "/metrics", "/")
#: answered while the server drains on shutdown (everything else gets 503)
DRAINING_PATHS = ("/health", "/metrics")
#: a websocket handshake there checks the key itself: a browser cannot send the header, so the socket may
#: authenticate by message
SELF_AUTHENTICATED_PATHS = ("/v1/ws",)


@web.middleware
async def request_middleware(request: web.Request, handler) -> web.StreamResponse:
    """Counts the request on its connection, runs it (``_handle``) and logs a refusal."""
    state = request.app[STATE]
    state.gate.begin(request)
    try:
        response = await _handle(state, request, handler)
    finally:
        state.gate.end(request)
    if response.status >= 400 and isinstance(response, web.Response) and is_anthropic_path(request.path):
        as_anthropic_error(response)
    if response.status >= 400 and not (state.draining and response.status == 503):
        _log_refusal(request, response)
    return response


async def add_cors_headers(request: web.Request, response: web.StreamResponse) -> None:
    """The app's ``on_response_prepare`` hook: CORS headers for an allowed origin (streams included)."""
    cors.add_cors_headers(request.app[STATE].allowed_origins, request, response)


async def _handle(state: AppState, request: web.Request, handler) -> web.StreamResponse:
    refusal = _refusal(state, request)
    if refusal is not None:
        return refusal
    try:
        return await handler(request)
    except ProtocolError as e:
        resp = error_response(state, e.status, e.message, e.type, e.param, e.code)
        resp.headers.update(e.headers)
        if e.close:
            resp.force_close()
        return resp
    except EngineError as e:  # ReplicaUnavailableError and ServerShuttingDownError are 503s
        return error_response(state, e.status, str(e), e.type)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        return _http_error(state, e)
    except (asyncio.CancelledError, ConnectionError):
        raise
    except Exception:  # noqa: BLE001
        logger.exception("unhandled error on %s %s", request.method, request.path)
        return error_response(state, 500, "internal server error", "internal_server_error")


def _refusal(state: AppState, request: web.Request) -> web.Response | None:
    """The answer to a request that does not reach its route (or a CORS preflight's), else None."""
    host = hosts.refused_host(state.allowed_host_names, request)
    if host is not None:
        return error_response(
            state,
            403,
            f"requests for host {host!r} are not allowed: this server listens on a loopback address "
            "(--allowed-hosts adds names)",
            type="permission_error",
            param="Host",
        )
    preflight = cors.preflight_response(state.allowed_origins, request)
    if preflight is not None:
        return preflight
    origin = cors.refused_origin(state.allowed_origins, request)
    if origin is not None:
        return error_response(
            state,
            403,
            f"requests from origin {origin!r} are not allowed (--allowed-origins)",
            type="permission_error",
            param="Origin",
        )
    if state.draining and request.path not in DRAINING_PATHS:
        resp = error_response(state, 503, "the server is shutting down", "service_unavailable_error")
        resp.headers["Retry-After"] = "5"
        resp.force_close()
        return resp
    if _needs_key(state, request) and not headers_carry_key(state.api_key, request.headers):
        e = unauthorized()
        return error_response(state, e.status, e.message, e.type, code=e.code)
    return None


def _needs_key(state: AppState, request: web.Request) -> bool:
    """Whether the request must carry the API key (``Authorization`` or ``x-api-key``: ``auth``)."""
    return bool(
        state.api_key
        and request.path not in OPEN_PATHS
        and not (request.path in SELF_AUTHENTICATED_PATHS and request.headers.get("Upgrade", "").lower() == "websocket")
        and not playground.is_static_path(request.path)
    )


def _http_error(state: AppState, e: web.HTTPException) -> web.Response:
    """aiohttp's 4xx/5xx (no route: 404, a wrong method: 405) as an OpenAI error body."""
    kind = {404: "not_found_error"}.get(e.status, "invalid_request_error")
    resp = error_response(state, e.status, e.reason if e.text is None else e.text.removeprefix(f"{e.status}: "), kind)
    if "Allow" in e.headers:  # a 405 names the methods the route takes (RFC 9110, 15.5.6)
        resp.headers["Allow"] = e.headers["Allow"]
    return resp


def _log_refusal(request: web.Request, response: web.StreamResponse) -> None:
    """One line per refused request (the request log has lines only for requests that ran); none for
    ``/health``, whose 503 while loading or draining is its answer, polled."""
    if request.rel_url.path == "/health":
        return
    message = ""
    if isinstance(response, web.Response) and response.content_type == "application/json" and response.text:
        try:
            message = json.loads(response.text).get("error", {}).get("message", "")
        except (ValueError, AttributeError):
            pass
    detail = f" {message[:300]}" if message else ""
    logger.info("%s %s -> %d%s", request.method, request.rel_url.path, response.status, detail)
