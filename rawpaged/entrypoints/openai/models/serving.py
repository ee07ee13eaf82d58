"""``GET /v1/models`` and ``GET /v1/models/{model}``: the one served model, under the name clients send as
``model``."""

from __future__ import annotations

from aiohttp import web

from rawpaged.entrypoints.generation.admission import check_model
from rawpaged.entrypoints.generation.output_json import model_card, models_response
from rawpaged.entrypoints.http.json_reply import json_response
from rawpaged.entrypoints.server.state import STATE


def _max_len(state) -> int | None:
    return state.engine.max_model_len if state.engine is not None else None


async def show_available_models(request: web.Request) -> web.Response:
    """``GET /v1/models``: ``{"object": "list", "data": [model card]}``."""
    state = request.app[STATE]
    return json_response(models_response(state.model_name, state.created, _max_len(state)))


async def retrieve_model(request: web.Request) -> web.Response:
    """``GET /v1/models/{model}`` (the SDK's ``client.models.retrieve``): the model card, under the name
    asked for (the served name or an alias); any other name is a 404 in OpenAI's error shape
    (``model_not_found``)."""
    state = request.app[STATE]
    name = request.match_info["model"]
    check_model(state, name)
    return json_response(model_card(name, state.created, _max_len(state)))
