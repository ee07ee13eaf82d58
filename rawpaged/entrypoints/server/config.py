"""How the server treats its clients: timeouts, connection and queue limits, shutdown, hosts
(``ServerConfig``), and the limits a request body is parsed under (``Limits``). Each ``ServerConfig``
field's docstring is also its ``--help`` text (``rawpaged.entrypoints.cli`` builds one option per field, as
for ``EngineConfig``); docs/server.md, "Timeouts and limits", says what each does and why its default."""

from __future__ import annotations

import resource
from dataclasses import dataclass

#: bytes of a request body at most (``--max-body-size``)
DEFAULT_MAX_BODY_SIZE = 4 << 20
#: ``max_tokens`` a request may ask for at most (``--max-tokens-limit``); None: what the context leaves
DEFAULT_MAX_TOKENS_LIMIT = None
#: connections at most, whatever the open-file limit allows
MAX_CONNECTIONS_CAP = 4096
#: prompts in one ``/v1/completions`` request at most
MAX_PROMPTS = 64


def default_max_connections() -> int:
    """Half the process's open-file limit (the rest for the model's files, logs and the engine), at
    least 64 and at most ``MAX_CONNECTIONS_CAP``."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return MAX_CONNECTIONS_CAP
    return max(64, min(MAX_CONNECTIONS_CAP, soft // 2))


@dataclass
class ServerConfig:
    """The server's limits. Raises ValueError naming the field for an invalid value."""

    timeout_keep_alive: float = 5.0
    """seconds a connection may sit without a complete request: idle between requests, or still sending
    its headers (uvicorn's default); then it is closed"""
    timeout_body: float = 30.0
    """seconds a request body may take to arrive once its headers have; then HTTP 408 and the connection
    is closed"""
    max_connections: int | None = None
    """open connections at most (default: half the open-file limit, at most 4096); past it the connection
    idle longest is closed for a new one, and when none is idle a new connection gets HTTP 503 (GET
    /health is still answered)"""
    max_queued_requests: int = 256
    """requests that may wait for a place in the batch (beyond max_num_seqs running); past it new
    requests get HTTP 503 with Retry-After"""
    ws_ping_interval: float = 20.0
    """seconds between websocket pings; a socket whose pong does not come within half of it is closed"""
    ws_idle_timeout: float = 300.0
    """seconds a websocket with no request or subscription running may go without a message; then it is
    closed"""
    shutdown_timeout: float = 30.0
    """on SIGTERM/SIGINT: seconds requests in flight may take to finish (new ones get 503, /health says
    draining); then each is ended with an error the client can read"""
    allowed_hosts: tuple = ()
    """Host header names accepted besides loopback names when the server listens on a loopback address
    (others get HTTP 403: DNS rebinding); any host when it listens on another address"""
    reject_unknown_fields: bool = False
    """answer HTTP 400 for request fields the API does not define (default: log them and go on, as vLLM)"""
    enable_prompt_tokens_details: bool = False
    """chat and completions usage gains prompt_tokens_details.cached_tokens: the prompt tokens served from
    the prefix cache (vLLM's flag; the Responses API always reports them)"""

    def __post_init__(self):
        for name in ("timeout_keep_alive", "timeout_body", "ws_ping_interval", "ws_idle_timeout"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0 seconds, got {getattr(self, name)}")
        if not self.shutdown_timeout >= 0:
            raise ValueError(f"shutdown_timeout must be >= 0 seconds, got {self.shutdown_timeout}")
        if self.max_connections is None:
            self.max_connections = default_max_connections()
        if self.max_connections < 1:
            raise ValueError(f"max_connections must be >= 1, got {self.max_connections}")
        if self.max_queued_requests < 0:
            raise ValueError(f"max_queued_requests must be >= 0, got {self.max_queued_requests}")
        self.allowed_hosts = tuple(h.lower() for h in self.allowed_hosts or ())


@dataclass
class Limits:
    """Server-side limits applied while parsing a request (``rawpaged.entrypoints.generation.protocol``)."""

    max_tokens: int | None = None  # a request asking for more generated tokens gets a 400 (None: no cap)
    max_n: int = 16  # n and best_of at most
    max_prompts: int = MAX_PROMPTS  # prompts per /v1/completions request at most
    reject_unknown_fields: bool = False  # a field the API does not define: a 400 (else logged, ignored)
