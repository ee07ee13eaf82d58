"""``GET /v1/ws``: one websocket carries any number of concurrent requests, told apart by the client's
``id``; each choice streams ``delta`` messages and ends with ``done`` (docs/server.md, "Websocket streaming").

Client -> server: ``{"type": "generate", "id", "prompt" | "messages", ...completions parameters}``,
``{"type": "subscribe_kv_cache", "id", ...}`` (the KV cache view: a snapshot, then deltas) and
``{"type": "cancel", "id"}`` (ends either). With ``--api-key``, a client that sent no ``Authorization``
header (a browser cannot) sends ``{"type": "auth", "api_key"}`` first. Server -> client: ``delta``,
``done`` (``finish_reason`` "abort" after a cancel), ``kv_cache``, ``kv_cache_delta``, ``auth_ok`` and
``error`` (with the HTTP ``status`` it would have had). Closing the socket aborts its requests.
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from rawpaged.core.kv_cache_snapshot import KVCacheSnapshotDiffer
from rawpaged.engine.outputs import DeltaTracker
from rawpaged.entrypoints.admission import check_capacity, check_model, require_engine
from rawpaged.entrypoints.app_state import STATE
from rawpaged.entrypoints.auth import authorization_matches, unauthorized
from rawpaged.entrypoints.http_errors import ProtocolError, field_error
from rawpaged.entrypoints.openai import request_body
from rawpaged.entrypoints.openai.engine_requests import add_requests
from rawpaged.entrypoints.openai.preprocessing import prepare_prompts
from rawpaged.entrypoints.openai.protocol import WebSocketGenerateRequest
from rawpaged.entrypoints.openai.response_builders import ChatFormat, CompletionFormat, new_id
from rawpaged.errors import EngineError, ReplicaUnavailableError

#: Keys of a ``generate`` message that are not request parameters (a socket always streams).
_NOT_PARAMETERS = ("type", "id", "stream", "stream_options")
#: a socket that must authenticate by message (``--api-key``, no header) is closed after this long without
AUTH_TIMEOUT_S = 10.0
#: close code for a socket that failed to authenticate (4000-4999: private use, RFC 6455 §7.4.2)
CLOSE_UNAUTHORIZED = 4401
#: close code for a socket idle past ``--ws-idle-timeout``
CLOSE_IDLE = 4408

logger = logging.getLogger("rawpaged.server")


def max_frame_size(max_body_size: int) -> int:
    """The largest message read at all: one up to here but over ``--max-body-size`` gets an ``error``
    (status 413) and the socket stays open; a larger one closes it with code 1009 (message too big)."""
    return max(2 * max_body_size, max_body_size + (1 << 20))


def _utf8_size(text: str) -> int:
    return len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))


class KVCacheSubscription(BaseModel):
    """A ``subscribe_kv_cache`` message: snapshots of blocks ``start .. start + count - 1`` of
    ``replica``'s pool every ``interval_ms`` while anything changes (``kv_cache`` first, then
    ``kv_cache_delta``)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    type: str
    id: str | int
    interval_ms: int = Field(250, ge=50, le=60_000)
    start: int = Field(0, ge=0)
    count: int | None = Field(None, ge=1)
    replica: int | None = Field(None, ge=0)


@dataclass
class _Job:
    id: str | int  # as the client sent it
    key: str  # its JSON text: the key of ``jobs``
    n: int
    task: asyncio.Task | None = None
    rid: str | None = None
    cancelled: bool = False
    watcher: bool = False  # a KV cache subscription, not a request


class _Unauthorized(ProtocolError):
    """A message on a socket that has not authenticated: answered, then the socket is closed."""

    def __init__(self, message: str):
        super().__init__(message, status=401, type="authentication_error", code="invalid_api_key")


class _MessageError(ProtocolError):
    """A refused message, answered with an ``error`` carrying the message's ``id``."""

    def __init__(self, error: ProtocolError, ws_id: str | None):
        super().__init__(error.message, error.param, error.status, error.type, error.code)
        self.ws_id = ws_id


def _error_message(ws_id, e: ProtocolError) -> dict:
    return {"type": "error", "id": ws_id, "message": e.message, "param": e.param, "status": e.status}


def _subscription(msg: dict) -> KVCacheSubscription:
    try:
        return KVCacheSubscription.model_validate(msg)
    except ValidationError as e:
        err = e.errors()[0]
        field = ".".join(str(p) for p in err["loc"]) or None
        raise ProtocolError(f"{field}: {err['msg']}", param=field) from None


