"""Hostile foreign checkpoints (torch.save files, DCP): nothing allocated on a pickle's word."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import struct
import subprocess
import sys
import textwrap
import warnings
import zipfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

import statestream as ss
from statestream.interop._torchfile import RestrictedUnpickler, StorageType

from .conftest import run_cli

_CHILD = textwrap.dedent("""
    import json, resource, sys
    limit = 2 << 30  # the bombs below ask for far more: they fail here rather than swap
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    import statestream as ss
    try:
        out = ["ok", repr(ss.load(sys.argv[1]))[:200]]
    except BaseException as exc:
        out = [type(exc).__name__, str(exc)]
    print(json.dumps(out))
""")


def _load_capped(path: Path) -> list[str]:
    r = subprocess.run([sys.executable, "-c", _CHILD, str(path)], capture_output=True,
                       text=True, timeout=120, check=False)
    assert r.returncode == 0, r.stderr
    out: list[str] = json.loads(r.stdout.splitlines()[-1])
    return out


def _torch_file(path: Path, data_pkl: bytes) -> Path:
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("archive/data.pkl", data_pkl)
        z.writestr("archive/version", "3\n")
    return path


def test_a_memo_index_far_past_the_pickle_is_refused(tmp_path: Path) -> None:
    """LONG_BINPUT 2**31 in a 15-byte pickle: Python's unpickler would first grow its
    memo table to 2**32 entries (32 GiB)."""
    bomb = b"\x80\x02}r" + (1 << 31).to_bytes(4, "little") + b"."
    p = _torch_file(tmp_path / "memo.pt", bomb)
    kind, msg = _load_capped(p)
    assert kind == "CheckpointCorruptError" and "memo entry 2147483648" in msg, msg
    assert "memo.pt" in msg


def test_a_bytearray_of_a_count_is_refused(tmp_path: Path) -> None:
    """builtins.bytearray is admitted (pickles rebuild bytearrays with it), but called
    with an int it would allocate that many zeroed bytes: 8 GiB from a 60-byte file."""
    bomb = (b"\x80\x02}X\x01\x00\x00\x00xcbuiltins\nbytearray\n\x8a\x05"
            + (8 << 30).to_bytes(5, "little") + b"\x85Rs.")
    p = _torch_file(tmp_path / "bytearray.pt", bomb)
    kind, msg = _load_capped(p)
    assert kind == "CheckpointCorruptError" and "bytearray(8589934592,)" in msg, msg


@pytest.mark.parametrize("proto", [2, 3, 4, 5])
def test_bytearrays_pickles_write_still_unpickle(proto: int) -> None:
    value = [bytearray(b"ab\xff\x00"), bytearray(), {1, 2}, complex(1, 2)]
    data = pickle.dumps(value, proto).replace(b"__builtin__", b"builtins")
    assert RestrictedUnpickler(data, "x").load() == value


def test_a_pickle_cannot_change_the_stand_ins_of_later_loads() -> None:
    """BUILD on a global sets attributes on what find_class returned: a shared
    stand-in would carry a hostile file's dtype into every later file."""
    poison = (b"\x80\x02ctorch.storage\nUntypedStorage\n}X\x05\x00\x00\x00dtype"
              b"X\x07\x00\x00\x00float64sb.")
    assert RestrictedUnpickler(poison, "hostile").load() == StorageType("float64")
    clean = b"\x80\x02ctorch.storage\nUntypedStorage\n."
    assert RestrictedUnpickler(clean, "later").load() == StorageType("uint8")


def test_garbage_in_a_pickle_is_corrupt_naming_the_file() -> None:
    with pytest.raises(ss.CheckpointCorruptError, match="where.pkl"):
        RestrictedUnpickler(b"\x80\x02}q\x00(", "where.pkl").load()


# ----------------------------------------------------------------------------- files


def _safetensors(path: Path, a: np.ndarray) -> None:
    header = json.dumps({"a": {"dtype": "F32", "shape": list(a.shape),
                               "data_offsets": [0, a.nbytes]}}).encode()
    path.write_bytes(struct.pack("<Q", len(header)) + header + a.tobytes())


def _to_symlink_out(p: Path) -> None:
    outside = p.parent.parent / f"outside-{p.name}"
    shutil.move(p, outside)
    p.symlink_to(outside)


def _to_fifo(p: Path) -> None:
    p.unlink()
    os.mkfifo(p)


def _to_dir(p: Path) -> None:
    p.unlink()
    p.mkdir()


def _remove(p: Path) -> None:
    p.unlink()


_SPECIAL: dict[str, Callable[[Path], None]] = {
    "symlink": _to_symlink_out, "fifo": _to_fifo, "dir": _to_dir, "missing": _remove}


def _sharded(tmp_path: Path) -> Path:
    d = tmp_path / "hf"
    d.mkdir()
    _safetensors(d / "s1.safetensors", np.arange(3, dtype=np.float32))
    (d / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"a": "s1.safetensors"}}))
    return d


@pytest.mark.timeout(60)  # a FIFO that blocks fails the test instead of hanging
@pytest.mark.parametrize("kind", sorted(_SPECIAL))
@pytest.mark.parametrize("which", ["s1.safetensors", "model.safetensors.index.json"])
def test_a_shard_or_index_that_is_not_a_plain_file(tmp_path: Path, kind: str,
                                                   which: str) -> None:
    d = _sharded(tmp_path)
    if kind == "missing" and which != "s1.safetensors":
        pytest.skip("without its index the directory is not sharded safetensors")
    _SPECIAL[kind](d / which)
    err = ss.UnsafeCheckpointError if kind != "missing" else ss.TruncatedFileError
    for read in (ss.load, ss.metadata):
        with pytest.raises(err, match=which):
            read(d)
    report = ss.verify(d)
    assert not report.ok and which in report.problems[0]
    r = run_cli("inspect", str(d))
    assert r.returncode == 2 and "Traceback" not in r.stderr and which in r.stderr


