"""The app's start-up and clean-up hooks (``app.create_app``) and the loaders they run.

At start-up the app gets its engine: one given (``use_engine``), or the model loaded in a daemon thread
(``load_model``; ``/health`` and the generation routes answer 503 meanwhile, and a failed load is kept for
``/health`` and ends ``launcher.serve``). The ``--lora-modules`` adapters are loaded into it before it serves
(``add_static_loras``; one that cannot be loaded fails the start). At clean-up an engine the app started is
closed.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
import time
from collections.abc import Callable

from aiohttp import web

from rawpaged.config import EngineConfig
from rawpaged.engine.async_engine import AsyncEngine
from rawpaged.engine.data_parallel import DataParallelEngine
from rawpaged.engine.llm_engine import LLMEngine
from rawpaged.entrypoints.server.startup import load_engine
from rawpaged.entrypoints.server.state import STATE, AppState
from rawpaged.weights import resolve_model_dir

logger = logging.getLogger("rawpaged.server")


def default_loader(
    config: EngineConfig,
    data_parallel_size: int = 1,
    ray_address: str | None = None,
    report: Callable[[str], None] | None = None,
) -> Callable:
    """The loader of ``config``'s model: ``load_engine`` (telling ``report`` each phase it starts), or
    ``load_replicas`` with ``data_parallel_size`` > 1."""
    if data_parallel_size > 1:
        return functools.partial(load_replicas, config, data_parallel_size, ray_address)
    return functools.partial(load_engine, config, report)


def load_replicas(config: EngineConfig, data_parallel_size: int, ray_address: str | None) -> DataParallelEngine:
    """``data_parallel_size`` Ray replicas of ``config``'s model (``ray_address``: a running cluster)."""
    if ray_address is None:  # one machine: prepare the default model once, here, not in each replica
        resolve_model_dir(config.model, config.revision, config.gguf_file)
    return DataParallelEngine(config, data_parallel_size, ray_address)


async def use_engine(engine, app: web.Application) -> None:
    """Start-up hook with an engine given: an ``AsyncEngine`` served as it is (its owner closes it), an
    ``LLMEngine`` wrapped in one."""
    state = _starting(app)
    if isinstance(engine, AsyncEngine):
        for lora in state.loras.static:
            await engine.add_lora(lora)
        state.engine, state.owns_engine = engine, False
    else:
        add_static_loras(state, engine)
        state.engine = AsyncEngine(engine, metrics=state.metrics)


def add_static_loras(state: AppState, engine: LLMEngine) -> None:
    """Load the ``--lora-modules`` adapters into ``engine`` (before it serves). Raises ValueError naming
    the adapter and the field for one that cannot be loaded (or LoRA off)."""
    for lora in state.loras.static:
        engine.add_lora(lora)
        logger.info("LoRA adapter %r served from %s", lora.lora_name, lora.lora_path)


async def load_model(app: web.Application) -> None:
    """Start-up hook without an engine: ``state.loader`` runs in a daemon thread (a hung or slow load
    never blocks shutdown); its engine, or the first line of its error, comes back to the event loop."""
    state = _starting(app)
    loop = asyncio.get_running_loop()
    threading.Thread(target=_load, args=(state, loop), name="rawpaged-load", daemon=True).start()


async def close_engine(app: web.Application) -> None:
    """Clean-up hook: the engine closed, unless it was given as an ``AsyncEngine``."""
    state = app[STATE]
    if state.engine is not None and state.owns_engine:
        await state.engine.close()


def _starting(app: web.Application) -> AppState:
    state = app[STATE]
    state.failed = asyncio.Event()
    state.load_started = time.monotonic()
    return state


def _load(state: AppState, loop: asyncio.AbstractEventLoop) -> None:
    try:
        result, error = state.loader(), None
        if isinstance(result, LLMEngine):
            add_static_loras(state, result)
    except BaseException as e:  # noqa: BLE001
        logger.debug("model load failed", exc_info=True)
        lines = str(e).strip().splitlines()
        result, error = None, (lines[0] if lines else type(e).__name__)
    try:
        loop.call_soon_threadsafe(_loaded, state, result, error)
    except RuntimeError:  # the loop is gone
        pass


def _loaded(state: AppState, result, error: str | None) -> None:
    """On the event loop: the loaded engine served, or the load's error kept."""
    if error is not None:
        state.load_error = error
        state.failed.set()
        return
    if not isinstance(result, LLMEngine):  # a front end over replicas
        result.request_stats.metrics = state.metrics
        state.engine = result
        logger.info(
            "ready: model %s on %d replicas in %.1fs (KV blocks of %d tokens, max_model_len %d)",
            state.model_name,
            result.data_parallel_size,
            time.monotonic() - state.load_started,
            result.block_size,
            result.max_model_len,
        )
        return
    state.engine = AsyncEngine(result, metrics=state.metrics)
    spec = result.config.speculative_config
    logger.info(
        "ready: model %s loaded and warmed up in %.1fs on %s (%s, KV cache %s: %d blocks of %d "
        "tokens, max_model_len %d, speculative decoding %s)",
        state.model_name,
        time.monotonic() - state.load_started,
        result.backend.name,
        result.dtype,
        result.kv_cache_dtype,
        result.kv_cache_manager.num_blocks,
        result.config.block_size,
        result.max_model_len,
        f"{spec.method}, k={spec.num_speculative_tokens}" if spec is not None else "off",
    )