async def websocket_handler(request: web.Request) -> web.WebSocketResponse:
    state = request.app[STATE]
    # with --api-key: a header must carry the key (else 401 before the upgrade); without a header (a
    # browser's socket) the first message must
    header = request.headers.get("Authorization")
    authenticated = not state.api_key or header is not None
    if state.api_key and header is not None and not authorization_matches(state.api_key, header):
        raise unauthorized()
    ws = web.WebSocketResponse(
        max_msg_size=max_frame_size(state.max_body_size), heartbeat=state.server.ws_ping_interval
    )
    await ws.prepare(request)
    jobs: dict[str, _Job] = {}
    loop = asyncio.get_running_loop()
    last_activity = loop.time()  # the last message, or the end of the last job

    def job_ended(job: _Job) -> None:
        nonlocal last_activity
        if jobs.get(job.key) is job:
            del jobs[job.key]
        last_activity = loop.time()

    async def send(obj) -> None:
        if ws.closed:
            return
        try:
            await ws.send_str(json.dumps(obj))
        except (ConnectionError, RuntimeError):
            pass

    async def run(job: _Job, req: WebSocketGenerateRequest) -> None:
        engine = None
        tracker = DeltaTracker()
        fmt = ChatFormat() if req.kind == "chat" else CompletionFormat()  # logprobs in the matching API's shape
        prompt_tokens = 0

        replica = None

        def done(index: int, finish_reason: str) -> dict:
            msg = {
                "type": "done",
                "id": job.id,
                "request_id": job.rid,
                "index": index,
                "finish_reason": finish_reason,
                "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": tracker.num_tokens(index)},
            }
            if replica is not None:
                msg["replica"] = replica
            return msg

        try:
            check_model(state, req.model)
            engine = require_engine(state)
            check_capacity(state, engine)
            prompts = await prepare_prompts(engine, req, state.limits)
            check_capacity(state, engine)
            prompt_tokens = len(prompts[0].ids)
            if job.cancelled:
                raise asyncio.CancelledError
            job.rid = new_id("ws")
            stream = (await add_requests(engine, req, prompts, job.rid, log_label=f"websocket id {job.id!r}"))[0]
            replica = stream.replica
            if job.cancelled:  # cancelled while being added
                engine.abort(job.rid)
            async for out in stream:
                for d in tracker.deltas(out):
                    if d.text or d.token_ids:
                        msg = {
                            "type": "delta",
                            "id": job.id,
                            "request_id": job.rid,
                            "index": d.index,
                            "text": d.text,
                            "token_ids": d.token_ids,
                        }
                        lp = fmt.logprobs(req, prompts[0], d.token_ids, d.logprobs, d.text_offset)
                        if lp is not None:
                            msg["logprobs"] = lp
                        await send(msg)
                    if d.finish_reason:
                        await send(done(d.index, d.finish_reason))
            if stream.aborted:
                raise asyncio.CancelledError
        except ProtocolError as e:
            await send(_error_message(job.id, e))
        except EngineError as e:
            await send({"type": "error", "id": job.id, "message": str(e), "param": None, "status": e.status})
        except asyncio.CancelledError:
            if not job.cancelled:
                raise
            for index in range(job.n):  # the client's cancel: close every choice
                if not tracker.finished(index):
                    await send(done(index, "abort"))
        except Exception:  # noqa: BLE001 - a fault of ours: the client still hears of it
            logger.exception("unhandled error in websocket request id %r", job.id)
            await send(
                {"type": "error", "id": job.id, "message": "internal server error", "param": None, "status": 500}
            )
        finally:
            if engine is not None and job.rid is not None:
                engine.abort(job.rid)
            job_ended(job)

    async def watch_kv_cache(job: _Job, sub: KVCacheSubscription) -> None:
        """Send a snapshot, then every ``interval_ms`` the delta since the last one sent; an idle server
        (no request in flight, and the last look saw none either) is not asked again."""
        differ = KVCacheSnapshotDiffer()
        since_event = None
        was_busy = True
        try:
            while True:
                engine = require_engine(state)
                busy = engine.num_active_requests > 0
                if busy or was_busy:
                    snap = await engine.kv_cache_snapshot(sub.start, sub.count, since_event, sub.replica)
                    since_event = snap["next_event_id"]
                    kind, body = differ.update(snap)
                    if body is not None:
                        kind = "kv_cache" if kind == "snapshot" else "kv_cache_delta"
                        await send({"type": kind, "id": job.id, **body})
                was_busy = busy
                await asyncio.sleep(sub.interval_ms / 1000)
        except ValueError as e:
            await send(_error_message(job.id, field_error(e)))
        except ProtocolError as e:
            await send(_error_message(job.id, e))
        except ReplicaUnavailableError as e:
            await send({"type": "error", "id": job.id, "message": str(e), "param": "replica", "status": 503})
        except EngineError as e:
            await send({"type": "error", "id": job.id, "message": str(e), "param": None, "status": e.status})
        finally:
            job_ended(job)

    def on_message(data: str) -> dict | None:
        """Act on one client message; returns the reply to send at once, if any."""
        nonlocal authenticated, last_activity
        last_activity = loop.time()
        if _utf8_size(data) > state.max_body_size:
            raise ProtocolError(f"message is larger than {state.max_body_size} bytes (--max-body-size)", status=413)
        msg = request_body.decode_json(data, "message")
        if not isinstance(msg, dict):
            raise ProtocolError("message must be a JSON object")
        if not authenticated:
            key = msg.get("api_key")
            if msg.get("type") != "auth" or not isinstance(key, str):
                raise _Unauthorized('send {"type": "auth", "api_key": ...} first (--api-key is set)')
            if not authorization_matches(state.api_key, f"Bearer {key}"):
                raise _Unauthorized("invalid API key")
            authenticated = True
            return {"type": "auth_ok"}
        if msg.get("type") == "auth":
            raise ProtocolError("this socket is already authenticated", param="type")
        mid = msg.get("id")
        if isinstance(mid, bool) or not isinstance(mid, (str, int)) or mid == "":
            raise ProtocolError("id must be a non-empty string", param="id")
        key = json.dumps(mid)  # 7 and "7" are two ids; replies carry the id as it was sent
        kind = msg.get("type")
        if kind == "generate":
            if key in jobs:
                raise _MessageError(ProtocolError(f"id {key} is already in use on this socket", param="id"), mid)
            body = {k: v for k, v in msg.items() if k not in _NOT_PARAMETERS}
            try:
                req = request_body.parse_request(WebSocketGenerateRequest, body, state.limits)
            except ProtocolError as e:
                raise _MessageError(e, mid) from None
            job = _Job(mid, key, req.num_choices)
            jobs[key] = job
            job.task = asyncio.create_task(run(job, req))
        elif kind == "subscribe_kv_cache":
            if key in jobs:
                raise _MessageError(ProtocolError(f"id {key} is already in use on this socket", param="id"), mid)
            try:
                sub = _subscription(msg)
            except ProtocolError as e:
                raise _MessageError(e, mid) from None
            job = _Job(mid, key, 0, watcher=True)
            jobs[key] = job
            job.task = asyncio.create_task(watch_kv_cache(job, sub))
        elif kind == "cancel":
            job = jobs.get(key)
            if job is None:
                raise _MessageError(ProtocolError(f"no active request with id {key}", param="id"), mid)
            if job.watcher:  # a subscription just stops
                job.task.cancel()
                job_ended(job)
                return
            # run() sees the flag (or its stream ends as aborted) and sends a "done" per choice
            job.cancelled = True
            if job.rid is not None and state.engine is not None:
                state.engine.abort(job.rid)
        else:
            raise _MessageError(
                ProtocolError("type must be 'generate', 'subscribe_kv_cache' or 'cancel'", param="type"), mid
            )

    idle_timeout = state.server.ws_idle_timeout
    try:
        while True:
            if not authenticated:
                timeout = AUTH_TIMEOUT_S
            elif jobs:  # the idle clock runs only while nothing is in flight: look again later
                timeout = idle_timeout
            else:
                timeout = max(1e-3, last_activity + idle_timeout - loop.time())
            try:
                msg = await ws.receive(timeout=timeout)
            except asyncio.TimeoutError:
                if not authenticated:
                    await send(_error_message(None, _Unauthorized("no auth message within the time allowed")))
                    await ws.close(code=CLOSE_UNAUTHORIZED, message=b"unauthorized")
                    break
                if jobs or loop.time() < last_activity + idle_timeout:
                    continue
                message = f"no message for {idle_timeout:g}s with nothing in flight (--ws-idle-timeout)"
                await send({"type": "error", "id": None, "message": message, "param": None, "status": 408})
                await ws.close(code=CLOSE_IDLE, message=b"idle timeout")
                break
            if msg.type == web.WSMsgType.TEXT:
                try:
                    reply = on_message(msg.data)
                    if reply is not None:
                        await send(reply)
                except _Unauthorized as e:
                    await send(_error_message(None, e))
                    await ws.close(code=CLOSE_UNAUTHORIZED, message=b"unauthorized")
                    break
                except ProtocolError as e:
                    await send(_error_message(getattr(e, "ws_id", None), e))
            elif msg.type == web.WSMsgType.BINARY:
                await send(
                    {
                        "type": "error",
                        "id": None,
                        "message": "binary messages are not supported",
                        "param": None,
                        "status": 400,
                    }
                )
            else:
                break
    finally:  # socket closed: abort everything it started
        tasks = [j.task for j in list(jobs.values()) if j.task is not None]
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
    return ws
