"""The aiohttp application: routes, API-key and error middleware, model loading at start-up, and
``serve`` (listen until stopped, then shut down cleanly).

Routes: POST /v1/completions, POST /v1/chat/completions, GET /v1/models (``openai/``), GET /v1/ws
(``websocket``), GET /health, GET /metrics, GET /v1/debug/stats, GET /v1/debug/kv_cache (``health``),
and the playground page: GET / and /static/ (``playground``). The protocol is described in
docs/server.md.
"""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from aiohttp import web

from rawpaged.config import EngineConfig
from rawpaged.engine.async_engine import AsyncEngine
from rawpaged.engine.data_parallel import DataParallelEngine
from rawpaged.engine.llm_engine import LLMEngine
from rawpaged.entrypoints import cors, health, hosts, playground
from rawpaged.entrypoints.app_state import STATE, AppState
from rawpaged.entrypoints.auth import authorization_matches, unauthorized
from rawpaged.entrypoints.connections import ConnectionGate
from rawpaged.entrypoints.http_body import expect_handler
from rawpaged.entrypoints.http_errors import ProtocolError
from rawpaged.entrypoints.http_responses import error_response
from rawpaged.entrypoints.openai.serving_chat import create_chat_completion
from rawpaged.entrypoints.openai.serving_completion import create_completion
from rawpaged.entrypoints.openai.serving_models import show_available_models
from rawpaged.entrypoints.server_config import DEFAULT_MAX_BODY_SIZE, DEFAULT_MAX_TOKENS_LIMIT, Limits, ServerConfig
from rawpaged.entrypoints.websocket import websocket_handler
from rawpaged.errors import EngineError, ServerShuttingDownError
from rawpaged.weights import DEFAULT_MODEL, resolve_model_dir

logger = logging.getLogger("rawpaged.server")

OPEN_PATHS = ("/health", "/metrics", "/")
#: seconds the rest of an unread body (a 413, a 408) is read after the response, before the connection
#: closes (aiohttp's default is 10: a stalled body would hold its socket that long)
LINGERING_TIME_S = 1.0
#: answered while the server drains on shutdown (everything else gets 503)
DRAINING_PATHS = ("/health", "/metrics")
#: a websocket handshake there checks the key itself: a browser cannot send the header, so the socket may
#: authenticate by message
SELF_AUTHENTICATED_PATHS = ("/v1/ws",)


@web.middleware
async def _middleware(request: web.Request, handler):
    state = request.app[STATE]
    state.gate.begin(request)
    try:
        response = await _handle(state, request, handler)
    finally:
        state.gate.end(request)
    if response.status >= 400 and not (state.draining and response.status == 503):
        _log_refusal(request, response)
    return response


def _log_refusal(request: web.Request, response: web.StreamResponse) -> None:
    """One line per refused request (the request log has lines only for requests that ran)."""
    message = ""
    if isinstance(response, web.Response) and response.content_type == "application/json" and response.text:
        try:
            message = json.loads(response.text).get("error", {}).get("message", "")
        except (ValueError, AttributeError):
            pass
    logger.info("%s %s -> %d %s", request.method, request.rel_url.path, response.status, message[:300])


async def _handle(state: AppState, request: web.Request, handler) -> web.StreamResponse:
    host = hosts.refused_host(state.allowed_host_names, request)
    if host is not None:
        return error_response(
            state,
            403,
            f"requests for host {host!r} are not allowed: this server listens on a loopback address "
            "(--allowed-hosts adds names)",
            type="permission_error",
            param="Host",
        )
    preflight = cors.preflight_response(state.allowed_origins, request)
    if preflight is not None:
        return preflight
    origin = cors.refused_origin(state.allowed_origins, request)
    if origin is not None:
        return error_response(
            state,
            403,
            f"requests from origin {origin!r} are not allowed (--allowed-origins)",
            type="permission_error",
            param="Origin",
        )
    if state.draining and request.path not in DRAINING_PATHS:
        resp = error_response(state, 503, "the server is shutting down", "service_unavailable_error")
        resp.headers["Retry-After"] = "5"
        resp.force_close()
        return resp
    if (
        state.api_key
        and request.path not in OPEN_PATHS
        and not (request.path in SELF_AUTHENTICATED_PATHS and request.headers.get("Upgrade", "").lower() == "websocket")
        and not playground.is_static_path(request.path)
    ):
        if not authorization_matches(state.api_key, request.headers.get("Authorization")):
            e = unauthorized()
            return error_response(state, e.status, e.message, e.type, code=e.code)
    try:
        return await handler(request)
    except ProtocolError as e:
        resp = error_response(state, e.status, e.message, e.type, e.param, e.code)
        resp.headers.update(e.headers)
        if e.close:
            resp.force_close()
        return resp
    except EngineError as e:  # ReplicaUnavailableError and ServerShuttingDownError are 503s
        return error_response(state, e.status, str(e), e.type)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        kind = {404: "not_found_error"}.get(e.status, "invalid_request_error")
        resp = error_response(
            state, e.status, e.reason if e.text is None else e.text.removeprefix(f"{e.status}: "), kind
        )
        if "Allow" in e.headers:  # a 405 names the methods the route takes (RFC 9110, 15.5.6)
            resp.headers["Allow"] = e.headers["Allow"]
        return resp
    except (asyncio.CancelledError, ConnectionError):
        raise
    except Exception:  # noqa: BLE001
        logger.exception("unhandled error on %s %s", request.method, request.path)
        return error_response(state, 500, "internal server error", "internal_server_error")


