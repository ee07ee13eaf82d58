"""``GET /v1/ws``: one websocket carries any number of concurrent requests, told apart by the client's
``id``; each choice streams ``delta`` messages and ends with ``done`` (README: "Websocket streaming").

Client -> server: ``{"type": "generate", "id", "prompt" | "messages", ...completions parameters}`` and
``{"type": "cancel", "id"}``. Server -> client: ``delta``, ``done`` (``finish_reason`` "abort" after a
cancel) and ``error`` (with the HTTP ``status`` it would have had). Closing the socket aborts its requests.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass

from aiohttp import web

from rawpaged.engine.outputs import DeltaTracker
from rawpaged.entrypoints.openai import protocol
from rawpaged.entrypoints.openai.protocol import ProtocolError, WebSocketGenerateRequest
from rawpaged.entrypoints.openai.serving_chat import ChatFormat
from rawpaged.entrypoints.openai.serving_completion import CompletionFormat
from rawpaged.entrypoints.openai.serving_engine import add_requests, prepare_prompts
from rawpaged.entrypoints.server_state import STATE, check_model, require_engine
from rawpaged.errors import EngineError

#: Keys of a ``generate`` message that are not request parameters (a socket always streams).
_NOT_PARAMETERS = ("type", "id", "stream", "stream_options")


@dataclass
class _Job:
    id: str
    n: int
    task: asyncio.Task | None = None
    rid: str | None = None
    cancelled: bool = False


class _MessageError(ProtocolError):
    """A refused message, answered with an ``error`` carrying the message's ``id``."""

    def __init__(self, error: ProtocolError, ws_id: str | None):
        super().__init__(error.message, error.param, error.status, error.type, error.code)
        self.ws_id = ws_id


def _error_message(ws_id, e: ProtocolError) -> dict:
    return {"type": "error", "id": ws_id, "message": e.message, "param": e.param, "status": e.status}


async def websocket_handler(request: web.Request) -> web.WebSocketResponse:
    state = request.app[STATE]
    ws = web.WebSocketResponse(max_msg_size=state.max_body_size)
    await ws.prepare(request)
    jobs: dict[str, _Job] = {}

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
            prompts = await prepare_prompts(engine, req, state.limits)
            prompt_tokens = len(prompts[0].ids)
            if job.cancelled:
                raise asyncio.CancelledError
            job.rid = protocol.new_id("ws")
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
            await send({"type": "error", "id": job.id, "message": str(e), "param": None, "status": 500})
        except asyncio.CancelledError:
            if not job.cancelled:
                raise
            for index in range(job.n):  # the client's cancel: close every choice
                if not tracker.finished(index):
                    await send(done(index, "abort"))
        finally:
            if engine is not None and job.rid is not None:
                engine.abort(job.rid)
            if jobs.get(job.id) is job:
                del jobs[job.id]

    def on_message(data: str) -> None:
        try:
            msg = json.loads(data)
        except ValueError as e:
            raise ProtocolError(f"message is not valid JSON: {e}") from None
        if not isinstance(msg, dict):
            raise ProtocolError("message must be a JSON object")
        mid = msg.get("id")
        if isinstance(mid, bool) or not isinstance(mid, (str, int)) or mid == "":
            raise ProtocolError("id must be a non-empty string", param="id")
        mid = str(mid)
        kind = msg.get("type")
        if kind == "generate":
            if mid in jobs:
                raise _MessageError(ProtocolError(f"id {mid!r} is already in use on this socket", param="id"), mid)
            body = {k: v for k, v in msg.items() if k not in _NOT_PARAMETERS}
            try:
                req = protocol.parse_request(WebSocketGenerateRequest, body, state.limits)
            except ProtocolError as e:
                raise _MessageError(e, mid) from None
            job = _Job(mid, req.num_choices)
            jobs[mid] = job
            job.task = asyncio.create_task(run(job, req))
        elif kind == "cancel":
            job = jobs.get(mid)
            if job is None:
                raise _MessageError(ProtocolError(f"no active request with id {mid!r}", param="id"), mid)
            # run() sees the flag (or its stream ends as aborted) and sends a "done" per choice
            job.cancelled = True
            if job.rid is not None and state.engine is not None:
                state.engine.abort(job.rid)
        else:
            raise _MessageError(ProtocolError("type must be 'generate' or 'cancel'", param="type"), mid)

    try:
        async for msg in ws:
            if msg.type == web.WSMsgType.TEXT:
                try:
                    on_message(msg.data)
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
