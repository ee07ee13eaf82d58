"""Loading a model for serving or generating: ``load_engine`` runs the start-up ``PHASES``, each logged
as it starts and ends with its seconds (logger ``rawpaged.startup``), so a first run that downloads,
converts and compiles says what it is doing. ``rawpaged serve`` and ``rawpaged generate`` share it."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable

from rawpaged.config import EngineConfig
from rawpaged.engine.llm_engine import LLMEngine
from rawpaged.weights import resolve_model_dir

logger = logging.getLogger("rawpaged.startup")

#: the start-up phases ``load_engine`` reports, in order, with what each does (logged as it starts)
PHASES = {
    "weights": "download and convert the weights if they are not on disk yet",
    "load": "read the weights and build the engine and its KV cache",
    "warm-up": "compile every kernel, or load it from Numba's cache, by running short requests",
}


@contextlib.contextmanager
def startup_phase(name: str, report: Callable[[str], None] | None = None):
    """Log the start of phase ``name`` (one of ``PHASES``) and, at its end, its seconds; ``report(name)``
    first (``/health`` shows the phase)."""
    if report is not None:
        report(name)
    logger.info("start-up: %s (%s)...", name, PHASES[name])
    t0 = time.monotonic()
    yield
    logger.info("start-up: %s took %.1fs", name, time.monotonic() - t0)


def load_engine(config: EngineConfig, report: Callable[[str], None] | None = None) -> LLMEngine:
    """``LLMEngine(config)``, warmed up (its kernels compiled or loaded from their cache), through the
    ``PHASES``, each logged with its time and told to ``report`` as it starts. The default model, where
    it is not prepared yet, is downloaded and converted with progress bars on stderr.

    Raises:
        ValueError or RuntimeError, as ``resolve_model_dir``, ``LLMEngine`` and ``warmup`` do.
    """
    with startup_phase("weights", report):
        resolve_model_dir(config.model, config.revision, config.gguf_file)
    with startup_phase("load", report):
        engine = LLMEngine(config)
    with startup_phase("warm-up", report):
        engine.warmup()
    return engine
