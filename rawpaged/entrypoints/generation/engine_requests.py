"""Step 3 of a generation request: the prepared prompts (``preprocessing``) submitted to the engine, one
engine request per prompt, and aborted again when the answer is done (a no-op for finished requests; frees
the blocks of a client that left)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from rawpaged.engine.engine_client import EngineClient
from rawpaged.entrypoints.http.errors import ProtocolError
from rawpaged.errors import InvalidRequestError


async def add_requests(
    engine: EngineClient, req, prompts: list, base_id: str, log_label: str | None = None, lora_request=None
) -> list:
    """One engine request per prompt (ids ``base_id``, or ``base_id-i`` for several), each with the LoRA
    adapter ``lora_request`` (``admission.lora_request_of``; None: the base model); their streams
    (``RequestStream``), in order. On any failure every request added so far is aborted; the engine's
    ``InvalidRequestError`` becomes a ProtocolError naming the client's field. ``log_label`` is added to
    their log lines."""
    streams = []
    lora = {"lora_request": lora_request} if lora_request is not None else {}
    try:
        for i, p in enumerate(prompts):
            rid = base_id if len(prompts) == 1 else f"{base_id}-{i}"
            prompt = {"prompt_token_ids": p.ids, "prompt": p.text}
            streams.append(await engine.add_request(prompt, p.params, rid, log_label=log_label, **lora))
    except BaseException as e:
        for s in streams:
            engine.abort(s.request_id)
        if isinstance(e, InvalidRequestError):
            if e.param == "prompt":
                raise ProtocolError(str(e), param=req.prompt_param) from None
            raise req.client_error(e) from None
        raise
    return streams


@contextlib.asynccontextmanager
async def submitted(engine: EngineClient, req, prompts: list, base_id: str, lora_request=None) -> AsyncIterator[list]:
    """``add_requests``' streams for the body of the ``async with``; every request is aborted when it ends,
    however it ends."""
    streams = await add_requests(engine, req, prompts, base_id, lora_request=lora_request)
    try:
        yield streams
    finally:
        for s in streams:
            engine.abort(s.request_id)
