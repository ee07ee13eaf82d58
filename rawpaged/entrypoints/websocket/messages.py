"""The websocket's messages (``websocket``): a ``subscribe_kv_cache`` message's model, the server's
``delta``, ``done`` and ``error`` messages, the refusals of a message, and the state of one job (a request or
a subscription) of a socket."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from rawpaged.engine.outputs import CompletionDelta, DeltaTracker
from rawpaged.entrypoints.http.errors import ProtocolError

#: Keys of a ``generate`` message that are not request parameters (a socket always streams).
NOT_PARAMETERS = ("type", "id", "stream", "stream_options")


def max_frame_size(max_body_size: int) -> int:
    """The largest message read at all: one up to here but over ``--max-body-size`` gets an ``error``
    (status 413) and the socket stays open; a larger one closes it with code 1009 (message too big)."""
    return max(2 * max_body_size, max_body_size + (1 << 20))


def utf8_size(text: str) -> int:
    """Bytes of ``text`` in UTF-8 (a lone surrogate as its 3 bytes)."""
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


def parse_subscription(msg: dict) -> KVCacheSubscription:
    """``msg`` as a ``KVCacheSubscription``; a ProtocolError naming the field at fault."""
    try:
        return KVCacheSubscription.model_validate(msg)
    except ValidationError as e:
        err = e.errors()[0]
        name = ".".join(str(p) for p in err["loc"]) or None
        raise ProtocolError(f"{name}: {err['msg']}", param=name) from None


class Unauthorized(ProtocolError):
    """A message on a socket that has not authenticated: answered, then the socket is closed."""

    def __init__(self, message: str):
        super().__init__(message, status=401, type="authentication_error", code="invalid_api_key")


class MessageError(ProtocolError):
    """A refused message, answered with an ``error`` carrying the message's ``id``."""

    def __init__(self, error: ProtocolError, ws_id: str | int | None):
        super().__init__(error.message, error.param, error.status, error.type, error.code)
        self.ws_id = ws_id


def error_message(ws_id, message: str, param: str | None = None, status: int = 400) -> dict:
    """An ``error``: about the message or job ``ws_id`` (None: about none), with the HTTP ``status`` it
    would have had."""
    return {"type": "error", "id": ws_id, "message": message, "param": param, "status": status}


def refusal_message(ws_id, e: ProtocolError) -> dict:
    """The ``error`` of a refused message or request."""
    return error_message(ws_id, e.message, e.param, e.status)


@dataclass
class Job:
    """A request or a KV cache subscription of one socket."""

    id: str | int  # as the client sent it
    key: str  # its JSON text: the key of the session's jobs
    n: int  # choices
    task: asyncio.Task | None = None
    rid: str | None = None  # the engine's request id, once submitted
    cancelled: bool = False
    watcher: bool = False  # a KV cache subscription, not a request
    tracker: DeltaTracker = field(default_factory=DeltaTracker)
    prompt_tokens: int = 0
    replica: int | None = None  # data parallel: the replica serving it

    def delta_message(self, d: CompletionDelta, logprobs: dict | None) -> dict:
        """A ``delta``: choice ``d.index``'s new text and token ids (and their logprobs, when asked for)."""
        msg = {
            "type": "delta",
            "id": self.id,
            "request_id": self.rid,
            "index": d.index,
            "text": d.text,
            "token_ids": d.token_ids,
        }
        if logprobs is not None:
            msg["logprobs"] = logprobs
        return msg

    def done_message(self, index: int, finish_reason: str) -> dict:
        """A ``done``: choice ``index`` finished, with its usage (and the replica that served it)."""
        msg = {
            "type": "done",
            "id": self.id,
            "request_id": self.rid,
            "index": index,
            "finish_reason": finish_reason,
            "usage": {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.tracker.num_tokens(index)},
        }
        if self.replica is not None:
            msg["replica"] = self.replica
        return msg
