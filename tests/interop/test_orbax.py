"""Orbax checkpoints, read through orbax-checkpoint (the optional extra)."""

from __future__ import annotations

import subprocess
import sys
import warnings
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

import statestream as ss
from statestream.interop import detect_format

DTYPES = [np.bool_, np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32,
          np.uint64, np.float16, np.float32, np.float64, ml_dtypes.bfloat16]


def _arr(dtype: object, seed: int) -> np.ndarray:
    raw = np.random.default_rng(seed).integers(0, 256, 24 * np.dtype(dtype).itemsize,  # type: ignore[call-overload]
                                                 dtype=np.uint8)
    if dtype is np.bool_:
        return (raw[:24] & 1).astype(bool).reshape(4, 6)
    return raw.view(dtype).reshape(4, 6)


def test_reads_orbax_bit_exact(tmp_path: Path) -> None:
    ocp = pytest.importorskip("orbax.checkpoint")
    state = {"params": {f"a{i}": _arr(dt, i) for i, dt in enumerate(DTYPES)},
             "step": 3, "hist": [np.zeros(2), 1.5]}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ck = ocp.StandardCheckpointer()
        ck.save(tmp_path / "o", state)
        ck.wait_until_finished()
    assert detect_format(tmp_path / "o") == "orbax"
    out = ss.load(tmp_path / "o")
    for i, _ in enumerate(DTYPES):
        a, b = state["params"][f"a{i}"], out["params"][f"a{i}"]  # type: ignore[index]
        assert a.dtype == b.dtype and a.tobytes() == b.tobytes()
    assert out["step"] == 3 and out["hist"][1] == 1.5
    assert ss.metadata(tmp_path / "o").format == "orbax"
    ss.convert(tmp_path / "o", tmp_path / "ck")
    back = ss.load(tmp_path / "ck")
    assert back["params"]["a12"].tobytes() == state["params"]["a12"].tobytes()  # type: ignore[index]


