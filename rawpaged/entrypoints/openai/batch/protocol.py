"""One line of an OpenAI Batch API file: the request line read (``BatchRequestInput``) and the line written
for it (``BatchRequestOutput``), with vLLM's ``run_batch`` names.

Input: ``{"custom_id": str, "method": "POST", "url": one of BATCH_URLS, "body": {...}}``; the body is the
request the route takes, and the route validates it as it validates a server request. Output:
``{"id": "batch_req_...", "custom_id", "response": {"status_code", "request_id", "body"}, "error"}``:
``body`` is the route's JSON answer when its status is 200; for any other status ``body`` is None and
``error`` holds the route's error object (``{"message", "type", "param", "code"}``), as vLLM writes it.
A line that cannot be read as a request gets ``response`` None and an ``error`` of its own (its
``custom_id`` when it has one, else None). Source: OpenAI's Batch API reference (the input and output
file formats) and vLLM's ``entrypoints/openai/run_batch.py``.
"""

from __future__ import annotations

import json
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError

#: the routes a batch line may name (OpenAI's Batch API takes these three; vLLM adds score and rerank)
BATCH_URLS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/score", "/v1/rerank")


class BatchRequestInput(BaseModel):
    """One input line. Raises ``ValidationError`` for a missing or mistyped field, an unknown ``url``, a
    method other than POST, or a field OpenAI's format does not have."""

    model_config = ConfigDict(extra="forbid")

    custom_id: str
    method: Literal["POST"]
    url: Literal[BATCH_URLS]
    body: dict[str, Any]


class BatchResponseData(BaseModel):
    status_code: int = 200
    request_id: str
    body: dict[str, Any] | None = None


class BatchRequestOutput(BaseModel):
    """One output line (see the module's docstring)."""

    id: str
    custom_id: str | None
    response: BatchResponseData | None
    error: dict[str, Any] | None


def batch_request_id() -> str:
    return f"batch_req_{uuid.uuid4().hex}"


def parse_line(line: str) -> tuple[BatchRequestInput | None, BatchRequestOutput | None]:
    """``(request, None)`` for a good line, ``(None, error line)`` for a bad one: not JSON, not an object,
    or failing ``BatchRequestInput`` (the error names the field); a ``stream`` body is refused, as a batch
    line has no stream to write to."""
    try:
        raw = json.loads(line)
    except json.JSONDecodeError as e:
        return None, error_line(None, f"the line is not JSON: {e}", "invalid_json")
    custom_id = raw.get("custom_id") if isinstance(raw, dict) else None
    custom_id = custom_id if isinstance(custom_id, str) else None
    try:
        req = BatchRequestInput.model_validate(raw)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "line"
        return None, error_line(custom_id, f"{where}: {first['msg']}", "invalid_request", param=where)
    if req.body.get("stream"):
        return None, error_line(custom_id, "body.stream: a batch line cannot stream", "invalid_request", "body.stream")
    return req, None


def error_line(custom_id: str | None, message: str, code: str, param: str | None = None) -> BatchRequestOutput:
    """The line of a request that did not reach its route."""
    error = {"message": message, "type": "invalid_request_error", "param": param, "code": code}
    return BatchRequestOutput(id=batch_request_id(), custom_id=custom_id, response=None, error=error)


def response_line(custom_id: str, status: int, body: Any, request_id: str) -> BatchRequestOutput:
    """The line of a request its route answered with HTTP ``status`` and JSON ``body``."""
    response = BatchResponseData(status_code=status, request_id=request_id, body=body if status == 200 else None)
    error = None
    if status != 200:
        error = body.get("error") if isinstance(body, dict) and isinstance(body.get("error"), dict) else None
        error = error or {"message": str(body), "type": "server_error", "param": None, "code": None}
    return BatchRequestOutput(id=batch_request_id(), custom_id=custom_id, response=response, error=error)
