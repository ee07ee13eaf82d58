"""The engine's error types: requests it refuses, and requests it could not finish."""

from __future__ import annotations


class InvalidRequestError(ValueError):
    """A request (prompt or sampling parameter) the engine refuses.

    A ``ValueError``, so offline callers catch it as one; ``param`` names the offending field (the
    ``param`` of OpenAI's error body), or is None when no single field is at fault.
    """

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class EngineError(RuntimeError):
    """A request ended by a failure of the engine; the server answers ``status`` (500) with ``type``."""

    status = 500
    type = "internal_server_error"


class EngineDeadError(EngineError):
    """The engine loop failed or was shut down while the request was running."""


class ReplicaUnavailableError(EngineDeadError):
    """The data-parallel replica serving the request died, or none is ready (the server answers 503)."""

    status = 503
    type = "service_unavailable_error"


class ServerShuttingDownError(EngineDeadError):
    """The server stopped before the request finished: its shutdown timeout ran out (503)."""

    status = 503
    type = "service_unavailable_error"


class RequestFailedError(EngineError):
    """Computing this one request failed inside a step; the engine ended it alone and went on."""


class MissingDependencyError(InvalidRequestError):
    """A feature whose library is not installed on this host (the server answers 400; offline callers
    catch a ``ValueError``). The message names the package and how to install it."""