def model_name_of(config: EngineConfig) -> str:
    """The name clients use for ``config.model``: the default model's name, the directory's, or a GGUF
    file's without ``.gguf``."""
    if config.model is None:
        return DEFAULT_MODEL
    path = Path(config.model).expanduser()
    return (path.stem if path.suffix == ".gguf" else path.name) or str(config.model)


def create_app(
    config: EngineConfig | None = None,
    *,
    engine=None,
    loader: Callable | None = None,
    served_model_name: str | None = None,
    api_key: str | None = None,
    max_tokens_limit: int = DEFAULT_MAX_TOKENS_LIMIT,
    max_body_size: int = DEFAULT_MAX_BODY_SIZE,
    max_n: int = 16,
    allowed_origins=(),
    data_parallel_size: int = 1,
    ray_address: str | None = None,
    server_config: ServerConfig | None = None,
) -> web.Application:
    """The aiohttp application.

    The model comes from ``engine`` (an ``LLMEngine`` or ``AsyncEngine``, ready now), ``loader`` (a
    callable returning an ``LLMEngine``, run in a thread at startup) or ``config`` (``LLMEngine(config)``
    plus a warm-up, in a thread). While loading, ``/health`` answers 503 and generation routes 503.
    ``allowed_origins``: origins (or ``"*"``) browsers may call from (``rawpaged.entrypoints.cors``).
    ``data_parallel_size`` > 1 serves ``config`` through that many Ray replicas
    (``rawpaged.engine.data_parallel``; ``ray_address`` joins a running cluster). ``server_config``: the
    timeouts and limits (``ServerConfig``'s defaults when None).
    """
    config = config or EngineConfig()
    if engine is None and loader is None and data_parallel_size > 1:

        def loader():
            if ray_address is None:  # one machine: prepare the default model once, here, not in each replica
                resolve_model_dir(config.model)
            return DataParallelEngine(config, data_parallel_size, ray_address)

    elif engine is None and loader is None:

        def loader():
            engine = LLMEngine(config)
            logger.info("warm-up run (kernels compiled or loaded from their cache) took %.1fs", engine.warmup())
            return engine

    name = served_model_name or model_name_of(config)
    aliases = {name, model_name_of(config)} | ({config.model} if config.model else set())
    server_config = server_config or ServerConfig()
    state = AppState(
        model_name=name,
        model_aliases=aliases,
        loader=loader,
        api_key=api_key or None,
        limits=Limits(
            max_tokens=max_tokens_limit, max_n=max_n, reject_unknown_fields=server_config.reject_unknown_fields
        ),
        max_body_size=max_body_size,
        allowed_origins=tuple(allowed_origins or ()),
        server=server_config,
    )
    state.gate = ConnectionGate(state.server.max_connections, lambda: health.health_status(state))
    app = web.Application(client_max_size=max_body_size, middlewares=[_middleware])
    app[STATE] = state

    async def on_response_prepare(request, response):
        cors.add_cors_headers(state.allowed_origins, request, response)

    async def on_startup(app):
        loop = asyncio.get_running_loop()
        state.failed = asyncio.Event()
        state.load_started = time.monotonic()
        if engine is not None:
            if isinstance(engine, AsyncEngine):
                state.engine, state.owns_engine = engine, False
            else:
                state.engine = AsyncEngine(engine, metrics=state.metrics)
            return

        def load():  # a daemon thread: a hung or slow load never blocks shutdown
            try:
                result, error = state.loader(), None
            except BaseException as e:  # noqa: BLE001
                logger.debug("model load failed", exc_info=True)
                lines = str(e).strip().splitlines()
                result, error = None, (lines[0] if lines else type(e).__name__)
            try:
                loop.call_soon_threadsafe(loaded, result, error)
            except RuntimeError:  # the loop is gone
                pass

        def loaded(result, error):
            if error is not None:
                state.load_error = error
                state.failed.set()
                return
            if not isinstance(result, LLMEngine):  # a front end over replicas
                result.request_stats.metrics = state.metrics
                state.engine = result
                logger.info(
                    "ready: model %s on %d replicas in %.1fs (KV blocks of %d tokens, max_model_len %d)",
                    state.model_name,
                    result.data_parallel_size,
                    time.monotonic() - state.load_started,
                    result.block_size,
                    result.max_model_len,
                )
                return
            state.engine = AsyncEngine(result, metrics=state.metrics)
            logger.info(
                "ready: model %s loaded and warmed up in %.1fs on %s (%s, KV cache %s: %d blocks of %d "
                "tokens, max_model_len %d)",
                state.model_name,
                time.monotonic() - state.load_started,
                result.backend.name,
                result.dtype,
                result.kv_cache_dtype,
                result.kv_cache_manager.num_blocks,
                result.config.block_size,
                result.max_model_len,
            )

        threading.Thread(target=load, name="rawpaged-load", daemon=True).start()

    async def on_cleanup(app):
        if state.engine is not None and state.owns_engine:
            await state.engine.close()

    app.on_startup.append(on_startup)
    app.on_response_prepare.append(on_response_prepare)
    app.on_cleanup.append(on_cleanup)
    app.router.add_post("/v1/completions", create_completion, expect_handler=expect_handler)
    app.router.add_post("/v1/chat/completions", create_chat_completion, expect_handler=expect_handler)
    app.router.add_get("/v1/models", show_available_models)
    app.router.add_get("/v1/ws", websocket_handler)
    app.router.add_get("/v1/debug/stats", health.debug_stats)
    app.router.add_get("/v1/debug/kv_cache", health.debug_kv_cache)
    playground.add_routes(app)
    app.router.add_get("/health", health.health)
    app.router.add_get("/metrics", health.metrics)
    return app