def test_missing_orbax_names_the_extra(tmp_path: Path) -> None:
    (tmp_path / "o").mkdir()
    (tmp_path / "o" / "_CHECKPOINT_METADATA").write_text("{}")
    code = ("import sys\nsys.modules['orbax'] = None\nimport statestream as ss\n"
            "try:\n"
            f"    ss.load({str(tmp_path / 'o')!r})\n"
            "except ImportError as e:\n    print('ERR', type(e).__name__, e)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=120, check=False)
    assert r.returncode == 0, r.stderr
    assert "ERR MissingDependencyError" in r.stdout and "statestream[orbax]" in r.stdout


def test_convert_to_orbax_restored_by_orbax(tmp_path: Path) -> None:
    ocp = pytest.importorskip("orbax.checkpoint")
    state = {"params": {f"a{i}": _arr(dt, 20 + i) for i, dt in enumerate(DTYPES)},
             "step": 4, "hist": [np.ones(3), 2.5]}
    ss.save(tmp_path / "ck", state)
    ss.convert(tmp_path / "ck", tmp_path / "o", to="orbax")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = ocp.StandardCheckpointer().restore(tmp_path / "o")
    for i, _ in enumerate(DTYPES):
        a, b = state["params"][f"a{i}"], np.asarray(got["params"][f"a{i}"])  # type: ignore[index]
        assert a.dtype == b.dtype and a.tobytes() == b.tobytes()
    assert int(got["step"]) == 4
    ss.save(tmp_path / "ck2", {"w": np.zeros(2), "name": "run", "none": None})
    with pytest.raises(ss.UnsupportedTypeError, match=r"'name' \(str\), 'none' \(none\)"):
        ss.convert(tmp_path / "ck2", tmp_path / "o2", to="orbax")
    assert not (tmp_path / "o2").exists()
    ss.save(tmp_path / "ck3", {"w": np.zeros(2), "opt": {"empty": np.zeros((0, 4))}})
    with pytest.raises(ss.UnsupportedTypeError,
                       match=r"'opt/empty' \(an empty array, shape \(0, 4\)\)"):
        ss.convert(tmp_path / "ck3", tmp_path / "o3", to="orbax")
    assert not (tmp_path / "o3").exists()


def test_a_checkpoint_manager_step_reads_its_one_item(tmp_path: Path) -> None:
    """A CheckpointManager step holds one subdirectory per item: with one item (orbax's
    ``default``) the step reads as it; with several the error names them."""
    ocp = pytest.importorskip("orbax.checkpoint")
    w = np.arange(6.0).reshape(2, 3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with ocp.CheckpointManager(tmp_path / "one") as mgr:
            mgr.save(1, args=ocp.args.StandardSave({"w": w, "step": 1}))
        with ocp.CheckpointManager(tmp_path / "two", item_names=("state", "extra")) as mgr:
            mgr.save(1, args=ocp.args.Composite(state=ocp.args.StandardSave({"w": w}),
                                                extra=ocp.args.JsonSave({"a": 1})))
    out = ss.load(tmp_path / "one" / "1")
    assert out["step"] == 1 and out["w"].tobytes() == w.tobytes()
    assert ss.metadata(tmp_path / "one" / "1").tree["w"].shape == (2, 3)
    with pytest.raises(ss.CheckpointError, match=r"items extra, state; pass one item"):
        ss.load(tmp_path / "two" / "1")
    assert ss.load(tmp_path / "two" / "1" / "state")["w"].tobytes() == w.tobytes()


def test_a_0d_array_round_trips_through_orbax_as_0d(tmp_path: Path) -> None:
    """Step counters and scalar losses are 0-d: reading an Orbax checkpoint (or one
    converted to Orbax) keeps their shape () instead of making them shape (1,)."""
    pytest.importorskip("orbax.checkpoint")
    state = {"count": np.array(7, np.int32), "loss": np.array(0.25, np.float64),
             "w": np.arange(6.0, dtype=np.float32).reshape(2, 3)}
    ss.save(tmp_path / "ck", state)
    ss.convert(tmp_path / "ck", tmp_path / "o", to="orbax")
    assert ss.metadata(tmp_path / "o").tree["count"].shape == ()
    out = ss.load(tmp_path / "o")
    for k, v in state.items():
        assert out[k].shape == v.shape and out[k].dtype == v.dtype
        assert out[k].tobytes() == v.tobytes()
    into = ss.load(tmp_path / "o", {k: np.zeros_like(v) for k, v in state.items()},
                   in_place=True)
    assert into["count"].shape == () and int(into["count"]) == 7
    ss.convert(tmp_path / "o", tmp_path / "back")
    assert ss.load(tmp_path / "back")["loss"].shape == ()


@pytest.mark.parametrize("damage", ["truncate_data", "garble_metadata", "remove_data"])
def test_a_damaged_orbax_checkpoint_is_a_corrupt_error(tmp_path: Path, damage: str) -> None:
    """Whatever orbax or tensorstore raise for a damaged checkpoint, load, metadata and
    convert raise CheckpointCorruptError naming the directory."""
    ocp = pytest.importorskip("orbax.checkpoint")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ck = ocp.StandardCheckpointer()
        ck.save(tmp_path / "o", {"w": np.arange(4096, dtype=np.float32), "s": 3})
        ck.wait_until_finished()
    files = sorted(p for p in (tmp_path / "o").rglob("*") if p.is_file())
    data = [p for p in files if "d" in p.parent.name or p.parent.name.startswith("ocdbt")]
    data = data or [max(files, key=lambda p: p.stat().st_size)]
    if damage == "truncate_data":
        for p in data:
            p.write_bytes(p.read_bytes()[: p.stat().st_size // 3])
    elif damage == "remove_data":
        for p in data:
            p.unlink()
    else:
        (tmp_path / "o" / "_METADATA").write_text("{not json")
    for call in (lambda: ss.load(tmp_path / "o"),
                 lambda: ss.convert(tmp_path / "o", tmp_path / "ck")):
        with pytest.raises(ss.CheckpointCorruptError, match="orbax could not restore"):
            call()
