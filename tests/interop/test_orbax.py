"""Orbax checkpoints, read through orbax-checkpoint (the optional extra)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest

import statestream as ss
from statestream.interop import detect_format

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _peak import peak_growth  # noqa: E402

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
    with pytest.raises(ss.CheckpointError, match=r"items extra, state; pass one item") as ei:
        ss.load(tmp_path / "two" / "1")
    # it suggested the first item, 'extra', a JSON item that then failed to load
    assert os.path.join(str(tmp_path / "two" / "1"), "state") in str(ei.value)
    assert "not PyTree items, which statestream does not read: extra" in str(ei.value)
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


def _save_orbax(path: Path, state: dict, **handler: object) -> None:
    ocp = pytest.importorskip("orbax.checkpoint")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ck = ocp.Checkpointer(ocp.PyTreeCheckpointHandler(**handler))
        ck.save(path, state)


@pytest.mark.parametrize("layout", [{}, {"use_ocdbt": False}, {"use_zarr3": True}],
                         ids=["ocdbt", "one-directory-per-array", "zarr3"])
def test_every_orbax_layout_reads_bit_exact(tmp_path: Path, layout: dict) -> None:
    """Arrays are read through the tensorstore spec orbax builds for its layout (OCDBT or
    a directory per array, zarr v2 or v3); numbers and strings through orbax's restore."""
    state = {"params": {f"a{i}": _arr(dt, 40 + i) for i, dt in enumerate(DTYPES)},
             "step": 5, "lr": 0.125, "name": "run-7", "hist": [np.arange(3.0), 2]}
    _save_orbax(tmp_path / "o", state, **layout)
    out = ss.load(tmp_path / "o")
    for k, a in state["params"].items():  # type: ignore[attr-defined]
        b = out["params"][k]
        assert a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
    assert (out["step"], out["lr"], out["name"]) == (5, 0.125, "run-7")
    assert out["hist"][0].tobytes() == np.arange(3.0).tobytes() and out["hist"][1] == 2
    into = {"params": {k: np.zeros_like(v) for k, v in state["params"].items()}}  # type: ignore[attr-defined]
    ss.load(tmp_path / "o", into, in_place=True, items=["params"])
    assert into["params"]["a5"].tobytes() == state["params"]["a5"].tobytes()  # type: ignore[index]


