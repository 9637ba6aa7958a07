"""Hypothesis strategies for checkpointable states, and an exact tree comparison.

Needs ``hypothesis`` (a test dependency, not a runtime one).

Example:
    >>> from hypothesis import given, settings
    >>> import statestream as ss, tempfile, os
    >>> @settings(max_examples=5, deadline=None)
    ... @given(trees())
    ... def check(state):
    ...     p = os.path.join(tempfile.mkdtemp(), "c")
    ...     ss.save(p, state)
    ...     assert_tree_equal(ss.load(p), state)
    >>> check()
"""

from __future__ import annotations

import dataclasses
import math
import struct
import sys
from typing import Any

import numpy as np
from hypothesis import strategies as st

from statestream.format import DTYPE_NAMES, dtype_from_name

__all__ = [
    "SUPPORTED_DTYPE_NAMES",
    "array_leaves",
    "arrays",
    "assert_tree_equal",
    "dict_keys",
    "dtypes",
    "leaves",
    "plain_values",
    "shapes",
    "trees",
]

_ORDER = [
    "bool",
    "int8", "int16", "int32", "int64",
    "uint8", "uint16", "uint32", "uint64",
    "float16", "float32", "float64",
    "complex64", "complex128",
    "bfloat16",
    "float8_e3m4", "float8_e4m3", "float8_e4m3b11fnuz", "float8_e4m3fn", "float8_e4m3fnuz",
    "float8_e5m2", "float8_e5m2fnuz", "float8_e8m0fnu",
    "float6_e2m3fn", "float6_e3m2fn", "float4_e2m1fn",
    "int2", "int4", "uint2", "uint4",
]

#: Every dtype name this statestream stores, in a stable order (shrinks towards ``bool``).
SUPPORTED_DTYPE_NAMES: tuple[str, ...] = tuple(n for n in _ORDER if n in DTYPE_NAMES) + tuple(
    sorted(DTYPE_NAMES - set(_ORDER))
)

# dtypes whose every bit pattern is a valid value: random bytes exercise NaN payloads etc.
_ANY_BITS = {
    "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
    "float16", "float32", "float64", "complex64", "complex128", "bfloat16",
    "float8_e3m4", "float8_e4m3", "float8_e4m3b11fnuz", "float8_e4m3fn", "float8_e4m3fnuz",
    "float8_e5m2", "float8_e5m2fnuz", "float8_e8m0fnu",
}


def dtypes(names: tuple[str, ...] | None = None) -> st.SearchStrategy[np.dtype]:  # type: ignore[type-arg]
    """NumPy dtypes statestream supports (ml_dtypes bfloat16/float8/... included)."""
    return st.sampled_from([dtype_from_name(n) for n in (names or SUPPORTED_DTYPE_NAMES)])


def shapes(*, max_dims: int = 4, max_side: int = 6) -> st.SearchStrategy[tuple[int, ...]]:
    """Array shapes, including 0-d ``()`` and empty ones (a zero-length side)."""
    return st.lists(st.integers(0, max_side), max_size=max_dims).map(tuple)


