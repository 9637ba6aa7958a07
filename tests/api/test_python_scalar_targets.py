"""A saved 0-d array loads into a Python number target when no value changes."""

from __future__ import annotations

import numpy as np
import pytest

import statestream as ss


def test_scalar_arrays_into_python_numbers(tmp_path):
    ss.save(tmp_path / "c", {"step": np.int32(41) + 1, "lr": np.float32(0.5),
                             "flag": np.bool_(True), "v": np.zeros(2)})
    got = ss.load(tmp_path / "c", target={"step": 0, "lr": 1.0, "flag": False, "v": None})
    assert got["step"] == 42 and type(got["step"]) is int
    assert got["lr"] == 0.5 and type(got["lr"]) is float
    assert got["flag"] is True
    got = ss.load(tmp_path / "c", target={"step": 0.0})  # an int into a float: exact
    assert got["step"] == 42.0 and type(got["step"]) is float


def test_lossy_or_shaped_into_python_numbers_is_refused(tmp_path):
    ss.save(tmp_path / "c", {"lr": np.float32(0.5), "v": np.zeros(2)})
    with pytest.raises(ss.TargetMismatchError, match="key path 'lr'.*Python int"):
        ss.load(tmp_path / "c", target={"lr": 0})
    with pytest.raises(ss.TargetMismatchError, match="key path 'v'"):
        ss.load(tmp_path / "c", target={"v": 0.0})


def test_an_integer_a_float_cannot_hold_is_refused(tmp_path):
    """An int64 (uint64) above 2**53 into a Python float target would be rounded:
    refused, naming the key path; an int target or an exact value still loads."""
    big = 2**53 + 1
    ss.save(tmp_path / "c", {"opt": {"step": np.int64(big)}, "u": np.uint64(2**64 - 1),
                             "ok": np.int64(2**53), "nan": np.float32("nan")})
    with pytest.raises(ss.TargetMismatchError,
                       match=r"9007199254740993 .*key path 'opt/step'.*Python float"):
        ss.load(tmp_path / "c", target={"opt": {"step": 0.0}})
    with pytest.raises(ss.TargetMismatchError, match="key path 'u'"):
        ss.load(tmp_path / "c", target={"u": 0.0})
    got = ss.load(tmp_path / "c", target={"opt": {"step": 0}, "u": 0, "ok": 0.0, "nan": 0.0})
    assert got["opt"]["step"] == big and type(got["opt"]["step"]) is int
    assert got["u"] == 2**64 - 1 and got["ok"] == float(2**53)
    assert type(got["nan"]) is float and got["nan"] != got["nan"]