def _dcp(tmp_path: Path) -> Path:
    torch = pytest.importorskip("torch")
    dcp = pytest.importorskip("torch.distributed.checkpoint")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"w": torch.arange(4.0), "step": 3}, checkpoint_id=str(tmp_path / "dcp"))
    return tmp_path / "dcp"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", sorted(_SPECIAL))
@pytest.mark.parametrize("which", [".metadata", "__0_0.distcp"])
def test_dcp_files_that_are_not_plain_files(tmp_path: Path, kind: str, which: str) -> None:
    d = _dcp(tmp_path)
    if kind == "missing" and which == ".metadata":
        pytest.skip("without it the directory is not DCP")
    _SPECIAL[kind](d / which)
    err = ss.UnsafeCheckpointError if kind != "missing" else ss.TruncatedFileError
    for read in (ss.load, ss.metadata):
        with pytest.raises(err, match=which):
            read(d)


def test_a_file_the_caller_names_through_a_link_loads(tmp_path: Path) -> None:
    """A hub cache links snapshots/<rev>/model.safetensors to blobs/<hash>: the link the
    caller names is followed once, and header and data come from the same file."""
    (tmp_path / "blobs").mkdir()
    (tmp_path / "snap").mkdir()
    _safetensors(tmp_path / "blobs" / "abc", np.arange(3, dtype=np.float32))
    (tmp_path / "snap" / "model.safetensors").symlink_to("../blobs/abc")
    out = ss.load(tmp_path / "snap" / "model.safetensors")
    np.testing.assert_array_equal(out["a"], np.arange(3, dtype=np.float32))
    assert ss.verify(tmp_path / "snap" / "model.safetensors").ok


def _hub_snapshot(tmp_path: Path) -> Path:
    """A hub cache repository: blobs/<hash> files, snapshots/<rev>/<name> links to them."""
    repo = tmp_path / "models--org--tiny"
    (repo / "blobs").mkdir(parents=True)
    snap = repo / "snapshots" / "0123abcd"
    snap.mkdir(parents=True)
    _safetensors(repo / "blobs" / "b1", np.arange(3, dtype=np.float32))
    header = json.dumps({"b": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}).encode()
    (repo / "blobs" / "b2").write_bytes(struct.pack("<Q", len(header)) + header
                                        + (np.arange(4, dtype=np.float32) * 2).tobytes())
    (repo / "blobs" / "bi").write_text(json.dumps(
        {"weight_map": {"a": "model-00001-of-00002.safetensors",
                        "b": "model-00002-of-00002.safetensors"}}))
    (snap / "model.safetensors.index.json").symlink_to("../../blobs/bi")
    (snap / "model-00001-of-00002.safetensors").symlink_to("../../blobs/b1")
    (snap / "model-00002-of-00002.safetensors").symlink_to("../../blobs/b2")
    return snap


def test_a_sharded_hub_cache_snapshot_loads_through_its_links(tmp_path: Path) -> None:
    snap = _hub_snapshot(tmp_path)
    out = ss.load(snap)
    np.testing.assert_array_equal(out["a"], np.arange(3, dtype=np.float32))
    np.testing.assert_array_equal(out["b"], np.arange(4, dtype=np.float32) * 2)
    meta = ss.metadata(snap)
    assert meta.format == "safetensors-sharded" and meta.tree["b"].shape == (4,)
    assert ss.verify(snap).ok
    ss.convert(snap, tmp_path / "converted")
    np.testing.assert_array_equal(ss.load(tmp_path / "converted")["b"], out["b"])


@pytest.mark.parametrize("where", ["outside the repository", "another repository's blobs",
                                   "a subdirectory of blobs"])
def test_a_hub_snapshot_link_elsewhere_is_refused(tmp_path: Path, where: str) -> None:
    snap = _hub_snapshot(tmp_path)
    link = snap / "model-00002-of-00002.safetensors"
    blob = snap.parent.parent / "blobs" / "b2"
    if where == "outside the repository":
        target = tmp_path / "elsewhere.safetensors"
    elif where == "another repository's blobs":
        (tmp_path / "models--other" / "blobs").mkdir(parents=True)
        target = tmp_path / "models--other" / "blobs" / "b2"
    else:
        (blob.parent / "sub").mkdir()
        target = blob.parent / "sub" / "b2"
    shutil.copy(blob, target)
    link.unlink()
    link.symlink_to(target)
    for read in (ss.load, ss.metadata):
        with pytest.raises(ss.UnsafeCheckpointError, match="symbolic link"):
            read(snap)


def test_the_one_file_of_a_model_directory_is_not_followed_out_of_it(tmp_path: Path) -> None:
    # a directory holding one model.safetensors reads as that file; the directory is
    # what the caller named, so a link there is refused unless it is a hub cache's
    d = tmp_path / "model"
    d.mkdir()
    _safetensors(tmp_path / "outside.safetensors", np.arange(3, dtype=np.float32))
    (d / "model.safetensors").symlink_to(tmp_path / "outside.safetensors")
    for read in (ss.load, ss.metadata):
        with pytest.raises(ss.UnsafeCheckpointError, match="symbolic link"):
            read(d)
    snap = _hub_snapshot(tmp_path)  # its one-file form: no index, one linked file
    for name in ("model.safetensors.index.json", "model-00002-of-00002.safetensors"):
        (snap / name).unlink()
    (snap / "model-00001-of-00002.safetensors").rename(snap / "model.safetensors")
    np.testing.assert_array_equal(ss.load(snap)["a"], np.arange(3, dtype=np.float32))
