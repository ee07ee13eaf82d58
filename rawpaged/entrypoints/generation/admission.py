"""Whether a generation request may run now: the model it names is served (else 404), the model has
loaded (else 503), and the engine's queue has room (else 503 with ``Retry-After``)."""

from __future__ import annotations

from rawpaged.engine.engine_client import EngineClient
from rawpaged.entrypoints.http.errors import ProtocolError
from rawpaged.entrypoints.server.state import AppState


def admit(state: AppState, model: str | None) -> EngineClient:
    """The engine to run one request for ``model`` on (``check_model``, ``require_engine``,
    ``check_capacity``). Raises ProtocolError."""
    check_model(state, model)
    engine = require_engine(state)
    check_capacity(state, engine)
    return engine


def require_engine(state: AppState) -> EngineClient:
    """The engine, or a 503 while the model loads (or after it failed to)."""
    if state.engine is None:
        msg = f"the model failed to load: {state.load_error}" if state.load_error else "the model is loading"
        raise ProtocolError(msg, status=503, type="service_unavailable_error")
    return state.engine


def check_capacity(state: AppState, engine: EngineClient, num_requests: int = 1) -> None:
    """A 503 with ``Retry-After`` when ``num_requests`` more would queue more than ``--max-queued-requests``
    beyond the requests the engine runs at once (``max_num_seqs``), or while the server drains."""
    if state.draining:
        raise ProtocolError(
            "the server is shutting down", status=503, type="service_unavailable_error", headers={"Retry-After": "5"}
        )
    limit = engine.max_num_seqs + state.server.max_queued_requests
    if engine.num_active_requests + num_requests > limit:
        raise ProtocolError(
            f"the server is at capacity: {engine.num_active_requests} requests in flight, at most {limit} "
            "(max_num_seqs running plus --max-queued-requests waiting); retry shortly",
            status=503,
            type="service_unavailable_error",
            headers={"Retry-After": "1"},
        )


def check_model(state: AppState, model: str | None) -> None:
    """A 404 for a ``model`` this server does not serve (None: the served model), naming what it serves:
    the base model and its LoRA adapters (``state.loras``)."""
    loras = state.loras.requests
    if model is not None and model not in state.model_aliases and model not in loras:
        adapters = f" and the LoRA adapters {', '.join(f'`{n}`' for n in loras)}" if loras else ""
        raise ProtocolError(
            f"The model `{model}` does not exist; this server serves `{state.model_name}`{adapters}.",
            param="model",
            status=404,
            type="invalid_request_error",
            code="model_not_found",
        )


def lora_request_of(state: AppState, model: str | None):
    """The ``LoRARequest`` a request's ``model`` names (None: the base model); a 404 as ``check_model`` for
    a name not served now. Call it just before the engine's ``add_request``, with no await between: from
    that call on the request counts as the adapter's user, and an unload is refused (409)."""
    check_model(state, model)
    return state.loras.get(model)


def served_model_name(state: AppState, model: str | None) -> str:
    """The ``model`` a response reports: the adapter's name for a request of a LoRA adapter (as vLLM),
    else the served model's."""
    return model if model in state.loras else state.model_name
