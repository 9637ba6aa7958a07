"""Tests for statestream.providers.numpy and the provider registry."""

from __future__ import annotations

from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from statestream.errors import UnsupportedTypeError
from statestream.providers import (
    NumpyProvider,
    PreparedArray,
    array_provider_for,
    box_slices,
    chunk_of_host_array,
    provider_by_kind,
    target_provider_for,
)

P = NumpyProvider()


def le_bytes(a: np.ndarray) -> bytes:
    """The little-endian, C-order bytes a checkpoint stores for ``a``."""
    return np.ascontiguousarray(a.astype(a.dtype.newbyteorder("<"))).tobytes()


def check_chunks(prep: PreparedArray, a: np.ndarray) -> None:
    full = prep.chunk((0,) * a.ndim, a.shape)
    assert full.dtype == np.uint8 and full.ndim == 1
    assert full.tobytes() == le_bytes(a)
    if a.ndim and a.shape[0] > 1:
        # a row block and (for >1-D) a box that cuts every row
        rows = prep.chunk((1,) + (0,) * (a.ndim - 1), (a.shape[0] - 1,) + a.shape[1:])
        assert rows.tobytes() == le_bytes(a[1:])
        if a.ndim > 1 and a.shape[1] > 1:
            box = ((0, 1) + (0,) * (a.ndim - 2), (a.shape[0], a.shape[1] - 1) + a.shape[2:])
            got = prep.chunk(*box)
            assert got.tobytes() == le_bytes(a[box_slices(*box)])


BASE = np.arange(24, dtype=np.float32).reshape(4, 6) * 1.5


@pytest.mark.parametrize(
    ("name", "arr", "copies"),
    [
        ("contiguous", BASE, False),
        ("fortran", np.asfortranarray(BASE), True),
        ("strided", BASE[::2, ::3], True),
        ("transposed", BASE.T, True),
        ("negative stride", BASE[::-1], True),
        ("big-endian", BASE.astype(">f4"), True),
        ("big-endian int", np.arange(10, dtype=">i8"), True),
        ("3-d", np.arange(60, dtype=np.int16).reshape(3, 4, 5), False),
        ("0-d", np.array(7.25, dtype=np.float64), False),
        ("empty", np.zeros((0, 3), np.float32), False),
        ("empty inner", np.zeros((3, 0), np.int8), False),
        ("bool", np.array([True, False, True]), False),
        ("complex", np.array([1 + 2j, -3j], np.complex64), False),
        ("bfloat16", np.arange(6, dtype=ml_dtypes.bfloat16).reshape(2, 3), False),
        ("float8", np.arange(4, dtype=ml_dtypes.float8_e4m3fn), False),
    ],
)
def test_prepare_bytes(name: str, arr: np.ndarray, copies: bool) -> None:
    prep = P.prepare(arr, ("a",))
    assert prep.kind == "numpy"
    assert prep.shape == arr.shape
    assert prep.copies is copies
    assert prep.nbytes == arr.nbytes
    assert prep.attrs is None
    assert prep.dtype == {"bfloat16": "bfloat16", "float8": "float8_e4m3fn"}.get(
        name, arr.dtype.newbyteorder("<").name)
    check_chunks(prep, arr)


def test_prepare_numpy_scalar() -> None:
    prep = P.prepare(np.float32(2.5), ("s",))
    assert prep.attrs == {"scalar": True} and prep.shape == () and prep.dtype == "float32"
    assert prep.chunk((), ()).tobytes() == np.float32(2.5).tobytes()


def test_chunk_bytes_of_a_view_follow_the_array() -> None:
    a = np.zeros(4, np.int32)
    prep = P.prepare(a, ("a",))
    a[:] = 7  # zero-copy: the chunk reflects the array when it is read
    assert prep.chunk((0,), (4,)).tobytes() == np.full(4, 7, np.int32).tobytes()


def test_chunk_of_host_array() -> None:
    a = np.arange(12, dtype=">u2").reshape(3, 4)
    got = chunk_of_host_array(a, (1, 1), (2, 2))
    assert got.tobytes() == le_bytes(a[1:3, 1:3])
    assert chunk_of_host_array(np.array(5, np.int8), (), ()).tobytes() == b"\x05"


@pytest.mark.parametrize(
    "arr",
    [
        np.array([object(), 1], dtype=object),
        np.zeros(2, dtype=[("a", "i4"), ("b", "f4")]),
        np.array(["abc"]),
        np.array([b"ab"]),
        np.array(["2020-01-01"], dtype="M8[D]"),
    ],
)
def test_unsupported_dtypes_name_key_path(arr: np.ndarray) -> None:
    with pytest.raises(UnsupportedTypeError, match=r"key path 'model/w~1b'"):
        P.prepare(arr, ("model", "w/b"))


