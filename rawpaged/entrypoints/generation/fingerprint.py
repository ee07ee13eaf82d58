"""The ``system_fingerprint`` of chat and completions responses: one stable string per model and the engine
settings that change its outputs, as OpenAI's ``fp_`` plus hex digits."""

from __future__ import annotations

import hashlib
import json

from rawpaged.config import EngineConfig

#: the engine settings that change what a model outputs for a given request and seed
OUTPUT_SETTINGS = ("model", "revision", "dtype", "quantization", "kv_cache_dtype", "block_size")


def system_fingerprint(config: EngineConfig, model_name: str) -> str:
    """``"fp_"`` and 12 hex digits of a hash of ``model_name`` and ``config``'s ``OUTPUT_SETTINGS``: equal
    for servers of the same model and settings, different when one of them changes."""
    identity = {"name": model_name, **{k: getattr(config, k, None) for k in OUTPUT_SETTINGS}}
    digest = hashlib.sha256(json.dumps(identity, sort_keys=True, default=str).encode()).hexdigest()
    return "fp_" + digest[:12]
