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
