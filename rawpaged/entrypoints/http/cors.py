"""Cross-origin requests (CORS, https://fetch.spec.whatwg.org/#http-cors-protocol) for browser clients of
the origins given by ``--allowed-origins`` (``*`` for any); with none given, no CORS headers at all.

A preflight (``OPTIONS`` with ``Access-Control-Request-Method``) from an allowed origin is answered 204
before authentication (browsers send it without credentials); every other response to an allowed origin
carries ``Access-Control-Allow-Origin``, set as the response is prepared so streams have it too.

CORS only stops a page from reading a response: a browser still sends a "simple" cross-origin POST, and it
opens websockets to any origin. So a request whose ``Origin`` is neither the server's own nor allowed is
refused (403) before it runs: a page elsewhere cannot make the server generate (CSRF) or drive ``/v1/ws``.
Clients that are not browsers send no ``Origin`` and are not affected.
"""

from __future__ import annotations

from urllib.parse import urlsplit

from aiohttp import web

ALLOWED_METHODS = "GET, POST, OPTIONS"
ALLOWED_HEADERS = "Authorization, Content-Type"
PREFLIGHT_MAX_AGE = "600"


def allowed_origin(allowed: tuple, origin: str | None) -> str | None:
    """The ``Access-Control-Allow-Origin`` value for a request from ``origin``, or None."""
    if not origin or not allowed:
        return None
    if "*" in allowed:
        return "*"
    return origin if origin in allowed else None


def refused_origin(allowed: tuple, request: web.Request) -> str | None:
    """The request's ``Origin`` when it is set and neither the server's own (same host and port) nor
    allowed; else None."""
    origin = request.headers.get("Origin")
    if origin is None or allowed_origin(allowed, origin) is not None:
        return None
    return None if urlsplit(origin).netloc == request.host else origin


def preflight_response(allowed: tuple, request: web.Request) -> web.Response | None:
    """The answer to a CORS preflight from an allowed origin; None for any other request."""
    if request.method != "OPTIONS" or "Access-Control-Request-Method" not in request.headers:
        return None
    origin = allowed_origin(allowed, request.headers.get("Origin"))
    if origin is None:
        return None
    return web.Response(
        status=204,
        headers={
            "Access-Control-Allow-Origin": origin,
            "Access-Control-Allow-Methods": ALLOWED_METHODS,
            "Access-Control-Allow-Headers": request.headers.get("Access-Control-Request-Headers", ALLOWED_HEADERS),
            "Access-Control-Max-Age": PREFLIGHT_MAX_AGE,
            "Vary": "Origin",
        },
    )


def add_cors_headers(allowed: tuple, request: web.Request, response: web.StreamResponse) -> None:
    """Mark ``response`` readable by the request's origin when that origin is allowed."""
    if not allowed:
        return
    response.headers["Vary"] = "Origin"  # the answer depends on the origin: caches must not mix them
    origin = allowed_origin(allowed, request.headers.get("Origin"))
    if origin is not None and "Access-Control-Allow-Origin" not in response.headers:
        response.headers["Access-Control-Allow-Origin"] = origin
