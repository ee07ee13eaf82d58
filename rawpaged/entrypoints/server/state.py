"""The app's shared objects: one ``AppState`` per aiohttp application, under ``app[STATE]``, read by the
middleware, every route and the start-up and shutdown code. It holds the engine (None while the model
loads), the served model's names and LoRA adapters, the limits, the metrics, the connection gate and whether the server
drains."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from aiohttp import web

from rawpaged.engine.engine_client import EngineClient
from rawpaged.entrypoints.server.config import DEFAULT_MAX_BODY_SIZE, Limits, ServerConfig
from rawpaged.entrypoints.server.lora_registry import LoRARegistry
from rawpaged.entrypoints.server.metrics import ServerMetrics


@dataclass
class AppState:
    """What the middleware, the routes and the start-up and shutdown code share for one app."""

    model_name: str
    model_aliases: set  # the names a request's ``model`` may give (``admission.check_model``)
    loader: Callable | None  # () -> an engine, run in a thread at start-up (``lifecycle``); None: given one
    api_key: str | None = None
    limits: Limits = field(default_factory=Limits)
    max_body_size: int = DEFAULT_MAX_BODY_SIZE
    allowed_origins: tuple = ()
    engine: EngineClient | None = None
    owns_engine: bool = True  # closed at clean-up
    load_error: str | None = None
    failed: asyncio.Event | None = None  # set when the model failed to load (``launcher.serve`` exits)
    metrics: ServerMetrics = field(default_factory=ServerMetrics)
    created: int = field(default_factory=lambda: int(time.time()))  # the model card's ``created``
    load_started: float = 0.0
    phase: str | None = None  # the start-up phase under way while loading (``startup.PHASES``)
    server: ServerConfig = field(default_factory=ServerConfig)
    gate: object = None  # the ConnectionGate counting connections
    draining: bool = False  # shutting down: new requests get 503
    allowed_host_names: frozenset | None = None  # Host names accepted (None: any; ``hosts``)
    websockets: set = field(default_factory=set)  # open ``WebSocketSession``s (closed by the drain)
    reasoning_parser: str | None = None  # chat output's <think> split out (``generation.reasoning_parsers``)
    responses: object = None  # the Responses API's ``openai.responses.serving.ResponseStore``
    system_fingerprint: str | None = None  # chat and completions' ``system_fingerprint`` (``generation.fingerprint``)
    loras: LoRARegistry = field(default_factory=LoRARegistry)  # the served LoRA adapters, by name
    allow_runtime_lora_updating: bool = False  # /v1/load_lora_adapter and /v1/unload_lora_adapter answer


STATE = web.AppKey("rawpaged_state", AppState)
