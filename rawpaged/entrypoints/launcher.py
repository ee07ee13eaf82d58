"""Running the app: ``serve`` listens until stopped (or until the model fails to load), then ``drain``
shuts down gracefully (as vLLM's ``entrypoints/launcher.py``)."""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
from collections.abc import Callable

from aiohttp import web

from rawpaged.entrypoints.http import hosts
from rawpaged.entrypoints.server.state import STATE, AppState
from rawpaged.errors import EngineError, ServerShuttingDownError

logger = logging.getLogger("rawpaged.server")

#: seconds the rest of an unread body (a 413, a 408) is read after the response, before the connection
#: closes (aiohttp's default is 10: a stalled body would hold its socket that long)
LINGERING_TIME_S = 1.0


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
    if state.websockets:  # open sockets (idle, or their last messages sent) would hold up the exit
        await asyncio.gather(*(s.close_going_away() for s in list(state.websockets)), return_exceptions=True)
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
