"""Open connections, bounded: ``ConnectionGate`` wraps the aiohttp server's protocol factory.

Past ``max_connections``, a new connection first takes the place of the connection idle longest (one
with no request in progress: an idle keep-alive socket, or one that never completed its headers), which
is closed. When every connection is busy, the new one is answered by ``Refusal``: ``GET /health`` gets the
server's health, anything else an HTTP 503 with ``Retry-After``, then it is closed; nothing of it reaches
the application. So idle and slow sockets cannot take the server's file descriptors, and ``/health``
answers at the limit. (uvicorn's ``--limit-concurrency`` answers 503 past its limit too.)
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable

logger = logging.getLogger("rawpaged.server")

#: bytes a refused connection may send before it is answered (its request line is all that is read)
REFUSAL_READ_LIMIT = 8192
#: seconds a refused connection gets to send its request line
REFUSAL_TIMEOUT_S = 2.0


class ConnectionGate:
    """Counts the server's connections and the requests running on each.

    Args:
        max_connections: open connections at most.
        health: ``() -> (status, body dict)`` for ``GET /health`` on a refused connection.

    The server's request middleware calls ``begin(request)``/``end(request)`` around each request (a
    websocket's handler runs for the socket's life, so an open websocket is busy).
    """

    def __init__(self, max_connections: int, health: Callable[[], tuple]):
        self.max_connections = max_connections
        self.health = health
        self.num_refused = 0
        self.num_evicted = 0
        self._busy: dict = {}  # RequestHandler -> requests in progress
        # RequestHandler -> when its last request ended (or it was accepted): every connection let in and
        # not yet lost. (aiohttp's ``server.connections`` lists a connection only once its
        # ``connection_made`` has run, after the accept loop: a burst of accepts would not be counted.)
        self._open: dict = {}

    def factory(self, server) -> Callable[[], asyncio.Protocol]:
        """The protocol factory to listen with, in place of aiohttp's ``server``."""

        def make():
            if self.num_open() >= self.max_connections and not self._evict_one():
                self.num_refused += 1
                return Refusal(self.health)
            handler = server()
            self._open[handler] = time.monotonic()
            return _Counted(self, handler)

        return make

    def num_open(self) -> int:
        """Connections let in and not yet closed (or being closed by an eviction)."""
        return len(self._open)

    def num_busy(self) -> int:
        """Connections with a request in progress (an open websocket counts)."""
        return len(self._busy)

    def _lost(self, handler) -> None:
        self._open.pop(handler, None)
        self._busy.pop(handler, None)

    def begin(self, request) -> None:
        handler = request.protocol
        self._busy[handler] = self._busy.get(handler, 0) + 1

    def end(self, request) -> None:
        handler = request.protocol
        n = self._busy.get(handler, 1) - 1
        if n > 0:
            self._busy[handler] = n
            return
        self._busy.pop(handler, None)
        if handler in self._open:
            self._open[handler] = time.monotonic()

    def _evict_one(self) -> bool:
        idle = [(since, id(h), h) for h, since in self._open.items() if h not in self._busy and h.transport]
        if not idle:
            return False
        _, _, handler = min(idle)
        del self._open[handler]
        handler.force_close()
        self.num_evicted += 1
        return True


class _Counted(asyncio.Protocol):
    """aiohttp's connection protocol, passed through, telling the gate when the connection is lost."""

    __slots__ = ("_gate", "_handler")

    def __init__(self, gate: ConnectionGate, handler):
        self._gate = gate
        self._handler = handler

    def connection_made(self, transport) -> None:
        self._handler.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        self._handler.data_received(data)

    def eof_received(self):
        return self._handler.eof_received()

    def pause_writing(self) -> None:
        self._handler.pause_writing()

    def resume_writing(self) -> None:
        self._handler.resume_writing()

    def connection_lost(self, exc) -> None:
        self._gate._lost(self._handler)
        self._handler.connection_lost(exc)


class Refusal(asyncio.Protocol):
    """A connection over the limit: its request line is read; ``GET /health`` is answered with the
    server's health, anything else with a 503; then the connection is closed."""

    def __init__(self, health: Callable[[], tuple]):
        self._health = health
        self._buffer = b""
        self._transport = None
        self._timer = None

    def connection_made(self, transport) -> None:
        self._transport = transport
        self._timer = asyncio.get_running_loop().call_later(REFUSAL_TIMEOUT_S, transport.close)

    def data_received(self, data: bytes) -> None:
        self._buffer += data
        if b"\n" not in self._buffer and len(self._buffer) < REFUSAL_READ_LIMIT:
            return
        line = self._buffer.split(b"\n", 1)[0].split()
        if len(line) >= 2 and line[0] == b"GET" and line[1].split(b"?")[0] == b"/health":
            status, body = self._health()
            headers = {}
        else:
            status = 503
            body = {
                "error": {
                    "message": "the server has too many open connections; retry shortly",
                    "type": "service_unavailable_error",
                    "param": None,
                    "code": None,
                }
            }
            headers = {"Retry-After": "1"}
        self._respond(status, body, headers)

    def _respond(self, status: int, body: dict, headers: dict) -> None:
        payload = json.dumps(body).encode()
        reason = {200: "OK", 503: "Service Unavailable"}.get(status, "Error")
        head = [f"HTTP/1.1 {status} {reason}", "Content-Type: application/json", f"Content-Length: {len(payload)}"]
        head += [f"{k}: {v}" for k, v in headers.items()] + ["Connection: close", "", ""]
        self._transport.write("\r\n".join(head).encode() + payload)
        self._transport.close()
        self._timer.cancel()

    def connection_lost(self, exc) -> None:
        if self._timer is not None:
            self._timer.cancel()
