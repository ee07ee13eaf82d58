"""``GET /v1/ws``: one websocket carries any number of concurrent requests, told apart by the client's
``id``; each choice streams ``delta`` messages and ends with ``done`` (docs/server.md, "Websocket streaming").

Client -> server: ``{"type": "generate", "id", "prompt" | "messages", ...completions parameters}``,
``{"type": "subscribe_kv_cache", "id", ...}`` (the KV cache view: a snapshot, then deltas) and
``{"type": "cancel", "id"}`` (ends either). With ``--api-key``, a client that sent no ``Authorization``
header (a browser cannot) sends ``{"type": "auth", "api_key"}`` first. Server -> client: ``delta``,
``done`` (``finish_reason`` "abort" after a cancel), ``kv_cache``, ``kv_cache_delta``, ``auth_ok`` and
``error`` (with the HTTP ``status`` it would have had). Closing the socket aborts its requests.

A ``generate`` goes the way an HTTP generation request goes (``openai/chat_completion/serving``): parsed
(``request_body``), admitted, prepared (``preprocessing``) and submitted (``engine_requests``); its deltas
are written here. The messages' shapes are ``messages``'.
"""

from __future__ import annotations

import asyncio
import json
import logging

from aiohttp import WSCloseCode, web

from rawpaged.core.kv_cache_snapshot import KVCacheSnapshotDiffer
from rawpaged.entrypoints.generation.admission import admit, check_capacity, lora_request_of, require_engine
from rawpaged.entrypoints.generation.choice_parser import ChoiceParser
from rawpaged.entrypoints.generation.engine_requests import add_requests
from rawpaged.entrypoints.generation.output_json import ChatFormat, CompletionFormat, new_id, prompt_logprobs_json
from rawpaged.entrypoints.generation.preprocessing import PreparedPrompt, prepare_prompts
from rawpaged.entrypoints.generation.request_body import decode_json, parse_request
from rawpaged.entrypoints.http.auth import authorization_matches, unauthorized
from rawpaged.entrypoints.http.errors import ProtocolError, field_error
from rawpaged.entrypoints.server.state import STATE, AppState
from rawpaged.entrypoints.websocket.messages import (
    NOT_PARAMETERS,
    Job,
    KVCacheSubscription,
    MessageError,
    Unauthorized,
    error_message,
    max_frame_size,
    parse_subscription,
    refusal_message,
    utf8_size,
)
from rawpaged.entrypoints.websocket.protocol import WebSocketGenerateRequest
from rawpaged.errors import EngineError, ReplicaUnavailableError

#: a socket that must authenticate by message (``--api-key``, no header) is closed after this long without
AUTH_TIMEOUT_S = 10.0
#: close code for a socket that failed to authenticate (4000-4999: private use, RFC 6455 §7.4.2)
CLOSE_UNAUTHORIZED = 4401
#: close code for a socket idle past ``--ws-idle-timeout``
CLOSE_IDLE = 4408

logger = logging.getLogger("rawpaged.server")


async def websocket_handler(request: web.Request) -> web.WebSocketResponse:
    """The upgrade, then the socket's ``WebSocketSession`` until it closes. With ``--api-key`` a header
    must carry the key (else a 401 before the upgrade); without a header (a browser's socket) the first
    message must."""
    state = request.app[STATE]
    header = request.headers.get("Authorization")
    if state.api_key and header is not None and not authorization_matches(state.api_key, header):
        raise unauthorized()
    ws = web.WebSocketResponse(
        max_msg_size=max_frame_size(state.max_body_size), heartbeat=state.server.ws_ping_interval
    )
    await ws.prepare(request)
    await WebSocketSession(state, ws, authenticated=not state.api_key or header is not None).serve()
    return ws


