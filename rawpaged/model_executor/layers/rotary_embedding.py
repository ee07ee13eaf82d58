"""RoPE and its context-extension variants, read from ``config.json`` and computed once at load.

Rotary position embedding (Su et al. 2021, RoFormer, eq. 34): dimension pair i of a head rotates by
``position * inv_freq[i]`` with ``inv_freq[i] = theta^(-2i / head_dim)``. The variants change only
``inv_freq`` (and, for YaRN, scale cos and sin by an attention factor), so every variant becomes one
``[max_position, head_dim]`` cos/sin table that both backends' ``rotary_embedding`` kernels read.

Formulas as HF transformers computes them (``modeling_rope_utils.py``, ``ROPE_INIT_FUNCTIONS``), here in
float64:

- ``default``: the formula above.
- ``linear`` (position interpolation, Chen et al. 2023): ``inv_freq / factor``.
- ``dynamic`` (NTK-aware, /u/bloc97 and /u/emozilla 2023): theta becomes
  ``theta * (factor * L / L0 - (factor - 1)) ** (d / (d - 2))`` for a sequence length L beyond the
  original context L0. HF recomputes it as a running sequence grows; here it is computed once for
  ``L = max(max_model_len, L0)`` (as vLLM does). It equals HF exactly when ``max_model_len <= L0``, and for
  a sequence of ``max_model_len`` tokens run in one pass.
- ``yarn`` (Peng et al. 2023, YaRN, eqs. 17-23): a per-dimension ramp between interpolated and
  extrapolated frequencies, between the dimensions that rotate ``beta_fast`` and ``beta_slow`` times in
  the original context, and cos/sin scaled by ``0.1 ln(factor) + 1`` (or the ``mscale`` ratio, or an
  explicit ``attention_factor``).
- ``llama3`` (Llama 3.1, Meta 2024): wavelengths above ``L0 / low_freq_factor`` are divided by
  ``factor``, those below ``L0 / high_freq_factor`` kept, and the band between interpolated smoothly.

Config forms: ``rope_scaling`` (``type`` or ``rope_type``, with ``rope_theta`` beside it) and
transformers v5's ``rope_parameters`` (``rope_type`` and ``rope_theta`` inside). Any other type, a
partial rotary dimension, or per-layer-type parameters raise ``ValueError`` naming them.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np

ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3")


def _rope_params(cfg: dict, source: str) -> tuple:
    """(the RoPE parameters of an HF config dict, ``rope_theta`` included, and the field they came from).

    Raises ValueError for parameters that are not an object, per-layer-type parameters, or a
    ``partial_rotary_factor`` other than 1."""
    partial = cfg.get("partial_rotary_factor", 1.0)
    params = cfg.get("rope_parameters")
    where = "rope_parameters"
    if params is None:
        params, where = dict(cfg.get("rope_scaling") or {}), "rope_scaling"
        params.setdefault("rope_theta", cfg.get("rope_theta", 10000.0))
    if not isinstance(params, dict):
        raise ValueError(f"{source}: {where} must be an object, got {params!r}")
    if params and all(isinstance(v, dict) for v in params.values()):
        raise ValueError(f"{source}: per-layer-type {where} ({sorted(params)}) are not supported")
    partial = params.get("partial_rotary_factor", partial)
    if partial not in (None, 1, 1.0):
        raise ValueError(f"{source}: partial_rotary_factor {partial} is not supported (only 1.0)")
    return params, where


def _positive(params: dict, where: str, rope_type: str, name: str, default=None, required: bool = False):
    """``params[name]``, a positive number, or ``default`` where it is absent (None).

    Raises ValueError naming ``where`` and the field: absent but ``required``, or not a positive number."""
    value = params.get(name)
    if value is None:
        if required:
            raise ValueError(f"{where}.{name} is required for rope_type {rope_type!r}")
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{where}.{name} must be a positive number, got {value!r}")
    return value


@dataclass(frozen=True)
class RopeScaling:
    """One model's RoPE: its type, theta and the type's parameters (None where the type has none)."""

    rope_type: str = "default"
    theta: float = 10000.0
    factor: float = 1.0
    original_max_position_embeddings: int | None = None
    low_freq_factor: float | None = None
    high_freq_factor: float | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True

    @classmethod
    def from_hf_config(cls, cfg: dict, source: str = "config.json") -> RopeScaling:
        """Read ``rope_parameters`` or ``rope_scaling`` (+ ``rope_theta``) of an HF config dict.

        Raises:
            ValueError naming the file and the field: an unsupported ``rope_type``, a missing or
            non-positive parameter, ``partial_rotary_factor`` other than 1, per-layer-type parameters.
        """
        params, where = _rope_params(cfg, source)
        rope_type = params.get("rope_type") or params.get("type") or "default"
        if rope_type not in ROPE_TYPES:
            raise ValueError(f"{source}: {where}.rope_type {rope_type!r} is not supported (supported: {ROPE_TYPES})")
        num = functools.partial(_positive, params, f"{source}: {where}", rope_type)
        theta = float(num("rope_theta", 10000.0))
        if rope_type == "default":
            return cls(theta=theta)
        original = num("original_max_position_embeddings")
        original = int(original) if original is not None else None
        if rope_type == "yarn":
            factor = num("factor")
            if factor is None:  # transformers derives it from the two context lengths
                if original is None:
                    raise ValueError(f"{source}: {where}.factor is required for rope_type 'yarn'")
                factor = int(cfg.get("max_position_embeddings", 2048)) / original
            return cls(
                "yarn",
                theta,
                float(factor),
                original,
                beta_fast=float(num("beta_fast", 32.0)),
                beta_slow=float(num("beta_slow", 1.0)),
                attention_factor=num("attention_factor"),
                mscale=num("mscale"),
                mscale_all_dim=num("mscale_all_dim"),
                truncate=bool(params.get("truncate", True)),
            )
        factor = float(num("factor", required=True))
        if rope_type == "llama3":
            low = float(num("low_freq_factor", required=True))
            high = float(num("high_freq_factor", required=True))
            if not high > low:
                raise ValueError(f"{source}: {where}.high_freq_factor ({high}) must exceed low_freq_factor ({low})")
            original = int(num("original_max_position_embeddings", required=True))
            return cls("llama3", theta, factor, original, low_freq_factor=low, high_freq_factor=high)
        return cls(rope_type, theta, factor, original)

    def context_len(self, max_position_embeddings: int) -> int:
        """The longest sequence the model serves: ``max_position_embeddings``, times ``factor`` for the
        types that stretch a shorter trained context (``linear``, ``dynamic``; ``yarn`` from its original
        context), as vLLM derives ``max_model_len``. ``llama3`` configs already give the long context."""
        if self.rope_type in ("linear", "dynamic"):
            return int(max_position_embeddings * self.factor)
        if self.rope_type == "yarn":
            return int((self.original_max_position_embeddings or max_position_embeddings) * self.factor)
        return max_position_embeddings

    def inv_freq(self, head_dim: int, max_position_embeddings: int, max_model_len: int) -> tuple:
        """(float64 ``[head_dim // 2]`` inverse frequencies in radians per position, attention factor).

        ``max_position_embeddings`` is the config's; ``max_model_len`` the engine's (``dynamic`` only)."""
        d = head_dim
        exponents = np.arange(0, d, 2, dtype=np.float64) / d
        base = self.theta
        if self.rope_type == "dynamic":
            trained = self.original_max_position_embeddings or max_position_embeddings
            seq_len = max(max_model_len, trained)
            base = base * (self.factor * seq_len / trained - (self.factor - 1)) ** (d / (d - 2))
        inv = base**-exponents
        if self.rope_type == "linear":
            return inv / self.factor, 1.0
        if self.rope_type == "llama3":
            return self._llama3(inv), 1.0
        if self.rope_type == "yarn":
            return self._yarn(inv, d, max_position_embeddings)
        return inv, 1.0

    def _llama3(self, inv: np.ndarray) -> np.ndarray:
        L0, lo, hi = self.original_max_position_embeddings, self.low_freq_factor, self.high_freq_factor
        wavelen = 2 * math.pi / inv
        smooth = (L0 / wavelen - lo) / (hi - lo)
        out = np.where(wavelen > L0 / lo, inv / self.factor, inv)  # long wavelengths: interpolate
        band = (wavelen >= L0 / hi) & (wavelen <= L0 / lo)
        return np.where(band, (1 - smooth) * inv / self.factor + smooth * inv, out)

    def _yarn(self, inv: np.ndarray, d: int, max_position_embeddings: int) -> tuple:
        L0 = self.original_max_position_embeddings or max_position_embeddings

        def mscale(scale, m=1.0):
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

        attention = self.attention_factor
        if attention is None:
            if self.mscale and self.mscale_all_dim:
                attention = mscale(self.factor, self.mscale) / mscale(self.factor, self.mscale_all_dim)
            else:
                attention = mscale(self.factor)

        def dim_of(rotations):  # the dimension whose wavelength fits ``rotations`` times into L0
            return d * math.log(L0 / (rotations * 2 * math.pi)) / (2 * math.log(self.theta))

        low, high = dim_of(self.beta_fast), dim_of(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, d - 1)
        if low == high:
            high += 0.001
        ramp = np.clip((np.arange(d // 2, dtype=np.float64) - low) / (high - low), 0.0, 1.0)
        extrapolate = 1.0 - ramp  # 1: keep the trained frequency; 0: interpolate by factor
        return inv / self.factor * ramp + inv * extrapolate, float(attention)


def cos_sin_cache(inv_freq: np.ndarray, attention_factor: float, max_position: int) -> np.ndarray:
    """float32 ``[max_position, head_dim]`` = concat(cos, sin) of ``pos * inv_freq``, both times
    ``attention_factor`` (HF multiplies cos and sin by it), computed in float64: the table both
    backends' ``rotary_embedding`` take."""
    angles = np.arange(max_position, dtype=np.float64)[:, None] * np.asarray(inv_freq, np.float64)[None, :]
    return (np.concatenate([np.cos(angles), np.sin(angles)], axis=-1) * attention_factor).astype(np.float32)
