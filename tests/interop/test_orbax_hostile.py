"""Hostile or damaged Orbax checkpoints: caught, naming the file and key path, before
anything large is allocated or anything outside the checkpoint is read."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import numpy as np
import pytest

import statestream as ss


def _save(path: Path, state: dict, **handler: object) -> None:
    ocp = pytest.importorskip("orbax.checkpoint")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ocp.Checkpointer(ocp.PyTreeCheckpointHandler(**handler)).save(path, state)


def _edit_json(path: Path, **changes: object) -> None:
    doc = json.loads(path.read_text())
    doc.update(changes)
    path.write_text(json.dumps(doc))


def test_a_number_stored_as_a_large_array_is_refused_before_orbax_reads_it(
        tmp_path: Path) -> None:
    """Orbax's metadata of a number says shape () whatever is stored, and its restore
    read the whole stored array (missing chunks filled) before checking it is 0-d: a
    .zarray giving ``step`` 2**20 elements (2**40 as easily) with no chunk stored made
    the load allocate and fill them."""
    _save(tmp_path / "o", {"w": np.arange(4.0), "step": 3}, use_ocdbt=False)
    n = 1 << 20
    _edit_json(tmp_path / "o" / "step" / ".zarray", shape=[n], chunks=[n])
    (tmp_path / "o" / "step" / "0").unlink()
    _edit_json(tmp_path / "o" / "_METADATA", store_array_data_equal_to_fill_value=False)
    for call in (lambda: ss.load(tmp_path / "o"), lambda: ss.metadata(tmp_path / "o")):
        with pytest.raises(ss.CheckpointCorruptError,
                           match=r"'step' is a number in _METADATA, but its stored array is "
                                 r"int64 of shape \(1048576,\)"):
            call()


@pytest.mark.parametrize("layout", ["zarr2", "zarr3-shard"])
def test_an_array_claiming_far_more_than_is_stored_is_refused_before_a_load_allocates(
        tmp_path: Path, layout: str) -> None:
    """Missing chunks are an error when read, but a load allocated what the metadata
    claims first: 1 KB of checkpoint claiming 2**40 elements was a MemoryError naming
    nothing (several arrays that each fit: memory reserved, then a read error). A zarr v3
    shard whose index stores one inner chunk of 2**18 is refused the same."""
    ts = pytest.importorskip("tensorstore")
    o = tmp_path / "o"
    _save(o, {"w": np.arange(4.0), "b": np.ones(3)}, use_ocdbt=False,
          use_zarr3=layout != "zarr2")
    n = 1 << 28
    if layout == "zarr2":
        _edit_json(o / "w" / ".zarray", shape=[n], chunks=[n])
        (o / "w" / "0").unlink()
    else:
        meta = json.loads((o / "w" / "zarr.json").read_text())
        meta.update(shape=[n], chunk_grid={"name": "regular",
                                           "configuration": {"chunk_shape": [n]}})
        meta["codecs"][0]["configuration"]["chunk_shape"] = [1 << 18]
        for p in sorted((o / "w").rglob("*"), reverse=True):
            p.rmdir() if p.is_dir() else p.unlink()
        t = ts.open({"driver": "zarr3", "kvstore": {"driver": "file", "path": str(o / "w")},
                     "metadata": meta}, create=True).result()
        t[:10].write(np.ones(10)).result()
    for call in (lambda: ss.load(o), lambda: ss.metadata(o),
                 lambda: ss.convert(o, tmp_path / "ck")):
        with pytest.raises(ss.CheckpointCorruptError,
                           match=rf"{o}: key path 'w' claims {n * 8} bytes, but some of its "
                                 "chunks are missing"):
            call()
    assert not (tmp_path / "ck").exists()


@pytest.mark.parametrize("layout", [{}, {"use_ocdbt": False}, {"use_zarr3": True}],
                         ids=["ocdbt", "zarr2", "zarr3"])
def test_a_real_checkpoint_of_zeros_far_larger_than_its_files_loads(
        tmp_path: Path, layout: dict) -> None:
    """Orbax stores every chunk, zeros too, and zstd makes 128 MiB of zeros a few KB: the
    arrays then add up to far more than the files, and each is found fully stored."""
    from statestream.interop._chunks import _STORED_SLACK, STORED_FACTOR

    state = {"mu": np.zeros((1 << 12, 1 << 12), np.float32),
             "nu": np.zeros(1 << 24, np.float32), "w": np.arange(8.0), "step": 0}
    _save(tmp_path / "o", state, **layout)
    files = sum(p.stat().st_size for p in (tmp_path / "o").rglob("*") if p.is_file())
    assert STORED_FACTOR * files + _STORED_SLACK < 1 << 27  # each array is asked
    out = ss.load(tmp_path / "o")
    assert out["mu"].shape == (1 << 12, 1 << 12) and not out["mu"].any()
    assert not out["nu"].any() and out["w"].tobytes() == state["w"].tobytes()
