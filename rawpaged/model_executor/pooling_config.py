"""What a model directory says about pooling: a sentence-transformers model's ``modules.json`` and its
Pooling module's ``config.json`` (``1_Pooling/config.json``), and ``config.json``'s Matryoshka fields
(``is_matryoshka``, ``matryoshka_dimensions``), read as vLLM's ``get_pooling_config`` and
``ModelConfig.is_matryoshka`` read them. A GGUF file has none of them.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from rawpaged.pooling_params import PoolerConfig

logger = logging.getLogger(__name__)

#: sentence-transformers' pooling modes -> our pooling types
_ST_MODES = {"pooling_mode_cls_token": "CLS", "pooling_mode_mean_tokens": "MEAN", "pooling_mode_lasttoken": "LAST"}


def _read_json(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def get_pooling_config(model_dir) -> PoolerConfig | None:
    """The ``PoolerConfig`` a sentence-transformers directory describes, or None (no ``modules.json``, no
    Pooling module, or not a directory). The pooling type is the first mode set among CLS, MEAN and last
    token (other modes, such as max, are not computed here: a warning, and the type is left unset);
    ``normalize`` is whether a ``Normalize`` module is listed."""
    model_dir = Path(model_dir)
    modules = _read_json(model_dir / "modules.json") if model_dir.is_dir() else None
    if not isinstance(modules, list):
        return None
    types = [str(m.get("type", "")) for m in modules if isinstance(m, dict)]
    pooling = next((m for m in modules if isinstance(m, dict) and str(m.get("type", "")).endswith("Pooling")), None)
    if pooling is None:
        return None
    config = _read_json(model_dir / str(pooling.get("path", "")) / "config.json") or {}
    chosen = [kind for key, kind in _ST_MODES.items() if config.get(key)]
    others = sorted(k for k, v in config.items() if k.startswith("pooling_mode_") and v and k not in _ST_MODES)
    if others and not chosen:
        logger.warning("sentence-transformers pooling %s is not supported; pooling with LAST", others)
    normalize = any(t.endswith("Normalize") for t in types)
    return PoolerConfig(chosen[0] if chosen else None, normalize)


def matryoshka_dimensions(model_dir) -> tuple | None:
    """None when ``config.json`` does not say ``is_matryoshka`` (``dimensions`` is then refused); else its
    ``matryoshka_dimensions`` as a tuple, or ``()`` when it lists none (any size up to the hidden size)."""
    model_dir = Path(model_dir)
    config = _read_json(model_dir / "config.json") if model_dir.is_dir() else None
    if not isinstance(config, dict) or not (config.get("is_matryoshka") or config.get("matryoshka_dimensions")):
        return None
    return tuple(int(d) for d in config.get("matryoshka_dimensions") or ())
