"""Dtype names used in the manifest, and their NumPy equivalents.

Names are stable strings (``"float32"``, ``"bfloat16"``). Bytes on disk are
always little-endian; a big-endian array is byte-swapped when saved.
"""

from __future__ import annotations

import numpy as np

__all__ = ["DTYPE_NAMES", "dtype_from_name", "dtype_name", "itemsize_of"]

_STANDARD = [
    "bool",
    "int8", "int16", "int32", "int64",
    "uint8", "uint16", "uint32", "uint64",
    "float16", "float32", "float64",
    "complex64", "complex128",
]
_ML_DTYPES = [
    "bfloat16",
    "float8_e3m4", "float8_e4m3", "float8_e4m3b11fnuz", "float8_e4m3fn", "float8_e4m3fnuz",
    "float8_e5m2", "float8_e5m2fnuz", "float8_e8m0fnu",
    "float6_e2m3fn", "float6_e3m2fn", "float4_e2m1fn",
    "int2", "int4", "uint2", "uint4",
]


def _build() -> dict[str, np.dtype]:  # type: ignore[type-arg]
    table: dict[str, np.dtype] = {n: np.dtype(n) for n in _STANDARD}  # type: ignore[type-arg]
    try:
        import ml_dtypes
    except ImportError:  # pragma: no cover - ml_dtypes is a core dependency
        return table
    for n in _ML_DTYPES:
        t = getattr(ml_dtypes, n, None)
        if t is not None:
            table[n] = np.dtype(t)
    return table


_BY_NAME = _build()
_BY_DTYPE = {dt: name for name, dt in _BY_NAME.items()}

#: Every dtype name this statestream can read and write.
DTYPE_NAMES = frozenset(_BY_NAME)


def dtype_name(dtype: np.dtype) -> str | None:  # type: ignore[type-arg]
    """Return the manifest name of a NumPy dtype, or None if unsupported.

    Example:
        >>> dtype_name(np.dtype(">f4"))
        'float32'
    """
    dt = np.dtype(dtype)
    if dt.byteorder == ">":
        dt = dt.newbyteorder("<")
    return _BY_DTYPE.get(dt)


def dtype_from_name(name: str) -> np.dtype:  # type: ignore[type-arg]
    """Return the (little-endian) NumPy dtype for a manifest name; KeyError if unknown."""
    return _BY_NAME[name]


def itemsize_of(name: str) -> int:
    """Bytes per element of the dtype called ``name``."""
    return int(_BY_NAME[name].itemsize)
