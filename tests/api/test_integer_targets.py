"""An integer array into a target of a narrower integer dtype: a cast would wrap a
value it cannot hold around (2**40 into int32 is 0) and the load returned it, with
no error; such a value is now refused, naming the key path, the value and the dtype.
Values that fit still load into the narrower dtype (an int64 step into int32). So is a
float array into an integer target whose values an integer cannot hold exactly (NaN
and 3e10 were INT32_MIN, 1.5 was 1)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import statestream as ss

_BIG = 2**40


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    c = tmp_path / "c"
    ss.save(c, {"big": np.arange(8, dtype=np.int64) + _BIG, "small": np.arange(8, dtype=np.int64),
                "neg": np.array([-1, 2], np.int64)})
    return c


def _refused(saved: str, value: Any, want: str, how: str = "wrap it around") -> str:
    return (rf"the checkpoint's {saved} array at key path '[\w/]+' holds {value}, which the "
            rf"target's dtype {want} cannot hold \(from -?\d+ to \d+; a cast would {how}\)")


def test_numpy_targets(ckpt: Path) -> None:
    with pytest.raises(ss.TargetMismatchError, match=_refused("int64", _BIG + 7, "int32")
                       + r"; pass a target of dtype int64 there, or None"):
        ss.load(ckpt, {"big": np.zeros(8, np.int32)}, items=["big"])
    with pytest.raises(ss.TargetMismatchError, match=_refused("int64", -1, "uint64")):
        ss.load(ckpt, {"neg": np.zeros(2, np.uint64)}, items=["neg"])
    out = ss.load(ckpt, {"small": np.zeros(8, np.int8), "big": np.zeros(8, np.uint64),
                         "neg": np.zeros(2, np.int16)})
    assert out["small"].dtype == np.int8 and out["small"].tolist() == list(range(8))
    assert out["big"].tolist() == [_BIG + i for i in range(8)]
    assert out["neg"].dtype == np.int16 and out["neg"].tolist() == [-1, 2]


def test_torch_targets(ckpt: Path) -> None:
    torch = pytest.importorskip("torch")
    with pytest.raises(ss.TargetMismatchError, match=_refused("int64", _BIG + 7, "int32")):
        ss.load(ckpt, {"big": torch.zeros(8, dtype=torch.int32)}, items=["big"])
    with pytest.raises(ss.TargetMismatchError, match=_refused("int64", -1, "uint8")):
        ss.load(ckpt, {"neg": torch.zeros(2, dtype=torch.uint8)}, items=["neg"])
    out = ss.load(ckpt, {"small": torch.zeros(8, dtype=torch.int16)}, items=["small"])
    assert out["small"].dtype == torch.int16 and out["small"].tolist() == list(range(8))


def test_a_module_buffer_of_a_narrower_dtype(tmp_path: Path) -> None:
    """Inside a module: torch's own copy_ would wrap it as well."""
    torch = pytest.importorskip("torch")
    src = torch.nn.Module()
    src.register_buffer("count", torch.tensor([_BIG], dtype=torch.int64))
    ss.save(tmp_path / "c", {"m": src})
    dst = torch.nn.Module()
    dst.register_buffer("count", torch.zeros(1, dtype=torch.int32))
    with pytest.raises(ss.TargetMismatchError, match=_refused("int64", _BIG, "int32")):
        ss.load(tmp_path / "c", {"m": dst})
    assert dst.count.tolist() == [0]


_JAX = textwrap.dedent("""
    import json, sys
    import numpy as np, jax, jax.numpy as jnp, statestream as ss
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    path = sys.argv[1]
    mesh = Mesh(np.array(jax.devices()), ("x",))
    out = {}
    def run(name, target, items, at=path):
        try:
            got = ss.load(at, target, items=items)[items[0]]
            out[name] = ["ok", str(got.dtype), np.asarray(got).tolist()]
        except ss.CheckpointError as exc:
            out[name] = [type(exc).__name__, str(exc)]
    sharded = NamedSharding(mesh, P("x"))
    run("int32", {"big": jnp.zeros(8, jnp.int32)}, ["big"])
    run("sds_int64", {"big": jax.ShapeDtypeStruct((8,), np.int64)}, ["big"])
    run("sharded", {"big": jax.ShapeDtypeStruct((8,), np.int64, sharding=sharded)}, ["big"])
    run("small", {"small": jax.ShapeDtypeStruct((8,), np.int64, sharding=sharded)}, ["small"])
    jax.config.update("jax_enable_x64", True)  # saved by JAX as int64, loaded as saved
    ss.save(path + "-jax", {"v": jnp.arange(2, dtype=jnp.int64) + 2**40})
    jax.config.update("jax_enable_x64", False)
    run("none", {"v": None}, ["v"], path + "-jax")
    print(json.dumps(out))
""")