@st.composite
def _array_values(draw: Any, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:  # type: ignore[type-arg]
    n = math.prod(shape)
    name = next(k for k in SUPPORTED_DTYPE_NAMES if dtype_from_name(k) == dtype)
    # one drawn seed per array keeps big arrays cheap for Hypothesis to generate
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    if name in _ANY_BITS:
        return np.frombuffer(rng.bytes(n * dtype.itemsize), dtype=dtype).reshape(shape).copy()
    if name == "bool":
        return np.asarray(rng.integers(0, 2, size=shape)).astype(bool)
    # sub-byte types: only values that the type can represent exactly
    base = np.asarray(rng.integers(-1, 2, size=shape)).astype(np.float32)
    if name.startswith("uint") or name == "float8_e8m0fnu":
        base = np.abs(base)
    return np.asarray(base).astype(dtype)


@st.composite
def arrays(
    draw: Any,
    dtype: st.SearchStrategy[np.dtype] | None = None,  # type: ignore[type-arg]
    shape: st.SearchStrategy[tuple[int, ...]] | None = None,
    *,
    layouts: bool = True,
) -> Any:
    """NumPy arrays of supported dtypes and random shapes.

    With ``layouts`` the array may be a strided view (a step-sliced part of
    a bigger array), Fortran-ordered, or big-endian.
    """
    dt = draw(dtype if dtype is not None else dtypes())
    shp = draw(shape if shape is not None else shapes())
    if not layouts or not shp:
        return draw(_array_values(dt, shp))
    how = draw(st.sampled_from(["c", "strided", "fortran", "big-endian"]))
    if how == "strided":
        steps = draw(st.lists(st.integers(1, 3), min_size=len(shp), max_size=len(shp)))
        offs = draw(st.lists(st.integers(0, 2), min_size=len(shp), max_size=len(shp)))
        big_shape = tuple(o + max(s, 1) * k for s, k, o in zip(shp, steps, offs))
        big = draw(_array_values(dt, big_shape))
        view = big[tuple(slice(o, o + s * k, k) for s, k, o in zip(shp, steps, offs))]
        assert view.shape == shp
        return view
    a = draw(_array_values(dt, shp))
    if how == "fortran":
        return np.asfortranarray(a)
    if how == "big-endian" and dt.itemsize > 1 and dt.kind in "iufc":
        return a.astype(dt.newbyteorder(">"))
    return a


@st.composite
def _numpy_scalars(draw: Any) -> Any:
    a = draw(arrays(shape=st.just(()), layouts=False))
    return a[()]


def plain_values() -> st.SearchStrategy[Any]:
    """None, bool, int (huge ones too), float (nan, inf, -0.0), str (surrogates too), bytes."""
    return st.one_of(
        st.none(),
        st.booleans(),
        st.integers(),
        st.integers(min_value=-(1 << 300), max_value=1 << 300),
        st.floats(allow_nan=True, allow_infinity=True),
        st.text(alphabet=st.characters(codec=None, exclude_categories=()), max_size=20),
        st.binary(max_size=64),
    )


def array_leaves() -> st.SearchStrategy[Any]:
    """NumPy arrays (any layout) and NumPy scalars."""
    return st.one_of(arrays(), _numpy_scalars())


def leaves() -> st.SearchStrategy[Any]:
    """Anything statestream stores as a leaf without a framework: arrays and plain values."""
    return st.one_of(array_leaves(), plain_values())


def dict_keys() -> st.SearchStrategy[str | int]:
    """Mapping keys: str (with ``/``, ``.``, ``~`` and non-ASCII) and int."""
    return st.one_of(
        st.text(alphabet=st.characters(codec=None, exclude_categories=()), max_size=8),
        st.sampled_from(["a/b", "~", "~1", ".", "..", "a.b", "", "params", "\u00e9\U0001f600"]),
        st.integers(min_value=-(1 << 70), max_value=1 << 70),
    )


def trees(
    leaf: st.SearchStrategy[Any] | None = None, *, max_leaves: int = 12
) -> st.SearchStrategy[Any]:
    """Nested dicts (str/int keys), lists and tuples of ``leaf`` values.

    The root is a dict (its keys are the checkpointables).
    """
    base = leaf if leaf is not None else leaves()
    nested = st.recursive(
        base,
        lambda children: st.one_of(
            st.dictionaries(dict_keys(), children, max_size=4),
            st.lists(children, max_size=4),
            st.lists(children, max_size=4).map(tuple),
        ),
        max_leaves=max_leaves,
    )
    return st.dictionaries(dict_keys(), nested, max_size=4)


# ----------------------------------------------------------------------------- comparison


def _np_bytes(a: np.ndarray) -> bytes:
    if a.dtype.byteorder == ">":
        a = a.astype(a.dtype.newbyteorder("<"))
    return np.ascontiguousarray(a).tobytes()


def _le(dt: np.dtype) -> np.dtype:  # type: ignore[type-arg]
    return dt.newbyteorder("<") if dt.byteorder == ">" else dt


def _fail(path: str, msg: str) -> None:
    raise AssertionError(f"at {path or '<root>'}: {msg}")


def _assert_tensor_equal(actual: Any, expected: Any, path: str, torch: Any) -> None:
    """torch tensors: same type, dtype, shape, requires_grad (parameters) and bytes."""
    if type(actual) is not type(expected):
        _fail(path, f"expected {type(expected).__name__}, got {type(actual).__name__}")
    if actual.dtype != expected.dtype or tuple(actual.shape) != tuple(expected.shape):
        _fail(path, f"{actual.dtype}{tuple(actual.shape)} != "
                    f"{expected.dtype}{tuple(expected.shape)}")
    if isinstance(expected, torch.nn.Parameter) and (
        actual.requires_grad != expected.requires_grad
    ):
        _fail(path, "requires_grad differs")

    def tb(t: Any) -> bytes:
        t = t.detach().cpu().contiguous().reshape(-1)
        return bytes(t.view(torch.uint8).numpy().tobytes()) if t.numel() else b""

    if tb(actual) != tb(expected):
        _fail(path, f"values differ:\n{actual!r}\n{expected!r}")


def _assert_float_equal(actual: Any, expected: float, path: str) -> None:
    """Python floats: equal bits, except that any NaN matches any NaN."""
    if type(actual) is not float:
        _fail(path, f"expected a float, got {type(actual).__name__}")
    if math.isnan(expected):  # format v1 stores a plain float NaN as "nan": no sign/payload
        if not math.isnan(actual):
            _fail(path, f"{actual!r} != nan")
    elif struct.pack("<d", actual) != struct.pack("<d", expected):
        _fail(path, f"{actual!r} != {expected!r} (bitwise)")


def assert_tree_equal(actual: Any, expected: Any, *, path: str = "") -> None:
    """Assert two states are exactly equal: types, keys in order, dtypes, shapes, bits.

    NumPy arrays compare by dtype (byte order ignored: big-endian arrays load
    back little-endian), shape and bytes, so NaN payloads and -0.0 count.
    Python floats compare by bits too, except that any NaN matches any NaN
    (format v1 stores a plain float NaN as ``nan``, without sign or payload;
    NaNs inside arrays keep every bit). torch tensors and JAX arrays compare the same way
    (type, dtype, shape, bytes).
    """
    torch = sys.modules.get("torch")
    jax = sys.modules.get("jax")
    if isinstance(expected, np.ndarray):
        if type(actual) is not np.ndarray:
            _fail(path, f"expected a numpy array, got {type(actual).__name__}")
        if _le(actual.dtype) != _le(expected.dtype):
            _fail(path, f"dtype {actual.dtype} != {expected.dtype}")
        if actual.shape != expected.shape:
            _fail(path, f"shape {actual.shape} != {expected.shape}")
        if _np_bytes(actual) != _np_bytes(expected):
            _fail(path, f"values differ:\n{actual!r}\n{expected!r}")
        return
    if isinstance(expected, np.generic):
        if type(actual) is not type(expected):
            _fail(path, f"expected {type(expected).__name__}, got {type(actual).__name__}")
        if _np_bytes(np.asarray(actual)) != _np_bytes(np.asarray(expected)):
            _fail(path, f"values differ: {actual!r} != {expected!r}")
        return
    if torch is not None and isinstance(expected, torch.Tensor):
        _assert_tensor_equal(actual, expected, path, torch)
        return
    if jax is not None and isinstance(expected, jax.Array):
        if not isinstance(actual, jax.Array):
            _fail(path, f"expected a jax.Array, got {type(actual).__name__}")
        assert_tree_equal(np.asarray(actual), np.asarray(expected), path=path)
        return
    if expected is None or isinstance(expected, (bool, int, str, bytes)):
        if type(actual) is not type(expected) or actual != expected:
            _fail(path, f"{actual!r:.200} != {expected!r:.200}")
        return
    if isinstance(expected, float):
        _assert_float_equal(actual, expected, path)
        return
    if isinstance(expected, dict):
        if type(actual) is not type(expected):
            _fail(path, f"expected {type(expected).__name__}, got {type(actual).__name__}")
        ak = [(type(k), k) for k in actual]
        ek = [(type(k), k) for k in expected]
        if ak != ek:
            _fail(path, f"keys {list(actual)!r:.300} != {list(expected)!r:.300}")
        for k in expected:
            assert_tree_equal(actual[k], expected[k], path=f"{path}/{k}")
        return
    if isinstance(expected, (list, tuple)):
        if type(actual) is not type(expected):
            _fail(path, f"expected {type(expected).__name__}, got {type(actual).__name__}")
        if len(actual) != len(expected):
            _fail(path, f"length {len(actual)} != {len(expected)}")
        for i, (a, e) in enumerate(zip(actual, expected)):
            assert_tree_equal(a, e, path=f"{path}/{i}")
        return
    if dataclasses.is_dataclass(expected) and not isinstance(expected, type):
        if type(actual) is not type(expected):
            _fail(path, f"expected {type(expected).__name__}, got {type(actual).__name__}")
        for f in dataclasses.fields(expected):
            assert_tree_equal(getattr(actual, f.name), getattr(expected, f.name),
                              path=f"{path}/{f.name}")
        return
    if actual != expected:
        _fail(path, f"{actual!r:.200} != {expected!r:.200}")
