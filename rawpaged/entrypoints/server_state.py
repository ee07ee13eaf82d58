"""What every route reads: the server's state (engine, limits, metrics, names) and the small helpers
around it (JSON and error responses, the model and engine checks)."""

from __future__ import annotations

import asyncio
import hmac
import json
from collections.abc import Callable
from dataclasses import dataclass, field

from aiohttp import web

from rawpaged.engine.engine_client import EngineClient
from rawpaged.entrypoints.http_errors import ProtocolError, error_body
from rawpaged.entrypoints.metrics import ServerMetrics
from rawpaged.entrypoints.openai.response_builders import now
from rawpaged.entrypoints.server_config import DEFAULT_MAX_BODY_SIZE, Limits, ServerConfig


@dataclass
class ServerState:
    model_name: str
    model_aliases: set
    loader: Callable | None
    api_key: str | None = None
    limits: Limits = field(default_factory=Limits)
    max_body_size: int = DEFAULT_MAX_BODY_SIZE
    allowed_origins: tuple = ()
    engine: EngineClient | None = None
    owns_engine: bool = True
    load_error: str | None = None
    failed: asyncio.Event | None = None
    metrics: ServerMetrics = field(default_factory=ServerMetrics)
    created: int = field(default_factory=now)
    load_started: float = 0.0
    server: ServerConfig = field(default_factory=ServerConfig)
    gate: object = None  # the ConnectionGate counting connections
    draining: bool = False  # shutting down: new requests get 503
    allowed_host_names: frozenset | None = None  # Host names accepted (None: any; ``hosts``)


STATE = web.AppKey("rawpaged_state", ServerState)


def json_response(obj, status: int = 200) -> web.Response:
    return web.Response(text=json.dumps(obj), status=status, content_type="application/json")


def error_response(
    state: ServerState,
    status: int,
    message: str,
    type: str = "invalid_request_error",
    param: str | None = None,
    code: str | None = None,
) -> web.Response:
    """An OpenAI error body with ``status``, counted in the metrics."""
    state.metrics.count_error(status)
    return json_response(error_body(message, type, param, code), status=status)


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


def require_engine(state: ServerState) -> EngineClient:
    """The engine, or a 503 while the model loads (or after it failed to)."""
    if state.engine is None:
        msg = f"the model failed to load: {state.load_error}" if state.load_error else "the model is loading"
        raise ProtocolError(msg, status=503, type="service_unavailable_error")
    return state.engine


def check_capacity(state: ServerState, engine: EngineClient, num_requests: int = 1) -> None:
    """A 503 with ``Retry-After`` when ``num_requests`` more would queue more than ``--max-queued-requests``
    beyond the requests the engine runs at once (``max_num_seqs``), or while the server drains."""
    if state.draining:
        raise ProtocolError(
            "the server is shutting down", status=503, type="service_unavailable_error", headers={"Retry-After": "5"}
        )
    limit = engine.max_num_seqs + state.server.max_queued_requests
    if engine.num_active_requests + num_requests > limit:
        raise ProtocolError(
            f"the server is at capacity: {engine.num_active_requests} requests in flight, at most {limit} "
            "(max_num_seqs running plus --max-queued-requests waiting); retry shortly",
            status=503,
            type="service_unavailable_error",
            headers={"Retry-After": "1"},
        )


def check_model(state: ServerState, model: str | None) -> None:
    """A 404 for a ``model`` this server does not serve (None: the served model)."""
    if model is not None and model not in state.model_aliases:
        raise ProtocolError(
            f"The model `{model}` does not exist; this server serves `{state.model_name}`.",
            param="model",
            status=404,
            type="invalid_request_error",
            code="model_not_found",
        )
