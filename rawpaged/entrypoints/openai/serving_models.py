"""``GET /v1/models``: the one served model, under the name clients send as ``model``."""

from __future__ import annotations

from aiohttp import web

from rawpaged.entrypoints.app_state import STATE
from rawpaged.entrypoints.http_responses import json_response
from rawpaged.entrypoints.openai.response_builders import models_response


async def show_available_models(request: web.Request) -> web.Response:
    """``GET /v1/models``: ``{"object": "list", "data": [model card]}``."""
    state = request.app[STATE]
    max_len = state.engine.max_model_len if state.engine is not None else None
    return json_response(models_response(state.model_name, state.created, max_len))
