"""``GET /v1/models`` and ``GET /v1/models/{model}``: the served model, under the name clients send as
``model``, and its LoRA adapters (``parent``: the base model, as vLLM lists them); vLLM's ``POST
/v1/load_lora_adapter`` and ``POST /v1/unload_lora_adapter``, which change the adapters while the server
runs when ``--allow-runtime-lora-updating`` is on (docs/lora.md, "Server")."""

from __future__ import annotations

import logging

from aiohttp import web

from rawpaged.entrypoints.generation.admission import check_model, require_engine
from rawpaged.entrypoints.generation.output_json import model_card, models_response
from rawpaged.entrypoints.generation.request_body import parse_request
from rawpaged.entrypoints.http.body import read_body
from rawpaged.entrypoints.http.errors import ProtocolError
from rawpaged.entrypoints.http.json_reply import json_response
from rawpaged.entrypoints.openai.models.protocol import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest
from rawpaged.entrypoints.server.state import STATE, AppState
from rawpaged.errors import InvalidRequestError, LoRAInUseError

logger = logging.getLogger("rawpaged.server")


def _max_len(state) -> int | None:
    return state.engine.max_model_len if state.engine is not None else None


def _adapters(state: AppState) -> list:
    """``(name, path, parent)`` of each served adapter, in the order they were added."""
    return [(n, r.lora_path, state.loras.parents[n]) for n, r in state.loras.requests.items()]


async def show_available_models(request: web.Request) -> web.Response:
    """``GET /v1/models``: ``{"object": "list", "data": [model card, adapter cards...]}``."""
    state = request.app[STATE]
    return json_response(models_response(state.model_name, state.created, _max_len(state), _adapters(state)))


async def retrieve_model(request: web.Request) -> web.Response:
    """``GET /v1/models/{model}`` (the SDK's ``client.models.retrieve``): the model card, under the name
    asked for (the served name, an alias or an adapter's name); any other name is a 404 in OpenAI's error
    shape (``model_not_found``)."""
    state = request.app[STATE]
    name = request.match_info["model"]
    check_model(state, name)
    lora = state.loras.get(name)
    root, parent = (lora.lora_path, state.loras.parents[name]) if lora is not None else (None, None)
    return json_response(model_card(name, state.created, _max_len(state), root, parent))


def _check_runtime_updating(state: AppState) -> None:
    """A 404 (the route is off, as vLLM has it without ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``) saying how to
    switch it on."""
    if not state.allow_runtime_lora_updating:
        raise ProtocolError(
            "runtime LoRA updating is off: start the server with --enable-lora --allow-runtime-lora-updating",
            status=404,
            type="NotFoundError",
        )


async def load_lora_adapter(request: web.Request) -> web.Response:
    """``POST /v1/load_lora_adapter`` ``{"lora_name", "lora_path"}``: the adapter loaded and checked
    (between steps; the running requests go on) and served as ``lora_name``; vLLM's plain-text
    ``Success: ...`` answer. Raises ProtocolError: 404 while runtime updating is off; 400 for a name served
    already (``lora_name``) or an adapter that cannot be loaded (``lora_path``: the message names the
    adapter and the field: a rank over ``--max-lora-rank``, a missing file, a shape or target module the
    base model lacks, LoRA off); 503 while the model loads."""
    state = request.app[STATE]
    _check_runtime_updating(state)
    req = parse_request(LoadLoRAAdapterRequest, await read_body(request), state.limits)
    engine = require_engine(state)
    try:
        lora = state.loras.new_request(req.lora_name, req.lora_path)
    except ValueError as e:
        raise ProtocolError(str(e), param="lora_name") from None
    state.loras.loading.add(lora.lora_name)
    try:
        await engine.add_lora(lora)
    except InvalidRequestError as e:
        raise ProtocolError(str(e), param="lora_path") from None
    finally:
        state.loras.loading.discard(lora.lora_name)
    state.loras.add(lora)
    logger.info("loaded LoRA adapter %r from %s (lora_int_id %d)", lora.lora_name, lora.lora_path, lora.lora_int_id)
    return web.Response(text=f"Success: LoRA adapter '{lora.lora_name}' added successfully.")


async def unload_lora_adapter(request: web.Request) -> web.Response:
    """``POST /v1/unload_lora_adapter`` ``{"lora_name", "lora_int_id"?}``: ``lora_name`` no longer served
    and its weights freed; vLLM's plain-text ``Success: ...`` answer. Raises ProtocolError: 404 while
    runtime updating is off or for a name not served (``lora_name``); 400 for a ``lora_int_id`` that is not
    the adapter's; 409 while requests in flight (queued, waiting or running) use it: they are never broken,
    and nothing changes (unload it again once they have finished)."""
    state = request.app[STATE]
    _check_runtime_updating(state)
    req = parse_request(UnloadLoRAAdapterRequest, await read_body(request), state.limits)
    lora = state.loras.get(req.lora_name)
    if lora is None:
        raise ProtocolError(
            f"The lora adapter '{req.lora_name}' cannot be found.", param="lora_name", status=404, type="NotFoundError"
        )
    if req.lora_int_id is not None and req.lora_int_id != lora.lora_int_id:
        raise ProtocolError(
            f"lora_int_id {req.lora_int_id} is not the id of adapter '{lora.lora_name}' ({lora.lora_int_id})",
            param="lora_int_id",
        )
    engine = require_engine(state)
    users = engine.num_lora_requests(lora.lora_int_id)
    if users:
        raise _in_use(lora.lora_name, users)
    parent = state.loras.parents[lora.lora_name]
    state.loras.remove(lora.lora_name)  # no await since the count: no request can pick it up from here on
    try:
        await engine.remove_lora(lora.lora_int_id)
    except LoRAInUseError as e:
        state.loras.add(lora, parent)
        raise _in_use(lora.lora_name, e.num_requests) from None
    logger.info("unloaded LoRA adapter %r (lora_int_id %d)", lora.lora_name, lora.lora_int_id)
    return web.Response(text=f"Success: LoRA adapter '{lora.lora_name}' removed successfully.")


def _in_use(name: str, users: int) -> ProtocolError:
    return ProtocolError(
        f"The lora adapter '{name}' is in use by {users} request(s) in flight; unload it once they have finished.",
        param="lora_name",
        status=409,
        type="conflict_error",
    )
