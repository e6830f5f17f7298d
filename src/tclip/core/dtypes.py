"""Which dtypes are floating, integral, complex — including the ml_dtypes ones.

bfloat16 and the float8 types come from ``ml_dtypes``; NumPy sees them as opaque
(kind ``'V'``), so ``np.issubdtype(x, np.floating)`` is False for them and every
check here asks ml_dtypes too.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

# Every narrow float type ml_dtypes provides in the installed version.
_ML_FLOAT_NAMES = (
    "bfloat16",
    "float8_e3m4",
    "float8_e4m3",
    "float8_e4m3b11fnuz",
    "float8_e4m3fn",
    "float8_e4m3fnuz",
    "float8_e5m2",
    "float8_e5m2fnuz",
    "float8_e8m0fnu",
    "float6_e2m3fn",
    "float6_e3m2fn",
    "float4_e2m1fn",
)
ML_FLOAT_TYPES: frozenset[type] = frozenset(
    getattr(ml_dtypes, name) for name in _ML_FLOAT_NAMES if hasattr(ml_dtypes, name)
)


def is_floating(dtype: np.dtype) -> bool:
    """True for real floating dtypes, ml_dtypes' bfloat16/float8 included."""
    dtype = np.dtype(dtype)
    return dtype.type in ML_FLOAT_TYPES or np.issubdtype(dtype, np.floating)


def is_complex(dtype: np.dtype) -> bool:
    return np.issubdtype(np.dtype(dtype), np.complexfloating)


def is_integral(dtype: np.dtype) -> bool:
    """True for signed and unsigned integers (not bool)."""
    return np.issubdtype(np.dtype(dtype), np.integer)


def is_bool(dtype: np.dtype) -> bool:
    return np.dtype(dtype) == np.bool_


def is_big_endian(dtype: np.dtype) -> bool:
    """Whether the bytes of each element are stored most significant first (never for ml_dtypes' types)."""
    dtype = np.dtype(dtype)
    if dtype.type in ML_FLOAT_TYPES:
        return False
    return dtype.byteorder == ">" or (dtype.byteorder == "=" and not np.little_endian)


def dtype_name(dtype: np.dtype) -> str:
    """A short readable name: 'float32', 'bfloat16', 'float8_e4m3fn', 'float32 (big-endian)'."""
    dtype = np.dtype(dtype)
    return f"{dtype.name} (big-endian)" if is_big_endian(dtype) else dtype.name


def real_dtype(dtype: np.dtype) -> np.dtype:
    """The dtype a norm of ``dtype`` values is returned in (complex64 -> float32)."""
    dtype = np.dtype(dtype)
    if is_complex(dtype):
        return np.empty(0, dtype).real.dtype
    return dtype
