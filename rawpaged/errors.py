"""The one error type for requests the engine refuses."""

from __future__ import annotations


class InvalidRequestError(ValueError):
    """A request (prompt or sampling parameter) the engine refuses.

    A ``ValueError``, so offline callers catch it as one; ``param`` names the offending field (the
    ``param`` of OpenAI's error body), or is None when no single field is at fault.
    """

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param