async def serve(
    app: web.Application,
    host: str = "127.0.0.1",
    port: int = 8000,
    *,
    handle_signals: bool = True,
    stop: asyncio.Event | None = None,
    on_started: Callable | None = None,
) -> int:
    """Serve ``app`` until ``stop`` is set (or SIGINT/SIGTERM), or until the model fails to load.

    Connections go through the app's ``ConnectionGate`` (``--max-connections``) and are closed after
    ``--timeout-keep-alive`` without a complete request. On a stop the server drains (``drain``), then
    closes. Returns the exit code: 0 after a stop, 1 if the port cannot be bound or the model failed to
    load (a one-line ``error: ...`` goes to stderr). ``on_started(port)`` is called once listening.
    """
    state = app[STATE]
    # handlers still running after the drain (their streams already ended) get 5 s to write their last bytes
    runner = web.AppRunner(
        app,
        handler_cancellation=True,
        access_log=None,
        shutdown_timeout=5.0,
        keepalive_timeout=state.server.timeout_keep_alive,
        lingering_time=LINGERING_TIME_S,
    )
    await runner.setup()
    loop = asyncio.get_running_loop()
    try:
        listener = await loop.create_server(state.gate.factory(runner.server), host, port, backlog=1024)
    except OSError as e:
        print(f"error: cannot listen on {host}:{port}: {e.strerror or e}", file=sys.stderr)
        await runner.cleanup()
        return 1
    bound = listener.sockets[0].getsockname()[1] if listener.sockets else port
    state.allowed_host_names = hosts.allowed_names(host, state.server.allowed_hosts)
    logger.info(
        "listening on http://%s:%d (playground: /, health: /health, OpenAI API: /v1, websocket: /v1/ws); %s %s",
        host,
        bound,
        "serving" if state.engine is not None else "loading",
        state.model_name,
    )
    if on_started is not None:
        on_started(bound)
    stop = stop or asyncio.Event()
    if handle_signals:
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                loop.add_signal_handler(sig, stop.set)
            except (NotImplementedError, RuntimeError):
                pass
    waiters = [asyncio.create_task(stop.wait()), asyncio.create_task(state.failed.wait())]
    try:
        await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waiters:
            w.cancel()
        code = 1 if state.failed.is_set() else 0
        if code:
            print(f"error: {state.load_error}", file=sys.stderr)
        else:
            await drain(state)
        listener.close()
        await runner.cleanup()
    return code


async def drain(state: AppState) -> None:
    """Graceful shutdown: new requests get 503 and ``/health`` says draining; requests in flight get
    ``--shutdown-timeout`` seconds to finish; each one left then ends with a ``ServerShuttingDownError``
    (a stream's error event and ``[DONE]``, a 503 body, a websocket ``error``) and its blocks are freed."""
    state.draining = True
    engine = state.engine
    timeout = state.server.shutdown_timeout
    active = engine.num_active_requests if engine is not None else 0
    logger.info("shutting down: %d requests in flight, up to %gs to finish (--shutdown-timeout)", active, timeout)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while engine is not None and engine.num_active_requests and loop.time() < deadline:
        await asyncio.sleep(0.05)
    if engine is not None and engine.num_active_requests:
        n = engine.end_requests(ServerShuttingDownError(f"the server shut down (--shutdown-timeout {timeout:g}s)"))
        logger.info("ended %d requests still running after %gs", n, timeout)
        await asyncio.sleep(0.1)  # their handlers write the errors before the connections close
    if engine is not None:
        try:  # replicas that died may not answer: the drain's report must not hold up the exit
            stats = await asyncio.wait_for(engine.stats(), 5.0)
        except (EngineError, asyncio.TimeoutError):
            return
        if "num_free_blocks" not in stats:  # no replica left to report
            return
        logger.info(
            "drained: %d of %d KV blocks free, %d requests running, %d waiting",
            stats["num_free_blocks"],
            stats["num_total_blocks"],
            stats["num_running"],
            stats["num_waiting"],
        )