@pytest.mark.timeout(300)
def test_jax_targets_on_eight_devices(ckpt: Path) -> None:
    """Without jax_enable_x64 a JAX array holds no int64: an int64 target (or a sharded
    one, on 8 host devices) was an int32 array of wrapped values."""
    pytest.importorskip("jax")
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8",
           "JAX_PLATFORMS": "cpu"}
    env.pop("JAX_ENABLE_X64", None)
    r = subprocess.run([sys.executable, "-c", _JAX, str(ckpt)], capture_output=True,
                       text=True, timeout=240, env=env, check=False)
    assert r.returncode == 0, r.stderr
    out: dict[str, Any] = json.loads(r.stdout.splitlines()[-1])
    assert out["small"] == ["ok", "int32", list(range(8))]
    for name in ("int32", "sds_int64", "sharded", "none"):
        kind, msg = out[name]
        assert kind == "TargetMismatchError", out[name]
        assert "which the target's dtype int32 cannot hold" in msg
        assert "JAX makes int64 arrays 32-bit unless jax_enable_x64 is set" in msg


def test_floats_into_integer_targets(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    ss.save(tmp_path / "c", {"nan": np.array([1.0, np.nan], np.float32),
                             "big": np.array([3e10], np.float32),
                             "half": np.array([1.0, 2.5], np.float16),
                             "neg": np.array([1.0, -2.0]),
                             "bf": torch.tensor([1.0, 3e10], dtype=torch.bfloat16)})
    for key, target, value, want in (
            ("nan", np.zeros(2, np.int32), "nan", "int32"),
            ("nan", torch.zeros(2, dtype=torch.int64), "nan", "int64"),
            ("big", np.zeros(1, np.int32), r"30000001024\.0", "int32"),
            ("half", np.zeros(2, np.int64), r"2\.5", "int64"),
            ("neg", np.zeros(2, np.uint8), r"-2\.0", "uint8"),
            ("bf", torch.zeros(2, dtype=torch.int32), r"30064771072\.0", "int32")):
        saved = {"nan": "float32", "big": "float32", "half": "float16", "neg": "float64",
                 "bf": "bfloat16"}[key]
        with pytest.raises(ss.TargetMismatchError,
                           match=_refused(saved, value, want, "change it")
                           + f"; pass a target of dtype {saved} there, or None"):
            ss.load(tmp_path / "c", {key: target}, items=[key])
    out = ss.load(tmp_path / "c", {"neg": np.zeros(2, np.int8),
                                   "bf": torch.zeros(2, dtype=torch.int64)},
                  items=["neg", "bf"])
    assert out["neg"].tolist() == [1, -2] and out["bf"].tolist() == [1, 30064771072]


def test_narrow_ml_dtypes_integer_targets(tmp_path: Path) -> None:
    """int4/uint4/int2/uint2 (ml_dtypes, NumPy kind 'V') were not seen as integers: an
    int32 9 into an int4 target came back as -7, and 1.5 as 1, with no error."""
    import ml_dtypes

    ss.save(tmp_path / "c", {"i": np.arange(8, dtype=np.int32) * 3,
                             "n": np.array([-2, 1], np.int8).astype(ml_dtypes.int4),
                             "f": np.array([1.0, 1.5], np.float32)})
    for key, target, saved, value, want, how in (
            ("i", np.zeros(8, ml_dtypes.int4), "int32", 21, "int4", "wrap it around"),
            ("i", np.zeros(8, ml_dtypes.uint2), "int32", 21, "uint2", "wrap it around"),
            ("n", np.zeros(2, ml_dtypes.uint4), "int4", -2, "uint4", "wrap it around"),
            ("f", np.zeros(2, ml_dtypes.int4), "float32", r"1\.5", "int4", "change it")):
        with pytest.raises(ss.TargetMismatchError,
                           match=_refused(saved, value, want, how)
                           + f"; pass a target of dtype {saved} there, or None"):
            ss.load(tmp_path / "c", {key: target}, items=[key])
    out = ss.load(tmp_path / "c", {"n": np.zeros(2, np.int8), "i": np.zeros(8, np.int16)},
                  items=["n", "i"])
    assert out["n"].tolist() == [-2, 1] and out["i"].tolist() == [3 * i for i in range(8)]
    jax = pytest.importorskip("jax")
    with pytest.raises(ss.TargetMismatchError, match=_refused("int32", 21, "int4")):
        ss.load(tmp_path / "c", {"i": jax.ShapeDtypeStruct((8,), jax.numpy.int4)}, items=["i"])
    got = ss.load(tmp_path / "c", {"i": jax.ShapeDtypeStruct((8,), jax.numpy.int8)},
                  items=["i"])
    assert got["i"].dtype == jax.numpy.int8 and got["i"].tolist() == [3 * i for i in range(8)]


def test_jax_advice_names_x64_only_for_a_64_bit_array(tmp_path: Path) -> None:
    """The advice to set jax_enable_x64 came with every refusal into a JAX target, also
    for a negative int32 into a uint32 target, which x64 does not change."""
    jax = pytest.importorskip("jax")
    if jax.config.read("jax_enable_x64"):
        pytest.skip("the advice is for JAX without jax_enable_x64")
    ss.save(tmp_path / "c", {"neg": np.array([-1, 2], np.int32)})
    with pytest.raises(ss.TargetMismatchError,
                       match=_refused("int32", -1, "uint32")
                       + "; pass a target of dtype int32 there, or None$"):
        ss.load(tmp_path / "c", {"neg": jax.ShapeDtypeStruct((2,), jax.numpy.uint32)})


def test_bool_targets_take_only_zeros_and_ones_and_real_ones_no_imaginary_part(
        tmp_path: Path) -> None:
    """2, -7 and 0.5 loaded into a bool target as True, and a complex array into a real
    (float or integer) target lost its imaginary parts, with only NumPy's or torch's
    ComplexWarning: refused now, as for a narrower integer dtype, naming the value.
    Zeros and ones, bools, and complex values with no imaginary part still load."""
    torch = pytest.importorskip("torch")
    ss.save(tmp_path / "c", {"i": np.array([0, 1, 2, -7]), "f": np.array([0.0, 0.5, 3.0]),
                             "ok": np.array([0, 1, 1]), "z": np.array([1 + 2j, 3 - 4j],
                                                                       np.complex64),
                             "zr": np.array([1 + 0j, -2 + 0j]), "b": np.array([True, False])})
    c = tmp_path / "c"
    for key, target, value, want in (
            ("i", np.zeros(4, bool), "2", "bool"),
            ("i", torch.zeros(4, dtype=torch.bool), "2", "bool"),
            ("f", np.zeros(3, bool), r"0\.5", "bool"),
            ("z", np.zeros(2, np.float32), r"\(1\+2j\)", "float32"),
            ("z", torch.zeros(2), r"\(1\+2j\)", "float32"),
            ("z", np.zeros(2, np.int32), r"\(1\+2j\)", "int32")):
        saved = {"i": "int64", "f": "float64", "z": "complex64"}[key]
        with pytest.raises(ss.TargetMismatchError,
                           match=rf"the checkpoint's {saved} array at key path '{key}' holds "
                                 rf"{value}: .*into the target's dtype {want}; pass a target "
                                 rf"of dtype {saved} there, or None"):
            ss.load(c, {key: target}, items=[key])
    out = ss.load(c, {"ok": np.zeros(3, bool), "zr": np.zeros(2, np.int8),
                      "b": torch.zeros(2, dtype=torch.bool)}, items=["ok", "zr", "b"])
    assert out["ok"].tolist() == [False, True, True] and out["zr"].tolist() == [1, -2]
    assert out["b"].tolist() == [True, False]
