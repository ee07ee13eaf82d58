"""Pooling (embeddings): the engine's ``PoolerConfig`` (vLLM's ``--pooler-config``) and a request's
``PoolingParams`` (vLLM's names). A pooling request runs its prompt once (prefill only, no sampling) and
returns one vector made from the final-norm hidden states of its positions (docs/embeddings.md).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields, replace

#: pooling types this engine computes (vLLM's names): LAST, the last position's hidden state (the default
#: for decoder models); MEAN, the mean over every position; CLS, the first position's
POOLING_TYPES = ("LAST", "MEAN", "CLS")


def _check_pooling_type(value, where: str) -> str | None:
    """``value`` upper-cased, None kept; ValueError naming ``where`` for an unknown type."""
    if value is None:
        return None
    if not isinstance(value, str) or value.upper() not in POOLING_TYPES:
        raise ValueError(f"{where}.pooling_type must be one of {POOLING_TYPES}, got {value!r}")
    return value.upper()


@dataclass(frozen=True)
class PoolerConfig:
    """How pooling requests pool (vLLM's ``PoolerConfig``; ``--pooler-config '{"pooling_type": "MEAN"}'``).

    A field left None falls back to the model directory's sentence-transformers files (``modules.json``,
    ``1_Pooling/config.json``: their pooling mode, and normalization when a ``Normalize`` module is
    listed), then to LAST with normalization. Raises ValueError naming the field for a bad value.
    """

    pooling_type: str | None = None
    """LAST, MEAN or CLS (case-insensitive)"""
    normalize: bool | None = None
    """L2-normalize each vector (a request's ``normalize`` overrides it)"""

    def __post_init__(self):
        object.__setattr__(self, "pooling_type", _check_pooling_type(self.pooling_type, "pooler_config"))
        if self.normalize is not None and not isinstance(self.normalize, bool):
            raise ValueError(f"pooler_config.normalize must be true or false, got {self.normalize!r}")

    @classmethod
    def parse(cls, value) -> PoolerConfig | None:
        """From a ``PoolerConfig``, a dict, a JSON object string (the command line's form) or None. Raises
        ValueError naming the key for invalid JSON, an unknown key or a bad value."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"pooler_config is not valid JSON: {e}") from None
        if not isinstance(value, dict):
            raise ValueError(f"pooler_config must be a JSON object, got {type(value).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"pooler_config has unknown key(s) {unknown} (known: {sorted(known)})")
        return cls(**value)

    def merged(self, defaults: PoolerConfig | None) -> PoolerConfig:
        """This config with each unset field taken from ``defaults``, then LAST and normalization."""
        defaults = defaults or PoolerConfig()
        pooling_type = self.pooling_type or defaults.pooling_type or "LAST"
        normalize = self.normalize if self.normalize is not None else defaults.normalize
        return PoolerConfig(pooling_type, True if normalize is None else normalize)


@dataclass(frozen=True)
class PoolingParams:
    """A pooling request's options (vLLM's ``PoolingParams``).

    dimensions: keep the first ``dimensions`` values of the vector (before normalization), only for a model
        whose ``config.json`` says ``is_matryoshka`` (and, with ``matryoshka_dimensions``, one of those);
        else the engine refuses it (InvalidRequestError, param "dimensions"). None: the whole hidden size.
    normalize: L2-normalize the vector; None: the engine's ``PoolerConfig.normalize``.
    pooling_type: set by the engine from its ``PoolerConfig`` when it takes the request (a request cannot
        choose it, as in vLLM); None before.

    Raises ValueError naming the field for a bad value.
    """

    dimensions: int | None = None
    normalize: bool | None = None
    pooling_type: str | None = None

    def __post_init__(self):
        d = self.dimensions
        if d is not None and (isinstance(d, bool) or not isinstance(d, int) or d < 1):
            raise ValueError(f"dimensions must be an integer >= 1, got {d!r}")
        if self.normalize is not None and not isinstance(self.normalize, bool):
            raise ValueError(f"normalize must be true or false, got {self.normalize!r}")
        object.__setattr__(self, "pooling_type", _check_pooling_type(self.pooling_type, "pooling_params"))

    def resolved(self, config: PoolerConfig) -> PoolingParams:
        """These parameters with the engine's pooling type and, where unset, its normalization."""
        normalize = config.normalize if self.normalize is None else self.normalize
        return replace(self, normalize=normalize, pooling_type=config.pooling_type)

    @property
    def requires_all_positions(self) -> bool:
        """Whether the vector needs hidden states of positions before the last (MEAN, CLS): such a request
        takes nothing from the prefix cache (it computes its whole prompt, and still fills the cache)."""
        return self.pooling_type in ("MEAN", "CLS")
