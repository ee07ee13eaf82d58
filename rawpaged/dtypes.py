"""The one table of element types: each float type's engine name (``--dtype``, ``--kv-cache-dtype``),
NumPy host dtype, safetensors code, C++ type in ``cuda/*.cu`` and CuPy storage dtype, side by side.

CuPy has no bfloat16: on the device a bfloat16 array is ``uint16`` holding the bit patterns; on the host it
is ``ml_dtypes.bfloat16``.
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
