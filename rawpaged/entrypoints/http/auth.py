"""The API key (``--api-key``): a request carries it as ``Authorization: Bearer <key>``; a browser's
websocket, which cannot set the header, sends it in an ``auth`` message instead (``websocket``)."""

from __future__ import annotations

import hmac

from rawpaged.entrypoints.http.errors import ProtocolError


def authorization_matches(api_key: str, header: str | None) -> bool:
    """Whether an ``Authorization`` header value is ``Bearer <api_key>`` (compared in constant time)."""
    given = header[7:].strip() if header and header[:7].lower() == "bearer " else ""
    return hmac.compare_digest(given.encode(), api_key.encode())


def unauthorized() -> ProtocolError:
    """The 401 for a missing or wrong API key."""
    return ProtocolError(
        "invalid or missing API key (Authorization: Bearer <key>)",
        status=401,
        type="authentication_error",
        code="invalid_api_key",
    )
