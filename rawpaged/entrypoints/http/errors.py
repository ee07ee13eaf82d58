"""A request the server refuses: :class:`ProtocolError` (the HTTP status and OpenAI's error body), raised by
every route and the websocket, and answered by the middleware (``middleware``) or as a websocket ``error``.
Knows JSON shapes, not aiohttp."""

from __future__ import annotations


class ProtocolError(Exception):
    """A request the server refuses; ``status`` and ``body()`` are what the client gets."""

    def __init__(
        self,
        message: str,
        param: str | None = None,
        status: int = 400,
        type: str = "invalid_request_error",
        code: str | None = None,
        headers: dict | None = None,
        close: bool = False,
    ):
        super().__init__(message)
        self.message = message
        self.param = param
        self.status = status
        self.type = type
        self.code = code
        self.headers = headers or {}  # e.g. Retry-After
        self.close = close  # close the connection after the response (a body that never arrived)

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(
    message: str, type: str = "invalid_request_error", param: str | None = None, code: str | None = None
) -> dict:
    """OpenAI's error body: ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def field_error(e: ValueError) -> ProtocolError:
    """A 400 for a ``ValueError`` whose message starts with the field it names (``"start must be ..."``,
    as the KV cache snapshot's checks word them)."""
    message = str(e)
    return ProtocolError(message, param=message.split(" ", 1)[0])


#: the routes that answer errors in Anthropic's shape (the Messages API: ``anthropic``)
ANTHROPIC_PATH_PREFIX = "/v1/messages"
#: HTTP status -> Anthropic's error ``type``; any other 4xx is ``invalid_request_error``, 5xx ``api_error``
ANTHROPIC_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    408: "timeout_error",
    413: "request_too_large",
    429: "rate_limit_error",
    504: "timeout_error",
    529: "overloaded_error",
}
#: the status a refusal answers with on an Anthropic route: a busy or loading server (503 elsewhere) is
#: Anthropic's 529 ``overloaded_error``, which its clients retry
ANTHROPIC_STATUS = {503: 529}


def is_anthropic_path(path: str) -> bool:
    """Whether ``path`` is one of the routes whose errors take Anthropic's shape."""
    return path == ANTHROPIC_PATH_PREFIX or path.startswith(ANTHROPIC_PATH_PREFIX + "/")


def anthropic_error_type(status: int) -> str:
    """Anthropic's error ``type`` for an HTTP ``status`` (``ANTHROPIC_ERROR_TYPES``)."""
    return ANTHROPIC_ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")


def anthropic_error_body(message: str, type: str = "invalid_request_error") -> dict:
    """Anthropic's error body: ``{"type": "error", "error": {"type", "message"}}``."""
    return {"type": "error", "error": {"type": type, "message": message}}
