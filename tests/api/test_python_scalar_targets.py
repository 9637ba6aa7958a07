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
