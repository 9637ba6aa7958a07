"""An array of one ml_dtypes dtype loads into a target of another that ml_dtypes casts
between only through float32.

Until 2026-12-08 a float8_e8m0fnu array (torch's MX scale dtype) loaded into a
float8_e4m3fn, float8_e5m2, float6 or float4 target (NumPy or torch, fresh or in
place), or an int4/uint4 array into a float6_e2m3fn one, raised a bare TypeError
('Cannot cast array data from dtype(float8_e8m0fnu) to dtype(float8_e4m3fn) according
to the rule unsafe') from the overflow check; int4 into uint4 (and e8m0 into int4) was
refused as 'cannot cast'. Now the cast goes through float32, which holds every value
of these dtypes exactly, and the values that the target cannot hold are refused as
before.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest

import statestream as ss
from statestream.format import DTYPE_NAMES, dtype_from_name

ml_dtypes = pytest.importorskip("ml_dtypes")

SMALL = sorted(n for n in DTYPE_NAMES if dtype_from_name(n).itemsize == 1 and n != "bool")
_WIDTH = {"int2": 2, "uint2": 2, "int4": 4, "uint4": 4, "float4_e2m1fn": 4,
          "float6_e2m3fn": 6, "float6_e3m2fn": 6}


def _every_value(name: str) -> np.ndarray:
    return np.arange(1 << _WIDTH.get(name, 8), dtype=np.uint8).view(dtype_from_name(name))


@pytest.mark.parametrize("name", SMALL)
def test_float32_holds_every_value_of_the_small_dtypes_exactly(name):
    from statestream.providers._base import cast_host_array

    every = _every_value(name)
    wide = every.astype(np.float32)
    back = wide.astype(every.dtype)
    assert ((back.view(np.uint8) == every.view(np.uint8)) | np.isnan(wide)).all()
    for other in SMALL + ["float16", "bfloat16", "float32"]:
        want = dtype_from_name(other)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                direct = every.astype(want)
            except TypeError:  # the pairs the float32 path is for
                continue
            via = cast_host_array(wide, want)
        same = direct.astype(np.float64) == via.astype(np.float64)
        both_nan = np.isnan(direct.astype(np.float64)) & np.isnan(via.astype(np.float64))
        # (an infinity into an integer: undefined, and refused before any cast)
        assert (same | both_nan | np.isinf(wide)).all(), (name, other)


@pytest.fixture
def ck(tmp_path):
    path = tmp_path / "c"
    ss.save(path, {"scale": np.array([1.0, 2.0, 0.5], ml_dtypes.float8_e8m0fnu),
                   "big": np.array([1.0, 2.0**127], ml_dtypes.float8_e8m0fnu),
                   "i4": np.array([1, 2, -1], ml_dtypes.int4),
                   "u4": np.array([1, 2, 7], ml_dtypes.uint4)})
    return path


@pytest.mark.parametrize("dtype", ["float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz",
                                   "float8_e3m4", "float6_e2m3fn", "float6_e3m2fn",
                                   "float4_e2m1fn"])
@pytest.mark.parametrize("in_place", [False, True])
def test_e8m0_loads_into_other_small_floats(ck, dtype, in_place):
    target = np.zeros(3, dtype_from_name(dtype))
    got = ss.load(ck, {"scale": target}, in_place=in_place)["scale"]
    assert got.dtype == target.dtype and got.astype(np.float32).tolist() == [1.0, 2.0, 0.5]
    assert (got is target) == in_place


@pytest.mark.parametrize(("key", "dtype", "want"), [
    ("i4", "float6_e2m3fn", [1.0, 2.0, -1.0]), ("u4", "float6_e2m3fn", [1.0, 2.0, 7.0]),
    ("u4", "int4", [1, 2, 7]), ("u4", "float8_e8m0fnu", [1.0, 2.0, 8.0]),
    ("i4", "int2", "'i4' holds 2, which"),  # out of range: refused, as before
    ("scale", "int8", "'scale' holds 0.5"),  # no integer: refused, as a float32's 0.5
])
def test_narrow_ints_and_e8m0_cast_through_float32(ck, key, dtype, want):
    target = np.zeros(3, dtype_from_name(dtype))
    if isinstance(want, str):
        with pytest.raises(ss.TargetMismatchError, match=want):
            ss.load(ck, {key: target})
        return
    got = ss.load(ck, {key: target})[key]
    assert got.dtype == target.dtype and got.astype(np.float32).tolist() == want


def test_an_e8m0_value_the_target_cannot_hold_is_refused(ck):
    for target in (np.zeros(2, ml_dtypes.float8_e4m3fn), np.zeros(2, ml_dtypes.float8_e5m2)):
        with pytest.raises(ss.TargetMismatchError,
                           match=r"float8_e8m0fnu array at key path 'big' holds 1\.7"):
            ss.load(ck, {"big": target})


def test_torch_float8_targets(ck):
    torch = pytest.importorskip("torch")
    for dt in (torch.float8_e4m3fn, torch.float8_e5m2):
        got = ss.load(ck, {"scale": torch.zeros(3, dtype=dt)})["scale"]
        assert got.dtype == dt and got.float().tolist() == [1.0, 2.0, 0.5]
    with pytest.raises(ss.TargetMismatchError, match="key path 'big'"):
        ss.load(ck, {"big": torch.zeros(2, dtype=torch.float8_e4m3fn)})


CLAMPED = [  # (saved values, target dtype, what the refusal names); each became a number
    (np.array([1.0, 100.0], np.float32), "float4_e2m1fn", "holds 100.0"),  # was 6
    (np.array([1.0, -31.0], np.float32), "float6_e3m2fn", "holds -31.0"),  # was -28 (29 rounds)
    (np.array([1.0, np.nan], np.float32), "float4_e2m1fn", "holds NaN"),  # was -0
    (np.array([1.0, np.inf], np.float32), "float8_e4m3fn", "holds an infinity"),  # was NaN
    (np.array([1.0, 0.0], np.float16), "float8_e8m0fnu", "holds 0.0"),  # was NaN
    (np.array([2.0, -1.0], np.float32), "float8_e8m0fnu", "holds -1.0"),  # was NaN
]


@pytest.mark.parametrize("values, want, said", CLAMPED,
                         ids=[f"{v.dtype}-{w}-{s[6:]}" for v, w, s in CLAMPED])
@pytest.mark.parametrize("kind", ["numpy", "torch"])
def test_values_a_small_float_target_cannot_hold_are_refused(tmp_path, values, want, said,
                                                              kind):
    # a target without infinities clamped a value past its largest to it; one without
    # NaN made NaN a number; float8_e8m0fnu made zero and negatives NaN: all silently
    ss.save(tmp_path / "c", {"x": values})
    like = np.zeros(values.shape, dtype_from_name(want))
    if kind == "torch":
        torch = pytest.importorskip("torch")
        tdt = getattr(torch, want, None)
        if tdt is None:
            pytest.skip(f"torch has no {want}")
        like = torch.zeros(values.shape, dtype=tdt)
    with pytest.raises(ss.TargetMismatchError, match=f"'x' {said}, which the target"):
        ss.load(tmp_path / "c", {"x": like})
    # within range (rounding allowed) it loads: 6.9 rounds to 6 in float4_e2m1fn
    ss.save(tmp_path / "ok", {"x": np.array([6.9, -6.9], np.float32)})
    got = ss.load(tmp_path / "ok", {"x": np.zeros(2, dtype_from_name("float4_e2m1fn"))})["x"]
    assert got.astype(np.float32).tolist() == [6.0, -6.0]
