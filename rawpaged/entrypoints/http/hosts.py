"""The ``Host`` check against DNS rebinding: a page on ``evil.example`` whose name resolves to 127.0.0.1
can make the browser send requests to a server on loopback with ``Host: evil.example`` (same origin to the
browser, so no CORS check applies). A server listening on a loopback address therefore answers only
requests for loopback names and addresses, and the names given with ``--allowed-hosts``: others get a 403
(ollama's fix for CVE-2024-28224). A server listening on another address takes any host."""

from __future__ import annotations

import ipaddress

from aiohttp import web

#: names that always mean this machine (RFC 6761 reserves ``localhost`` and its subdomains)
LOOPBACK_NAMES = frozenset({"localhost", "localhost.localdomain"})


def _is_loopback(name: str) -> bool:
    if name in LOOPBACK_NAMES or name.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def allowed_names(bind_host: str, extra=()) -> frozenset | None:
    """The Host names to accept when listening on ``bind_host``: None (any) unless it is a loopback
    address or name; then loopback names, loopback addresses (checked per request) and ``extra``."""
    if not _is_loopback(bind_host.strip("[]").lower()):
        return None
    return frozenset(h.lower() for h in extra)


def host_name(header: str) -> str:
    """The name of a ``Host`` header without its port (an IPv6 address without its brackets)."""
    header = header.strip().lower()
    if header.startswith("["):
        return header[1:].split("]", 1)[0]
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


def refused_host(allowed: frozenset | None, request: web.Request) -> str | None:
    """The ``Host`` a request names when this server does not answer for it (None: answer it). A request
    without the header (HTTP/1.0) is answered."""
    if allowed is None:
        return None
    header = request.headers.get("Host")
    if not header:
        return None
    name = host_name(header)
    if _is_loopback(name) or name in allowed:
        return None
    return header
