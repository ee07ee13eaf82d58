"""The aiohttp application: ``create_app`` builds it from the route table (``ROUTES``), the request
middleware (``middleware``) and the start-up and clean-up hooks (``lifecycle``); ``launcher.serve`` runs it.

Routes: POST /v1/completions, POST /v1/chat/completions, POST /v1/responses, GET /v1/responses/{id}
and POST /v1/responses/{id}/cancel (OpenAI's Responses API), POST /v1/messages and POST
/v1/messages/count_tokens (Anthropic's Messages API, ``anthropic/``), POST /v1/embeddings, POST /v1/score
and POST /v1/rerank (also /score, /rerank, /v2/rerank: embeddings and their cosine scores, ``openai/``),
GET /v1/models (the model and its LoRA adapters), vLLM's POST /v1/load_lora_adapter and
/v1/unload_lora_adapter (``openai/models/``), and vLLM's tokenizer routes
POST /tokenize, POST /detokenize, GET /tokenizer_info (``openai/``), GET /v1/ws (``websocket``), GET
/health, GET /metrics, GET /v1/debug/stats, GET /v1/debug/kv_cache (``health``), and the playground page:
GET / and /static/ (``playground``). All but /health, /metrics and the playground's need the API key when
one is set (``middleware``). The protocol is described in docs/server.md.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from pathlib import Path

from aiohttp import web

from rawpaged.config import EngineConfig
from rawpaged.entrypoints import health
from rawpaged.entrypoints.anthropic.serving import count_tokens, create_message
from rawpaged.entrypoints.generation.fingerprint import system_fingerprint
from rawpaged.entrypoints.http import playground
from rawpaged.entrypoints.http.body import expect_handler
from rawpaged.entrypoints.http.connections import ConnectionGate
from rawpaged.entrypoints.http.middleware import add_cors_headers, request_middleware
from rawpaged.entrypoints.openai.chat_completion.serving import create_chat_completion
from rawpaged.entrypoints.openai.completion.serving import create_completion
from rawpaged.entrypoints.openai.embeddings.serving import create_embedding
from rawpaged.entrypoints.openai.models.serving import (
    load_lora_adapter,
    retrieve_model,
    show_available_models,
    unload_lora_adapter,
)
from rawpaged.entrypoints.openai.responses.serving import (
    ResponseStore,
    cancel_background_responses,
    cancel_response,
    create_response,
    retrieve_response,
)
from rawpaged.entrypoints.openai.score.serving import create_rerank, create_score
from rawpaged.entrypoints.openai.tokenize.serving import create_detokenize, create_tokenize, get_tokenizer_info
from rawpaged.entrypoints.server import lifecycle
from rawpaged.entrypoints.server.config import DEFAULT_MAX_BODY_SIZE, DEFAULT_MAX_TOKENS_LIMIT, Limits, ServerConfig
from rawpaged.entrypoints.server.lora_registry import LoRAModulePath, LoRARegistry, parse_lora_module
from rawpaged.entrypoints.server.state import STATE, AppState
from rawpaged.entrypoints.websocket.serving import websocket_handler
from rawpaged.weights import DEFAULT_MODEL
from rawpaged.weights.default_model import F32_GGUF_NAME, GGUF_NAME
from rawpaged.weights.hub import is_repo_id

#: every route but the playground's (``playground.add_routes``: its files are listed when the app is built)
ROUTES = (
    web.post("/v1/completions", create_completion, expect_handler=expect_handler),
    web.post("/v1/chat/completions", create_chat_completion, expect_handler=expect_handler),
    web.post("/v1/responses", create_response, expect_handler=expect_handler),
    web.get("/v1/responses/{response_id}", retrieve_response),
    web.post("/v1/responses/{response_id}/cancel", cancel_response),
    web.post("/v1/messages", create_message, expect_handler=expect_handler),
    web.post("/v1/messages/count_tokens", count_tokens, expect_handler=expect_handler),
    web.post("/v1/embeddings", create_embedding, expect_handler=expect_handler),
    *(web.post(p, create_score, expect_handler=expect_handler) for p in ("/v1/score", "/score")),
    *(web.post(p, create_rerank, expect_handler=expect_handler) for p in ("/v1/rerank", "/rerank", "/v2/rerank")),
    web.get("/v1/models", show_available_models),
    web.get("/v1/models/{model:.+}", retrieve_model),
    web.post("/v1/load_lora_adapter", load_lora_adapter, expect_handler=expect_handler),
    web.post("/v1/unload_lora_adapter", unload_lora_adapter, expect_handler=expect_handler),
    web.post("/tokenize", create_tokenize, expect_handler=expect_handler),
    web.post("/detokenize", create_detokenize, expect_handler=expect_handler),
    web.get("/tokenizer_info", get_tokenizer_info),
    web.get("/v1/ws", websocket_handler),
    web.get("/v1/debug/stats", health.debug_stats),
    web.get("/v1/debug/kv_cache", health.debug_kv_cache),
    web.get("/health", health.health),
    web.get("/metrics", health.metrics),
)


def model_name_of(config: EngineConfig) -> str:
    """The name clients use for ``config.model``: the default model's name (also for its kept Q4_1 or F32
    GGUF file), a Hub id as given (as vLLM), the directory's, or a GGUF file's without ``.gguf``."""
    if config.model is None:
        return DEFAULT_MODEL
    if is_repo_id(config.model):
        return config.model
    path = Path(config.model).expanduser()
    if path.name in (GGUF_NAME, F32_GGUF_NAME):
        return DEFAULT_MODEL
    return (path.stem if path.suffix == ".gguf" else path.name) or str(config.model)


def create_app(
    config: EngineConfig | None = None,
    *,
    engine=None,
    loader: Callable | None = None,
    served_model_name: str | Sequence[str] | None = None,
    api_key: str | None = None,
    max_tokens_limit: int | None = DEFAULT_MAX_TOKENS_LIMIT,
    max_body_size: int = DEFAULT_MAX_BODY_SIZE,
    max_n: int = 16,
    allowed_origins=(),
    data_parallel_size: int = 1,
    ray_address: str | None = None,
    server_config: ServerConfig | None = None,
    lora_modules: Sequence = (),
    allow_runtime_lora_updating: bool = False,
) -> web.Application:
    """The aiohttp application.

    The model comes from ``engine`` (an ``LLMEngine`` or ``AsyncEngine``, ready now), ``loader`` (a
    callable returning an ``LLMEngine``, run in a thread at startup) or ``config`` (``LLMEngine(config)``
    plus a warm-up, in a thread). While loading, ``/health`` answers 503 and generation routes 503.
    ``served_model_name``: the name, or names, clients may send as ``model`` (as vLLM's
    ``--served-model-name``: the first is the one responses and ``/v1/models`` report); default
    ``model_name_of(config)``. The model's own name and path are accepted too.
    ``allowed_origins``: origins (or ``"*"``) browsers may call from (``rawpaged.entrypoints.http.cors``).
    ``data_parallel_size`` > 1 serves ``config`` through that many Ray replicas
    (``rawpaged.engine.data_parallel``; ``ray_address`` joins a running cluster). ``server_config``: the
    timeouts and limits (``ServerConfig``'s defaults when None). ``lora_modules``: LoRA adapters served
    from the start (``LoRAModulePath``s or ``--lora-modules`` strings, ``name=path`` or JSON), loaded before
    the server reports ready (a bad one fails the start); ``allow_runtime_lora_updating`` switches on
    ``POST /v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` (docs/lora.md).

    Raises ValueError for a bad ``lora_modules`` entry, ``lora_modules`` with ``config`` but without
    ``enable_lora``, or ``enable_lora`` with ``data_parallel_size`` > 1 (not supported yet).
    """
    config = config or EngineConfig()
    default_loader = engine is None and loader is None
    server_config = server_config or ServerConfig()
    names = [served_model_name] if isinstance(served_model_name, str) else list(served_model_name or ())
    names = names or [model_name_of(config)]
    aliases = {*names, model_name_of(config)} | ({config.model} if config.model else set())
    loras = _lora_registry(config, engine, loader, lora_modules, data_parallel_size, names[0], aliases)
    state = AppState(
        model_name=names[0],
        model_aliases=aliases,
        loras=loras,
        allow_runtime_lora_updating=allow_runtime_lora_updating,
        loader=loader,
        api_key=api_key or None,
        limits=Limits(
            max_tokens=max_tokens_limit, max_n=max_n, reject_unknown_fields=server_config.reject_unknown_fields
        ),
        max_body_size=max_body_size,
        allowed_origins=tuple(allowed_origins or ()),
        server=server_config,
        reasoning_parser=config.reasoning_parser,
        responses=ResponseStore(),
        system_fingerprint=system_fingerprint(config, names[0]),
    )
    if default_loader:
        state.loader = lifecycle.default_loader(
            config, data_parallel_size, ray_address, report=functools.partial(setattr, state, "phase")
        )
    state.gate = ConnectionGate(server_config.max_connections, functools.partial(health.health_status, state))
    app = web.Application(client_max_size=max_body_size, middlewares=[request_middleware])
    app[STATE] = state
    app.add_routes(ROUTES)
    playground.add_routes(app)
    app.on_startup.append(lifecycle.load_model if engine is None else functools.partial(lifecycle.use_engine, engine))
    app.on_response_prepare.append(add_cors_headers)
    app.on_shutdown.append(cancel_background_responses)
    app.on_cleanup.append(lifecycle.close_engine)
    return app


def _lora_registry(config, engine, loader, lora_modules, data_parallel_size, name, aliases) -> LoRARegistry:
    """The served adapters of ``create_app``'s ``lora_modules`` (see its errors)."""
    modules = [m if isinstance(m, LoRAModulePath) else parse_lora_module(m) for m in lora_modules or ()]
    if modules and engine is None and loader is None and not config.enable_lora:
        raise ValueError("--lora-modules needs --enable-lora")
    if config.enable_lora and data_parallel_size > 1:
        raise ValueError("--enable-lora with --data-parallel-size > 1 is not supported yet")
    return LoRARegistry(modules, base_model_name=name, base_names=aliases)