def test_restore_default() -> None:
    dest = P.restore("float32", (2, 3), None, ("a",))
    ((start, buf),) = dest.boxes
    assert start == (0, 0) and buf.shape == (2, 3) and buf.dtype == np.float32
    buf[...] = np.arange(6).reshape(2, 3)
    out = dest.finish()
    assert isinstance(out, np.ndarray) and out.dtype == np.float32
    np.testing.assert_array_equal(out, np.arange(6).reshape(2, 3))


def test_restore_casts_to_target_dtype() -> None:
    dest = P.restore("float32", (3,), np.zeros(3, np.float64), ("a",))
    dest.boxes[0][1][...] = [1.5, 2.5, 3.5]
    out = dest.finish()
    assert out.dtype == np.float64 and out.tolist() == [1.5, 2.5, 3.5]


def test_restore_bfloat16() -> None:
    dest = P.restore("bfloat16", (2,), None, ())
    assert dest.boxes[0][1].dtype == ml_dtypes.bfloat16


def test_restore_scalars() -> None:
    dest = P.restore("int64", (), None, ("s",), scalar=True)
    dest.boxes[0][1][...] = 9
    out = dest.finish()
    assert isinstance(out, np.int64) and out == 9
    dest = P.restore("float32", (), np.float64(0), ("s",))
    dest.boxes[0][1][...] = 0.5
    out = dest.finish()
    assert isinstance(out, np.float64) and out == 0.5
    dest = P.restore("float32", (), None, ("s",))  # 0-d array, not a scalar
    assert isinstance(dest.finish(), np.ndarray)


def test_restore_empty() -> None:
    dest = P.restore("int8", (0, 4), None, ())
    assert dest.finish().shape == (0, 4)


def test_handles_and_targets() -> None:
    assert P.handles(np.zeros(1)) and P.handles(np.int8(1))
    assert not P.handles([1]) and not P.handles(1.0)
    assert P.is_target(np.zeros(1)) and not P.is_target(None)
    assert P.target_shape(np.zeros((2, 5))) == (2, 5)
    assert P.target_shape(np.float32(1)) == ()


def test_registry() -> None:
    assert isinstance(array_provider_for(np.zeros(1)), NumpyProvider)
    assert array_provider_for({"a": 1}) is None
    assert array_provider_for(3) is None
    assert isinstance(target_provider_for(np.float16(1)), NumpyProvider)
    assert target_provider_for("x") is None
    assert isinstance(provider_by_kind("numpy"), NumpyProvider)
    assert isinstance(provider_by_kind("no-such-framework"), NumpyProvider)



@pytest.mark.filterwarnings("ignore:the matrix subclass:PendingDeprecationWarning")
@pytest.mark.parametrize("mode", ["sync", "async", "lazy"])
def test_ndarray_subclasses_save_in_chunks(tmp_path: Path, mode: str) -> None:
    """np.matrix keeps two dimensions when reshaped or indexed, so chunking it (rows cut
    into chunks smaller than a row) crashed inside memoryview (TypeError) or refused it,
    and the byte shuffle of compression crashed in a NumPy broadcast (found by
    tests/fuzz/test_randomized_roundtrip.py, seeds 100652 and 101079). A subclass is
    saved as its plain ndarray view: the same bytes, shape and dtype."""
    import statestream as ss

    m = np.asmatrix(np.arange(6, dtype=np.int64).reshape(2, 3))
    mm = np.memmap(tmp_path / "mm.bin", dtype=np.float32, mode="w+", shape=(3, 5))
    mm[:] = np.arange(15, dtype=np.float32).reshape(3, 5)
    mf = np.asmatrix(np.arange(24, dtype=np.float32).reshape(4, 6))  # shuffled when compressed
    state = {"m": m, "mT": m.T, "mf": mf, "mm": mm}
    for chunk, comp in [(7, None), (8, None), (16, None), (4096, None), (4096, "zstd")]:
        path = tmp_path / f"{mode}-{chunk}-{comp}"
        io = ss.IOOptions(max_chunk_bytes=chunk)
        if mode == "sync":
            ss.save(path, state, io=io, compression=comp)
        else:
            ss.save_async(path, state, io=io, compression=comp, lazy=mode == "lazy").result()
        got = ss.load(path)
        for k, v in state.items():
            assert type(got[k]) is np.ndarray and got[k].shape == v.shape
            assert got[k].tobytes() == np.ascontiguousarray(v).tobytes(), (k, chunk, comp)
        assert ss.verify(path).ok