def test_an_array_in_several_storage_chunks_is_read_chunk_by_chunk(tmp_path: Path) -> None:
    """Each storage chunk (a shard, or what ``chunk_byte_size`` makes) is one chunk of
    the manifest, read on its own; a load of some rows, and loads on several threads
    with reads ahead, give the same bytes."""
    ocp = pytest.importorskip("orbax.checkpoint")
    from statestream.interop import open_foreign

    w = np.random.default_rng(0).standard_normal((256, 64)).astype(np.float32)
    tiny = np.arange(4096 * 4, dtype=np.int32).reshape(4096, 4)
    state = {"w": w, "tiny": tiny, "v": np.arange(10.0)}
    args = {"w": ocp.SaveArgs(chunk_byte_size=8192), "tiny": ocp.SaveArgs(chunk_byte_size=16),
            "v": ocp.SaveArgs()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ocp.PyTreeCheckpointer().save(tmp_path / "o",
                                      args=ocp.args.PyTreeSave(state, save_args=args))
    f = open_foreign(tmp_path / "o")
    assert f is not None
    try:
        by_shape = {a.shape: a for a in f.manifest.arrays}
        assert len(by_shape[(256, 64)].chunks) == 8  # 8 KiB chunks of 32 rows
        # thousands of storage chunks: described in bands of whole chunk rows instead
        assert len(by_shape[(4096, 4)].chunks) == 1
    finally:
        f.reader.close()
    for threads in (1, 4):
        out = ss.load(tmp_path / "o", io=ss.IOOptions(num_threads=threads))
        assert out["w"].tobytes() == w.tobytes() and out["tiny"].tobytes() == tiny.tobytes()
    only = ss.load(tmp_path / "o", items=["tiny"])
    assert set(only) == {"tiny"} and only["tiny"].tobytes() == tiny.tobytes()
    ss.convert(tmp_path / "o", tmp_path / "ck",
               memory=ss.MemoryOptions(memory_budget_bytes=1 << 20))
    assert ss.load(tmp_path / "ck")["w"].tobytes() == w.tobytes()


def test_storage_chunks_become_bands_when_there_are_too_many() -> None:
    from statestream.interop._orbax import MAX_BLOCKS, _blocks

    assert _blocks((10, 6), (4, 4), 4) == [((0, 0), (4, 4)), ((0, 4), (4, 2)), ((4, 0), (4, 4)),
                                          ((4, 4), (4, 2)), ((8, 0), (2, 4)), ((8, 4), (2, 2))]
    assert _blocks((10, 6), None, 4) == [((0, 0), (10, 6))]
    assert _blocks((10, 6), (0, 4), 4) == _blocks((10, 6), (4,), 4) == [((0, 0), (10, 6))]
    assert _blocks((), (), 4) == [((), ())] and _blocks((0, 3), (1, 1), 4) == []
    # 8192 storage chunks of one 1 KiB row: bands of 4096 rows (4 MiB), whole chunk rows
    assert _blocks((8192, 256), (1, 256), 4) == [((0, 0), (4096, 256)), ((4096, 0), (4096, 256))]
    # bands never exceed MAX_BLOCKS, even of rows far smaller than 4 MiB
    bands = _blocks((10**6, 1), (1, 1), 1)
    assert len(bands) <= MAX_BLOCKS and sum(b[1][0] for b in bands) == 10**6


def test_a_link_in_an_orbax_checkpoint_is_refused(tmp_path: Path) -> None:
    """Tensorstore opens orbax's files by path and would follow a link out of the
    checkpoint: a symbolic link anywhere under it is refused before anything is read."""
    _save_orbax(tmp_path / "o", {"w": np.arange(4096, dtype=np.float32)})
    data = max((p for p in (tmp_path / "o").rglob("*") if p.is_file()),
               key=lambda p: p.stat().st_size)
    outside = tmp_path / "elsewhere"
    outside.write_bytes(data.read_bytes())
    data.unlink()
    data.symlink_to(outside)
    for call in (lambda: ss.load(tmp_path / "o"), lambda: ss.metadata(tmp_path / "o"),
                 lambda: ss.convert(tmp_path / "o", tmp_path / "ck")):
        with pytest.raises(ss.UnsafeCheckpointError, match="not a regular file"):
            call()
    assert not (tmp_path / "ck").exists()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_converting_an_orbax_checkpoint_does_not_hold_the_state(tmp_path: Path) -> None:
    """Arrays are read one storage chunk at a time: converting 256 MiB of Orbax under a
    32 MiB budget, or loading one of its arrays, grows peak RSS by far less than the state
    (restored whole by orbax first, it grew by more than the state)."""
    state = {f"w{i}": np.full((1024, 1024), i, np.float32) for i in range(64)}  # 4 MiB each
    _save_orbax(tmp_path / "o", state)
    del state
    _save_orbax(tmp_path / "small", {"w": np.arange(1024.0), "step": 1})
    # the budget, 32 MiB read ahead, slack (measured: +32 and +28 MiB; +268 before)
    warm = "import statestream as ss; ss.load(argv[1])"  # orbax, tensorstore, first reads
    for work, bound in (
            ("ss.convert(argv[0], argv[2], memory=ss.MemoryOptions(memory_budget_bytes=32 << 20))",
             96 << 20),
            ("ss.load(argv[0], items=['w3'])", 80 << 20)):
        growth = peak_growth(warm, work, str(tmp_path / "o"), str(tmp_path / "small"),
                             str(tmp_path / "ck"))
        assert growth < bound, f"peak RSS grew by {growth} bytes reading 256 MiB ({work})"
    out = ss.load(tmp_path / "ck", items=["w63"])["w63"]
    assert out.shape == (1024, 1024) and (out == 63).all()


def test_convert_to_orbax_goes_in_batches_under_a_small_budget(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Under a budget smaller than the state, the tree goes to orbax as several partial
    saves of one checkpoint (a dict's entries split between them, a list whole), and
    the result reads as one StandardCheckpointer checkpoint."""
    ocp = pytest.importorskip("orbax.checkpoint")
    from orbax.checkpoint.experimental import v1

    saved: list[list[str]] = []
    plain = v1.partial.save

    def counted(path: Any, tree: Any, **kw: Any) -> None:
        saved.append(sorted(map(str, tree)))
        plain(path, tree, **kw)

    monkeypatch.setattr(v1.partial, "save", counted)
    state = {"params": {f"l{i}": {"w": _arr(np.float32, i).repeat(8192, axis=0),
                                  "b": np.arange(4.0) + i} for i in range(6)},
             "opt": [np.ones((512, 256), np.float32), {"m": np.zeros(5, np.float16)}],
             "step": 9, "by_index": {0: np.arange(3), 1: 2.5}}
    ss.save(tmp_path / "ck", state)
    ss.convert(tmp_path / "ck", tmp_path / "o", to="orbax",
               memory=ss.MemoryOptions(memory_budget_bytes=1 << 20))
    # 768 KiB per layer's w, 1 MiB at a time: a save per layer, the list in one piece
    assert len(saved) >= 6 and sum("opt" in keys for keys in saved) == 1, saved
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = ocp.StandardCheckpointer().restore(tmp_path / "o")
    for i in range(6):
        for k in ("w", "b"):
            a, b = state["params"][f"l{i}"][k], np.asarray(got["params"][f"l{i}"][k])  # type: ignore[index]
            assert a.dtype == b.dtype and a.tobytes() == b.tobytes()
    assert np.asarray(got["opt"][0]).tobytes() == state["opt"][0].tobytes()  # type: ignore[index]
    assert np.asarray(got["opt"][1]["m"]).dtype == np.float16
    assert int(got["step"]) == 9 and float(got["by_index"]["1"]) == 2.5
    out = ss.load(tmp_path / "o")
    assert out["params"]["l5"]["w"].tobytes() == state["params"]["l5"]["w"].tobytes()  # type: ignore[index]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_converting_to_orbax_does_not_hold_the_state(tmp_path: Path) -> None:
    """256 MiB converted to Orbax under a 32 MiB budget: the arrays go to orbax 8 MiB
    at a time, so peak RSS grows by far less than the state (measured +27 MiB;
    orbax holding the whole tree, +516 MiB)."""
    pytest.importorskip("orbax.checkpoint")
    state = {f"w{i}": np.full((1024, 1024), i, np.float32) for i in range(64)}  # 4 MiB each
    ss.save(tmp_path / "ck", state)
    del state
    ss.save(tmp_path / "small", {"w": np.arange(1024.0), "step": 1})
    growth = peak_growth(
        "import statestream as ss; ss.convert(argv[2], argv[1] + '-warm', to='orbax')",
        "ss.convert(argv[0], argv[1], to='orbax', "
        "memory=ss.MemoryOptions(memory_budget_bytes=32 << 20))",
        str(tmp_path / "ck"), str(tmp_path / "o"), str(tmp_path / "small"))
    assert growth < (96 << 20), f"peak RSS grew by {growth} bytes converting 256 MiB"
    out = ss.load(tmp_path / "o", items=["w63"])["w63"]
    assert out.shape == (1024, 1024) and (out == 63).all()


def test_an_orbax_checkpoint_still_being_written_is_refused(tmp_path: Path) -> None:
    """orbax writes into ``<name>.orbax-checkpoint-tmp-<n>`` and renames it when done:
    such a directory is incomplete, as orbax's own restore says."""
    _save_orbax(tmp_path / "o", {"w": np.arange(8.0)})
    (tmp_path / "o").rename(tmp_path / "o.orbax-checkpoint-tmp-1733400000")
    with pytest.raises(ss.CheckpointCorruptError, match="still being written"):
        ss.load(tmp_path / "o.orbax-checkpoint-tmp-1733400000")


@pytest.mark.parametrize("key", ["<planted>", "../elsewhere", "a/../../elsewhere"])
def test_an_orbax_array_name_outside_the_checkpoint_is_refused_before_orbax_reads(
        tmp_path: Path, key: str) -> None:
    """Without OCDBT an array is the directory its key path names: a _METADATA whose key
    path is absolute or climbs out is refused before orbax reads a file (orbax's own
    metadata() read the zarr metadata an absolute one pointed at)."""
    _save_orbax(tmp_path / "o", {"w": np.arange(8.0), "s": 1}, use_ocdbt=False)
    planted = tmp_path / "elsewhere"
    (tmp_path / "o" / "w").rename(planted)
    key = str(planted) if key == "<planted>" else key
    meta_path = tmp_path / "o" / "_METADATA"
    meta = json.loads(meta_path.read_text())
    entry = meta["tree_metadata"].pop("('w',)")
    entry["key_metadata"][0]["key"] = key
    meta["tree_metadata"][repr((key,))] = entry
    meta_path.write_text(json.dumps(meta))
    for call in (lambda: ss.load(tmp_path / "o"), lambda: ss.metadata(tmp_path / "o")):
        with pytest.raises(ss.UnsafeCheckpointError, match="not names inside the checkpoint"):
            call()


def test_an_orbax_key_with_a_slash_stays_inside_and_loads(tmp_path: Path) -> None:
    _save_orbax(tmp_path / "o", {"a/b": np.arange(8.0), "s": 1}, use_ocdbt=False)
    assert ss.load(tmp_path / "o")["a/b"].tobytes() == np.arange(8.0).tobytes()


def test_a_damaged_array_metadata_fails_without_printing_orbax_abandoned_work(
        tmp_path: Path) -> None:
    """orbax opens every array at once on an event loop of its own and closes the loop
    when one fails; the other opens, finishing later, printed a 'RuntimeError: Event
    loop is closed' traceback each on stderr (found by fuzzing). The caller gets the
    error, and stderr stays quiet."""
    state = {f"a{i:02d}": np.arange(64.0) + i for i in range(40)}
    _save_orbax(tmp_path / "o", state, use_ocdbt=False)
    (tmp_path / "o" / "a07" / ".zarray").write_text("{not json")
    code = ("import time, statestream as ss\n"
            "for call in (ss.metadata, ss.load, ss.verify):\n"
            "    try:\n"
            f"        r = call({str(tmp_path / 'o')!r})\n"
            "        print('RESULT', getattr(r, 'ok', r) if call is ss.verify else 'no error')\n"
            "    except ss.CheckpointCorruptError as e:\n"
            "        print('ERR', e)\n"
            "time.sleep(1)  # the abandoned opens finish meanwhile\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=300, check=False, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert len(lines) == 3 and all("a07/.zarray" in ln for ln in lines[:2]), r.stdout
    assert lines[2] == "RESULT False", r.stdout
    assert "Traceback" not in r.stderr and "Event loop is closed" not in r.stderr, r.stderr


@pytest.mark.parametrize("layout", [{}, {"use_ocdbt": False}], ids=["ocdbt", "per-array"])
def test_a_typed_prng_key_saved_by_orbax_loads_as_one(tmp_path: Path, layout: dict) -> None:
    # orbax stores a typed key's data as uint32 and its impl in array_metadatas; it
    # loaded as plain key data, and a key target failed ("the checkpoint has (2,)
    # (uint32), the target has ()")
    jax = pytest.importorskip("jax")
    state = {"rng": jax.random.key(3), "rbg": jax.random.split(jax.random.key(4, impl="rbg")),
             "w": np.arange(4.0)}
    _save_orbax(tmp_path / "o", state, **layout)
    target = {"rng": jax.random.key(0), "rbg": jax.random.split(jax.random.key(0, impl="rbg")),
              "w": np.zeros(4)}
    for like in (target, jax.eval_shape(lambda: target)):
        out = ss.load(tmp_path / "o", like)
        for k in ("rng", "rbg"):
            assert out[k].dtype == state[k].dtype, k
            assert np.array_equal(jax.random.key_data(out[k]), jax.random.key_data(state[k]))
    bare = ss.load(tmp_path / "o")  # no target: a key's saved state, as statestream's own
    assert bare["rng"]["impl"] == "threefry2x32"
    assert bare["rng"]["data"].tolist() == jax.random.key_data(state["rng"]).tolist()


def test_converting_a_dtype_tensorstore_lacks_to_orbax_is_refused_by_name(
        tmp_path: Path) -> None:
    pytest.importorskip("orbax.checkpoint")
    ss.save(tmp_path / "c", {"m": {"q": np.ones((4, 4), ml_dtypes.uint4),
                                   "w": np.ones(3, np.float32)}})
    with pytest.raises(ss.UnsupportedTypeError, match=r"'m/q' \(dtype uint4, which "
                                                      r"tensorstore cannot store\)"):
        ss.convert(tmp_path / "c", tmp_path / "o", to="orbax")
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("state,match", [
    (5, r"'<root>' \(a number as the whole state\)"),
    (2.5, r"'<root>' \(a number as the whole state\)"),
    # orbax: "Found empty item" (a bare ValueError), its thread then wrote into the
    # removed staging directory, which stayed beside the output
    ({}, r"'<root>' \(an empty dict as the whole state\)"),
    ([], r"'<root>' \(an empty list as the whole state\)"),
    ({"m": {1: np.ones(2), "b": np.ones(2)}}, r"'m' \(a mapping with both int and str keys\)"),
    # orbax names a leaf by its key path joined with ".": it wrote both as "a.b" and
    # restored the first under both names, the second array lost without a word
    ({"a": {"b": np.ones(2)}, "a.b": np.zeros(2)}, r"'a/b' and 'a\.b' \(orbax names both"),
    ({"a": [1.0], "a.0": 2.0}, r"'a/0' and 'a\.0' \(orbax names both"),
    # NumPy makes an object array of it, which tensorstore refused with a bare ValueError
    ({"w": np.ones(2), "big": 2**80}, r"'big' \(an int beyond 64 bits\)"),
    # written, then refused by statestream's own reader
    ({"a\0b": np.ones(2)}, r"a key with a NUL character"),
])
def test_a_state_orbax_cannot_take_is_refused_by_name_leaving_nothing(
        tmp_path: Path, state: object, match: str) -> None:
    """orbax refuses a number as the whole state, and jax cannot sort a dict's int and
    str keys: both failed inside orbax with a bare ValueError, and orbax's abandoned
    work could leave a staging directory beside the output after the failure. Two leaves
    orbax names alike, or a name statestream cannot read back, are refused too."""
    pytest.importorskip("orbax.checkpoint")
    ss.save(tmp_path / "c", state)
    with pytest.raises(ss.UnsupportedTypeError, match=match):
        ss.convert(tmp_path / "c", tmp_path / "o", to="orbax")
    assert sorted(os.listdir(tmp_path)) == ["c"]
