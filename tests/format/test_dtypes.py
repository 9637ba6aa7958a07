"""Tests for statestream.format._dtypes: manifest dtype names <-> NumPy dtypes."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from statestream.format import DTYPE_NAMES, dtype_from_name, dtype_name, itemsize_of

STANDARD_ITEMSIZE = {
    "bool": 1,
    "int8": 1, "int16": 2, "int32": 4, "int64": 8,
    "uint8": 1, "uint16": 2, "uint32": 4, "uint64": 8,
    "float16": 2, "float32": 4, "float64": 8,
    "complex64": 8, "complex128": 16,
}


def test_standard_names_present() -> None:
    assert set(STANDARD_ITEMSIZE) <= DTYPE_NAMES
    assert "bfloat16" in DTYPE_NAMES and "float8_e4m3fn" in DTYPE_NAMES


@pytest.mark.parametrize("name", sorted(DTYPE_NAMES))
def test_every_name_maps_to_a_numpy_dtype(name: str) -> None:
    dt = dtype_from_name(name)
    assert isinstance(dt, np.dtype)
    assert dt.byteorder in ("=", "|", "<")
    assert itemsize_of(name) == dt.itemsize
    if name in STANDARD_ITEMSIZE:
        assert dt == np.dtype(name)
        assert dt.itemsize == STANDARD_ITEMSIZE[name]
    else:
        assert dt == np.dtype(getattr(ml_dtypes, name))
        assert dt.itemsize == (2 if name == "bfloat16" else 1)
    assert dtype_name(dt) == name


@pytest.mark.parametrize("name", sorted(n for n, s in STANDARD_ITEMSIZE.items() if s > 1))
def test_big_endian_maps_to_same_name(name: str) -> None:
    big = np.dtype(name).newbyteorder(">")
    assert big.byteorder == ">"
    assert dtype_name(big) == name
    assert dtype_name(np.dtype(name).newbyteorder("<")) == name
    assert dtype_name(np.dtype(name).newbyteorder("=")) == name


def test_string_spellings() -> None:
    assert dtype_name(np.dtype(">f4")) == "float32"
    assert dtype_name(np.dtype("<i8")) == "int64"
    assert dtype_name(np.dtype("?")) == "bool"
    assert dtype_name(np.dtype(ml_dtypes.bfloat16)) == "bfloat16"


@pytest.mark.parametrize("spec", ["U3", "S4", "O", "M8[s]", "m8[ns]", "V8", "i4,f4"])
def test_unsupported_dtypes_have_no_name(spec: str) -> None:
    assert dtype_name(np.dtype(spec)) is None


def test_longdouble_has_no_name_unless_it_is_float64() -> None:
    ld = np.dtype(np.longdouble)
    assert dtype_name(ld) == ("float64" if ld == np.dtype("float64") else None)


def test_unknown_name_raises_keyerror() -> None:
    with pytest.raises(KeyError):
        dtype_from_name("float128")
    with pytest.raises(KeyError):
        itemsize_of(">f4")
