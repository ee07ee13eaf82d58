"""The API key (``--api-key``): a request carries it as ``Authorization: Bearer <key>`` or, as Anthropic's
clients send it, ``x-api-key: <key>``; a browser's websocket, which cannot set a header, sends it in an
``auth`` message instead (``websocket``)."""

from __future__ import annotations

import hmac

from rawpaged.entrypoints.http.errors import ProtocolError


def authorization_matches(api_key: str, header: str | None) -> bool:
    """Whether an ``Authorization`` header value is ``Bearer <api_key>`` (compared in constant time)."""
    given = header[7:].strip() if header and header[:7].lower() == "bearer " else ""
    return hmac.compare_digest(given.encode(), api_key.encode())


def headers_carry_key(api_key: str, headers) -> bool:
    """Whether request ``headers`` carry ``api_key``: as ``Authorization: Bearer <key>`` or ``x-api-key``."""
    if authorization_matches(api_key, headers.get("Authorization")):
        return True
    given = headers.get("x-api-key", "").strip()
    return bool(given) and hmac.compare_digest(given.encode(), api_key.encode())


def unauthorized() -> ProtocolError:
    """The 401 for a missing or wrong API key."""
    return ProtocolError(
        "invalid or missing API key (Authorization: Bearer <key>, or x-api-key: <key>)",
        status=401,
        type="authentication_error",
        code="invalid_api_key",
    )
