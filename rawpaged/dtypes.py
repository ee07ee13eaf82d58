"""The one table of element types: each float type's engine name (``--dtype``, ``--kv-cache-dtype``),
NumPy host dtype, safetensors code, C++ type in ``cuda/*.cu`` and CuPy storage dtype, side by side; and
the quantized KV-cache types (``--kv-cache-dtype int8`` / ``fp8_e4m3``).

CuPy has no bfloat16: on the device a bfloat16 array is ``uint16`` holding the bit patterns; on the host it
is ``ml_dtypes.bfloat16``. NumPy has no fp8: an fp8 E4M3 cache holds its bit patterns as ``uint8`` on both
sides (``ml_dtypes.float8_e4m3fn`` gives their values).
"""

from __future__ import annotations

from dataclasses import dataclass

import ml_dtypes
import numpy as np


@dataclass(frozen=True)
class FloatType:
    name: str
    numpy: np.dtype
    safetensors: str
    cxx: str
    device: np.dtype


FLOAT32 = FloatType("float32", np.dtype(np.float32), "F32", "float", np.dtype(np.float32))
FLOAT16 = FloatType("float16", np.dtype(np.float16), "F16", "__half", np.dtype(np.float16))
BFLOAT16 = FloatType("bfloat16", np.dtype(ml_dtypes.bfloat16), "BF16", "__nv_bfloat16", np.dtype(np.uint16))

#: Engine name -> float type.
FLOAT_TYPES = {t.name: t for t in (FLOAT32, FLOAT16, BFLOAT16)}
#: What ``dtype``/``kv_cache_dtype`` accept: "auto" (resolved per backend) or a float type's name.
DTYPE_CHOICES = ("auto", *FLOAT_TYPES)
#: safetensors header code -> NumPy dtype, for every code a checkpoint may hold.
SAFETENSORS_DTYPES = {t.safetensors: t.numpy for t in FLOAT_TYPES.values()} | {
    "F64": np.dtype(np.float64),
    "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32),
}


def float_type(name: str) -> FloatType:
    """The float type named ``name``. Raises ValueError for any other name."""
    try:
        return FLOAT_TYPES[name]
    except KeyError:
        raise ValueError(f"dtype must be one of {sorted(FLOAT_TYPES)}, got {name!r}") from None


def float_type_of(dtype) -> FloatType | None:
    """The float type whose NumPy host dtype is ``dtype``, or None (float64, integers)."""
    return next((t for t in FLOAT_TYPES.values() if t.numpy == np.dtype(dtype)), None)


def numpy_dtype(name: str) -> np.dtype:
    """The NumPy host dtype of the float type ``name`` (``ml_dtypes.bfloat16`` for bfloat16)."""
    return float_type(name).numpy


@dataclass(frozen=True)
class QuantizedKVType:
    """A quantized KV-cache element type. Each (token, KV head) row of ``head_dim`` values is stored as
    ``storage`` elements ``q`` and one float32 ``scale``: ``x ~= value(q) * scale``, with
    ``scale = max|x| / qmax`` (1 for an all-zero row), so the row's largest magnitude maps to ``qmax``.

    int8: ``q = clamp(rint(x / scale), -127, 127)`` (llama.cpp's ``q8_0`` cache type, with one scale per
    row of ``head_dim`` rather than per 32 values). fp8_e4m3: ``q`` is ``x / scale`` rounded to the nearest
    E4M3 value (OCP FP8 ``e4m3fn``: 3 mantissa bits, largest 448, no infinities), stored as its bits (vLLM's
    ``fp8_e4m3``, which has one scale per tensor instead).
    """

    name: str
    storage: np.dtype
    qmax: float
    cxx: str  # the C++ storage type in cuda/*.cu

    def row_bytes(self, head_dim: int) -> int:
        """Bytes of one (token, KV head) row: the values and their float32 scale."""
        return head_dim * self.storage.itemsize + 4


INT8 = QuantizedKVType("int8", np.dtype(np.int8), 127.0, "signed char")
FP8_E4M3 = QuantizedKVType("fp8_e4m3", np.dtype(np.uint8), 448.0, "rp::fp8_e4m3")
#: Engine name -> quantized KV-cache type.
QUANTIZED_KV_TYPES = {t.name: t for t in (INT8, FP8_E4M3)}
#: Other names ``--kv-cache-dtype`` takes for them (vLLM's ``fp8`` is E4M3).
KV_CACHE_DTYPE_ALIASES = {"fp8": "fp8_e4m3"}
#: What ``kv_cache_dtype`` accepts.
KV_CACHE_DTYPE_CHOICES = (*DTYPE_CHOICES, *QUANTIZED_KV_TYPES, *KV_CACHE_DTYPE_ALIASES)
#: The value of every fp8 E4M3 bit pattern (index: the uint8 bits), float32; 0x7F and 0xFF are NaN.
FP8_E4M3_VALUES = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)


def kv_cache_type(name: str) -> FloatType | QuantizedKVType:
    """The float or quantized type of a KV cache named ``name`` (an alias resolved). Raises ValueError
    naming ``kv_cache_dtype`` for any other name."""
    name = KV_CACHE_DTYPE_ALIASES.get(name, name)
    if name in QUANTIZED_KV_TYPES:
        return QUANTIZED_KV_TYPES[name]
    if name in FLOAT_TYPES:
        return FLOAT_TYPES[name]
    raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPE_CHOICES}, got {name!r}")


def kv_row_bytes(kv_cache_dtype: str, head_dim: int) -> int:
    """Bytes one (token, KV head) row of K (or of V) takes in a cache of ``kv_cache_dtype``, scales included."""
    t = kv_cache_type(kv_cache_dtype)
    if isinstance(t, QuantizedKVType):
        return t.row_bytes(head_dim)
    return head_dim * t.numpy.itemsize
