"""A saved Python number loads into a 0-d NumPy or torch target (a step kept as a 0-d
tensor): of the target's dtype, filling the target itself with ``in_place=True``. Until
2026-12-07 every such load was refused ('the target has an array at key path 'step'
but the checkpoint holds a int there'), though a 0-d JAX target took it. A value the
target's dtype cannot hold (a fraction or out of range into an integer, 2 into a bool)
is refused, naming the key path and the checkpoint."""

from __future__ import annotations

import numpy as np
import pytest

import statestream as ss

torch = pytest.importorskip("torch")


@pytest.fixture
def ck(tmp_path):
    path = tmp_path / "c"
    ss.save(path, {"step": 3, "lr": 0.5, "flag": True, "frac": 2.5, "big": 2**40, "neg": -1,
                   "two": 2, "huge": 1e300})
    return path


def test_numbers_into_0d_numpy_and_torch_targets(ck):
    got = ss.load(ck, {"step": np.int64(0), "lr": np.float32(0), "flag": np.array(False),
                       "two": torch.tensor(0, dtype=torch.int8), "frac": torch.tensor(0.0),
                       "big": np.array(0.0)})
    assert type(got["step"]) is np.int64 and got["step"] == 3
    assert type(got["lr"]) is np.float32 and got["lr"] == 0.5
    assert isinstance(got["flag"], np.ndarray) and got["flag"].shape == () and got["flag"]
    assert got["two"].dtype == torch.int8 and got["two"].item() == 2
    assert got["frac"].dtype == torch.float32 and got["frac"].item() == 2.5
    assert got["big"].dtype == np.float64 and got["big"] == 2.0**40


def test_in_place_fills_the_0d_target_itself(ck):
    step, lr, arr = torch.tensor(0), torch.tensor(0.0, dtype=torch.float64), np.array(0)
    got = ss.load(ck, {"step": step, "lr": lr, "two": arr}, in_place=True)
    assert got["step"] is step and step.item() == 3
    assert got["lr"] is lr and lr.item() == 0.5
    assert got["two"] is arr and arr == 2
    untouched = torch.tensor(0)
    got = ss.load(ck, {"step": untouched})  # without in_place: a new tensor
    assert got["step"] is not untouched and untouched.item() == 0 and got["step"].item() == 3


@pytest.mark.parametrize(("key", "like", "kind"), [
    ("frac", torch.tensor(0), "int64 torch tensor"),
    ("frac", np.int32(0), "int32 NumPy array"),
    ("big", np.array(0, dtype=np.int32), "int32 NumPy array"),
    ("neg", torch.tensor(0, dtype=torch.uint8), "uint8 torch tensor"),
    ("two", torch.tensor(False), "bool torch tensor"),
    ("two", np.bool_(False), "bool NumPy array"),
])
def test_a_number_the_target_cannot_hold_is_refused(ck, key, like, kind):
    before = like.clone() if isinstance(like, torch.Tensor) else np.array(like)
    with pytest.raises(ss.TargetMismatchError,
                       match=rf"loading .*c: the checkpoint's \w+ at key path '{key}' is .*"
                             rf"which the target's 0-d {kind} cannot hold"):
        ss.load(ck, {key: like}, in_place=True)
    assert (like == before).all() if isinstance(like, torch.Tensor) else like == before


def test_a_number_into_a_shaped_target_is_still_refused(ck):
    with pytest.raises(ss.TargetMismatchError, match="key path 'step'"):
        ss.load(ck, {"step": np.zeros(1)})