class WebSocketSession:
    """One open socket: its jobs (requests and KV cache subscriptions) by id, whether it has authenticated,
    and when it was last active (the last message, or the end of the last job: the idle clock)."""

    def __init__(self, state: AppState, ws: web.WebSocketResponse, authenticated: bool):
        self.state = state
        self.ws = ws
        self.authenticated = authenticated
        self.jobs: dict[str, Job] = {}  # by the JSON text of the client's id
        self.loop = asyncio.get_running_loop()
        self.last_activity = self.loop.time()

    async def serve(self) -> None:
        """Read and act on messages until the socket closes (or is closed here); then cancel its jobs."""
        self.state.websockets.add(self)
        try:
            while await self._receive():
                pass
        finally:
            self.state.websockets.discard(self)
            tasks = [j.task for j in list(self.jobs.values()) if j.task is not None]
            for t in tasks:
                t.cancel()
            if tasks:
                await asyncio.gather(*tasks, return_exceptions=True)

    async def close_going_away(self) -> None:
        """The server is shutting down (its requests have ended): close with 1001 "going away"."""
        if not self.ws.closed:
            await self.ws.close(code=WSCloseCode.GOING_AWAY, message=b"server shutting down")

    async def send(self, obj: dict) -> None:
        """``obj`` as a JSON text message; nothing once the socket is closed."""
        if self.ws.closed:
            return
        try:
            await self.ws.send_str(json.dumps(obj))
        except (ConnectionError, RuntimeError):
            pass

    # ------------------------------------------------------------------ reading
    async def _receive(self) -> bool:
        """Wait for one message and act on it; False once the socket is closed."""
        idle_timeout = self.state.server.ws_idle_timeout
        if not self.authenticated:
            timeout = AUTH_TIMEOUT_S
        elif self.jobs:  # the idle clock runs only while nothing is in flight: look again later
            timeout = idle_timeout
        else:
            timeout = max(1e-3, self.last_activity + idle_timeout - self.loop.time())
        try:
            msg = await self.ws.receive(timeout=timeout)
        except asyncio.TimeoutError:
            return await self._on_timeout()
        if msg.type == web.WSMsgType.TEXT:
            return await self._on_text(msg.data)
        if msg.type == web.WSMsgType.BINARY:
            await self.send(error_message(None, "binary messages are not supported"))
            return True
        return False

    async def _on_timeout(self) -> bool:
        """No message in time: an unauthenticated socket, or one idle past ``--ws-idle-timeout``, closed."""
        if not self.authenticated:
            await self.send(refusal_message(None, Unauthorized("no auth message within the time allowed")))
            await self.ws.close(code=CLOSE_UNAUTHORIZED, message=b"unauthorized")
            return False
        idle_timeout = self.state.server.ws_idle_timeout
        if self.jobs or self.loop.time() < self.last_activity + idle_timeout:
            return True
        message = f"no message for {idle_timeout:g}s with nothing in flight (--ws-idle-timeout)"
        await self.send(error_message(None, message, status=408))
        await self.ws.close(code=CLOSE_IDLE, message=b"idle timeout")
        return False

    async def _on_text(self, data: str) -> bool:
        try:
            reply = self.on_message(data)
            if reply is not None:
                await self.send(reply)
        except Unauthorized as e:
            await self.send(refusal_message(None, e))
            await self.ws.close(code=CLOSE_UNAUTHORIZED, message=b"unauthorized")
            return False
        except ProtocolError as e:
            await self.send(refusal_message(getattr(e, "ws_id", None), e))
        return True

    def on_message(self, data: str) -> dict | None:
        """Act on one client message; returns the reply to send at once, if any. Raises ProtocolError
        (``MessageError`` with the message's id, ``Unauthorized`` to close the socket)."""
        self.last_activity = self.loop.time()
        if utf8_size(data) > self.state.max_body_size:
            raise ProtocolError(
                f"message is larger than {self.state.max_body_size} bytes (--max-body-size)", status=413
            )
        try:
            msg = decode_json(data, "message")
        except ProtocolError as e:  # a lone surrogate in a readable message: the error names its id
            raise MessageError(e, _readable_id(data)) from None
        if not isinstance(msg, dict):
            raise ProtocolError("message must be a JSON object")
        if not self.authenticated:
            return self._authenticate(msg)
        if msg.get("type") == "auth":
            raise ProtocolError("this socket is already authenticated", param="type")
        mid = msg.get("id")
        if not _valid_id(mid):
            raise ProtocolError("id must be a non-empty string", param="id")
        key = json.dumps(mid)  # 7 and "7" are two ids; replies carry the id as it was sent
        kind = msg.get("type")
        if kind == "generate":
            self._start_generation(mid, key, msg)
        elif kind == "subscribe_kv_cache":
            self._start_subscription(mid, key, msg)
        elif kind == "cancel":
            self._cancel(mid, key)
        else:
            raise MessageError(
                ProtocolError("type must be 'generate', 'subscribe_kv_cache' or 'cancel'", param="type"), mid
            )
        return None

    def _authenticate(self, msg: dict) -> dict:
        key = msg.get("api_key")
        if msg.get("type") != "auth" or not isinstance(key, str):
            raise Unauthorized('send {"type": "auth", "api_key": ...} first (--api-key is set)')
        if not authorization_matches(self.state.api_key, f"Bearer {key}"):
            raise Unauthorized("invalid API key")
        self.authenticated = True
        return {"type": "auth_ok"}

    # ------------------------------------------------------------------ jobs
    def _check_unused(self, mid, key: str) -> None:
        if key in self.jobs:
            raise MessageError(ProtocolError(f"id {key} is already in use on this socket", param="id"), mid)

    def _start_generation(self, mid, key: str, msg: dict) -> None:
        self._check_unused(mid, key)
        body = {k: v for k, v in msg.items() if k not in NOT_PARAMETERS}
        try:
            req = parse_request(WebSocketGenerateRequest, body, self.state.limits)
        except ProtocolError as e:
            raise MessageError(e, mid) from None
        job = self.jobs[key] = Job(mid, key, req.num_choices)
        job.task = asyncio.create_task(self._generate(job, req))

    def _start_subscription(self, mid, key: str, msg: dict) -> None:
        self._check_unused(mid, key)
        try:
            sub = parse_subscription(msg)
        except ProtocolError as e:
            raise MessageError(e, mid) from None
        job = self.jobs[key] = Job(mid, key, 0, watcher=True)
        job.task = asyncio.create_task(self._watch_kv_cache(job, sub))

    def _cancel(self, mid, key: str) -> None:
        job = self.jobs.get(key)
        if job is None:
            raise MessageError(ProtocolError(f"no active request with id {key}", param="id"), mid)
        if job.watcher:  # a subscription just stops
            job.task.cancel()
            self._ended(job)
            return
        # _generate sees the flag (or its stream ends as aborted) and sends a "done" per choice
        job.cancelled = True
        if job.rid is not None and self.state.engine is not None:
            self.state.engine.abort(job.rid)

    def _ended(self, job: Job) -> None:
        if self.jobs.get(job.key) is job:
            del self.jobs[job.key]
        self.last_activity = self.loop.time()

    # ------------------------------------------------------------------ a generation
    async def _generate(self, job: Job, req: WebSocketGenerateRequest) -> None:
        """Run one ``generate`` and stream its choices; every way it ends is told to the client."""
        state, engine = self.state, None
        try:
            engine = admit(state, req.model)
            prompts = await prepare_prompts(engine, req, state.limits)
            check_capacity(state, engine)
            job.prompt_tokens = len(prompts[0].ids)
            if job.cancelled:
                raise asyncio.CancelledError
            job.rid = new_id("ws")
            label, lora = f"websocket id {job.id!r}", lora_request_of(state, req.model)
            stream = (await add_requests(engine, req, prompts, job.rid, log_label=label, lora_request=lora))[0]
            job.replica = stream.replica
            if job.cancelled:  # cancelled while being added
                engine.abort(job.rid)
            await self._stream(job, req, prompts[0], stream)
            if stream.aborted:
                raise asyncio.CancelledError
        except ProtocolError as e:
            await self.send(refusal_message(job.id, e))
        except EngineError as e:
            await self.send(error_message(job.id, str(e), status=e.status))
        except asyncio.CancelledError:
            if not job.cancelled:
                raise
            for index in range(job.n):  # the client's cancel: close every choice
                if not job.tracker.finished(index):
                    await self.send(job.done_message(index, "abort"))
        except Exception:  # noqa: BLE001 - a fault of ours: the client still hears of it
            logger.exception("unhandled error in websocket request id %r", job.id)
            await self.send(error_message(job.id, "internal server error", status=500))
        finally:
            if engine is not None and job.rid is not None:
                engine.abort(job.rid)
            self._ended(job)

    async def _stream(self, job: Job, req: WebSocketGenerateRequest, prompt: PreparedPrompt, stream) -> None:
        """A ``delta`` per new text of a choice (logprobs in the matching HTTP API's shape; the first one
        with ``prompt_logprobs`` when asked for; a chat with a reasoning parser: its thinking in
        ``reasoning``, the rest in ``text``), a ``done`` when it finishes."""
        fmt = ChatFormat() if req.kind == "chat" else CompletionFormat()
        name = self.state.reasoning_parser if req.kind == "chat" else None
        parsers = {}
        async for out in stream:
            for d in job.tracker.deltas(out):
                if d.text or d.token_ids or (name and d.finish_reason):
                    lp = fmt.logprobs(req, prompt, d.token_ids, d.logprobs, d.text_offset)
                    msg = job.delta_message(d, lp)
                    if d.first and req.prompt_logprobs is not None:
                        msg["prompt_logprobs"] = prompt_logprobs_json(out.prompt_logprobs)
                    if name:
                        parser = parsers.setdefault(d.index, ChoiceParser(name, None))
                        message = parser.feed(d.text, last=bool(d.finish_reason))
                        msg["text"] = message.content
                        if message.reasoning:
                            msg["reasoning"] = message.reasoning
                    if msg["text"] or msg["token_ids"] or msg.get("reasoning"):
                        await self.send(msg)
                if d.finish_reason:
                    await self.send(job.done_message(d.index, d.finish_reason))

    # ------------------------------------------------------------------ a KV cache subscription
    async def _watch_kv_cache(self, job: Job, sub: KVCacheSubscription) -> None:
        """Send a snapshot, then every ``interval_ms`` the delta since the last one sent; an idle server
        (no request in flight, and the last look saw none either) is not asked again."""
        differ = KVCacheSnapshotDiffer()
        since_event = None
        was_busy = True
        try:
            while True:
                engine = require_engine(self.state)
                busy = engine.num_active_requests > 0
                if busy or was_busy:
                    snap = await engine.kv_cache_snapshot(sub.start, sub.count, since_event, sub.replica)
                    since_event = snap["next_event_id"]
                    kind, body = differ.update(snap)
                    if body is not None:
                        kind = "kv_cache" if kind == "snapshot" else "kv_cache_delta"
                        await self.send({"type": kind, "id": job.id, **body})
                was_busy = busy
                await asyncio.sleep(sub.interval_ms / 1000)
        except ValueError as e:
            await self.send(refusal_message(job.id, field_error(e)))
        except ProtocolError as e:
            await self.send(refusal_message(job.id, e))
        except ReplicaUnavailableError as e:
            await self.send(error_message(job.id, str(e), "replica", 503))
        except EngineError as e:
            await self.send(error_message(job.id, str(e), status=e.status))
        finally:
            self._ended(job)


def _valid_id(mid) -> bool:
    """Whether ``mid`` can be a message's id: a non-empty string or an integer (not a bool)."""
    return not isinstance(mid, bool) and isinstance(mid, (str, int)) and mid != ""


def _readable_id(data: str) -> str | int | None:
    """The id of a message that ``decode_json`` refused, where the JSON parses and its id is valid
    Unicode (a lone surrogate elsewhere in it); None otherwise."""
    try:
        msg = json.loads(data)
    except (ValueError, RecursionError):
        return None
    mid = msg.get("id") if isinstance(msg, dict) else None
    if not _valid_id(mid):
        return None
    if isinstance(mid, str):
        try:
            mid.encode("utf-8")
        except UnicodeEncodeError:
            return None
    return mid
