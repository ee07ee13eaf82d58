"""Operations routes: ``GET /health`` (503 while the model loads, then 200), ``GET /metrics``
(Prometheus text), ``GET /v1/debug/stats`` (the engine's counters as JSON) and ``GET /v1/debug/kv_cache``
(a snapshot of the KV block pool, ``rawpaged.core.kv_cache_snapshot``)."""

from __future__ import annotations

import time

from aiohttp import web

from rawpaged.entrypoints.generation.admission import require_engine
from rawpaged.entrypoints.http.errors import ProtocolError, field_error
from rawpaged.entrypoints.http.json_reply import json_response
from rawpaged.entrypoints.server.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from rawpaged.entrypoints.server.state import STATE, AppState
from rawpaged.errors import EngineDeadError


def health_status(state: AppState) -> tuple:
    """``(status, body)`` of ``GET /health``: 200 while the model serves; 503 while it loads (``phase``:
    ``weights``, ``load`` or ``warm-up``, and ``seconds`` since start-up), after it
    failed to, while the server drains on shutdown, or (data parallel) while no replica takes requests."""
    if state.draining:
        return 503, {"status": "draining", "model": state.model_name}
    if state.engine is not None:
        replica_health = getattr(state.engine, "replica_health", None)
        if replica_health is None:
            return 200, {"status": "ok", "model": state.model_name}
        replicas = replica_health()  # data parallel: ok while one replica takes requests
        up = any(r["ready"] for r in replicas)
        return (200 if up else 503), {
            "status": "ok" if up else "unavailable",
            "model": state.model_name,
            "replicas": replicas,
        }
    if state.load_error:
        return 503, {"status": "error", "message": state.load_error}
    body = {"status": "loading", "model": state.model_name, "seconds": round(time.monotonic() - state.load_started, 1)}
    if state.phase is not None:  # the default loader's phase (``startup.PHASES``); a custom loader has none
        body["phase"] = state.phase
    return 503, body


async def health(request: web.Request) -> web.Response:
    status, body = health_status(request.app[STATE])
    return json_response(body, status=status)


async def metrics(request: web.Request) -> web.Response:
    state = request.app[STATE]
    stats = None
    if state.engine is not None:
        try:
            stats = await state.engine.stats()
        except EngineDeadError:
            pass
    return web.Response(body=state.metrics.render(stats), headers={"Content-Type": METRICS_CONTENT_TYPE})


async def debug_stats(request: web.Request) -> web.Response:
    return json_response(await require_engine(request.app[STATE]).stats())


def _int_query(request: web.Request, name: str) -> int | None:
    value = request.query.get(name)
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        raise ProtocolError(f"{name} must be an integer, got {value!r}", param=name) from None


async def debug_kv_cache(request: web.Request) -> web.Response:
    """``?start=&count=`` (a block range, ``count`` at most 8192), ``?since_event=`` (events from that id;
    default the last 64), ``?replica=`` (data parallel: whose pool, default 0)."""
    engine = require_engine(request.app[STATE])
    args = {name: _int_query(request, name) for name in ("start", "count", "since_event", "replica")}
    try:
        snapshot = await engine.kv_cache_snapshot(
            args["start"] or 0, args["count"], args["since_event"], args["replica"]
        )
    except ValueError as e:
        raise field_error(e) from None
    return json_response(snapshot)
