"""A finite saved value that the target's narrower float dtype cannot hold is refused.

Until 2026-12-07 a float32 array holding 1e5 loaded into a float16 target (NumPy,
torch, JAX) came back holding inf, silently; so did float64 1e39 into float32, an
int64 100000 into float16 and a Python float 1e300 into a 0-d float32 target, and
torch's float8_e4m3fn clamped 7e4 to 448. Now each is refused (TargetMismatchError
naming the key path, the value and the target's dtype), as an integer target already
refused a value it could not hold. Rounding is still the cast's (float32 into
bfloat16 rounds), and an inf or NaN that was saved loads as it was.
"""

from __future__ import annotations

import numpy as np
import pytest

import statestream as ss

torch = pytest.importorskip("torch")


@pytest.fixture
def ck(tmp_path):
    path = tmp_path / "c"
    ss.save(path, {"f32": np.array([1.0, 1e5, 2.0], np.float32),
                   "f64": np.array([1e39, 1.0]), "i64": np.array([100000, 1]),
                   "t": torch.tensor([[3.0, -7e4]]), "n": 1e300,
                   "inf": np.array([np.inf, np.nan, 1.0], np.float32),
                   "fits": np.array([65504.0, -1.5, 1e-3], np.float32)})
    return path


@pytest.mark.parametrize(("key", "make", "value", "dtype"), [
    ("f32", lambda: np.zeros(3, np.float16), "100000.0", "float16"),
    ("f32", lambda: torch.zeros(3, dtype=torch.float16), "100000.0", "float16"),
    ("f64", lambda: np.zeros(2, np.float32), "1e\\+39", "float32"),
    ("f64", lambda: torch.zeros(2), "1e\\+39", "float32"),
    ("i64", lambda: np.zeros(2, np.float16), "100000", "float16"),
    ("t", lambda: torch.zeros(1, 2, dtype=torch.float8_e4m3fn), "-70000.0", "float8_e4m3fn"),
])
@pytest.mark.parametrize("in_place", [False, True])
def test_a_value_that_would_overflow_is_refused(ck, key, make, value, dtype, in_place):
    target = make()
    with pytest.raises(ss.TargetMismatchError,
                       match=rf"loading .*c: the checkpoint's \w+ array at key path '{key}' "
                             rf"holds {value}, which the target's dtype {dtype} cannot hold"):
        ss.load(ck, {key: target}, in_place=in_place)
    assert not (target.float() if isinstance(target, torch.Tensor) else target).any()


def test_a_number_that_would_overflow_is_refused(ck):
    for like in (np.float32(0), torch.tensor(0.0)):
        with pytest.raises(ss.TargetMismatchError, match="float at key path 'n' is 1e\\+300"):
            ss.load(ck, {"n": like})


def test_jax_target_refuses_too(ck):
    jnp = pytest.importorskip("jax.numpy")
    with pytest.raises(ss.TargetMismatchError, match="key path 'f32' holds 100000.0"):
        ss.load(ck, {"f32": jnp.zeros(3, jnp.float16)})


def test_values_that_fit_saved_infs_and_rounding_still_load(ck):
    got = ss.load(ck, {"fits": np.zeros(3, np.float16), "inf": torch.zeros(3, dtype=torch.float16),
                       "t": torch.zeros(1, 2, dtype=torch.bfloat16)})
    assert got["fits"].tolist() == np.array([65504.0, -1.5, 1e-3], np.float16).tolist()
    inf = got["inf"].tolist()
    assert inf[0] == float("inf") and inf[1] != inf[1] and inf[2] == 1.0
    assert got["t"].dtype == torch.bfloat16 and got["t"][0, 0].item() == 3.0


def test_float8_arrays_saved_and_loaded_into_other_floats(tmp_path):
    # float8_e5m2 has NumPy's kind 'f' (bfloat16 and float8_e4m3fn have 'V'): the check
    # asked np.finfo for its range, which raised ValueError on every load of such an
    # array into another dtype (found by the randomized campaign, seed 650008)
    ml_dtypes = pytest.importorskip("ml_dtypes")
    path = tmp_path / "f8"
    ss.save(path, {"a": np.array([2.0, 1024.0], dtype=ml_dtypes.float8_e5m2)})
    got = ss.load(path, target={"a": np.zeros(2, np.float32)})
    np.testing.assert_array_equal(got["a"], [2.0, 1024.0])
    with pytest.raises(ss.TargetMismatchError, match="holds 1024.0.*float8_e4m3fn"):
        ss.load(path, target={"a": np.zeros(2, ml_dtypes.float8_e4m3fn)})
    got = ss.load(path, target={"a": torch.zeros(2, dtype=torch.bfloat16)})
    assert got["a"].tolist() == [2.0, 1024.0]
