"""Hostile or damaged Orbax checkpoints: caught, naming the file and key path, before
anything large is allocated or anything outside the checkpoint is read."""

from __future__ import annotations

import gc
import json
import os
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


def _ocdbt_checkpoint(o: Path, state: dict) -> None:
    """An Orbax checkpoint whose arrays sit in one OCDBT database written without
    compression, all values in one data file (so its B-tree node can be edited)."""
    ts = pytest.importorskip("tensorstore")
    _save(o, state, use_ocdbt=False)
    kv = ts.KvStore.open({"driver": "ocdbt", "base": {"driver": "file", "path": f"{o}/"},
                          "config": {"compression": None, "max_inline_value_bytes": 0}}
                         ).result()
    with ts.Transaction() as txn:
        for name in state:
            for p in sorted((o / name).iterdir()):
                kv.with_transaction(txn).write(f"{name}/{p.name}", p.read_bytes()).result()
    for name in state:
        for p in (o / name).iterdir():
            p.unlink()
        (o / name).rmdir()
    _edit_json(o / "_METADATA", use_ocdbt=True)


def test_an_ocdbt_data_file_outside_the_checkpoint_is_never_read(tmp_path: Path) -> None:
    """A B-tree node of OCDBT names each value's data file (a base path and a relative
    path, joined to the database's directory): one naming ``../x`` or an absolute path
    is refused by tensorstore's file store ("Invalid key") before any read, so the copy
    of the data placed there is never used; the undamaged checkpoint loads."""
    import crc32c

    o = tmp_path / "o"
    w = np.arange(64, dtype=np.float32)
    _ocdbt_checkpoint(o, {"w": w})
    assert ss.load(o)["w"].tobytes() == w.tobytes()
    (data,) = (o / "d").iterdir()
    raw = data.read_bytes()
    at = raw.index(b"\x0c\xdb\x20\xde")  # the B-tree node after the values
    size = int.from_bytes(raw[at + 4:at + 12], "little")
    old = f"d/{data.name}".encode()
    absolute = f"/tmp/ss-{os.getpid()}-".ljust(len(old), "y")
    for new, there in ((b"../" + b"x" * (len(old) - 3), tmp_path / ("x" * (len(old) - 3))),
                       (absolute.encode(), Path(absolute))):
        assert len(new) == len(old) and raw[at:at + size].count(old) == 1
        there.write_bytes(raw)  # the data, outside the checkpoint
        try:
            node = bytearray(raw[at:at + size].replace(old, new))
            node[-4:] = crc32c.crc32c(bytes(node[:-4])).to_bytes(4, "little")
            data.write_bytes(raw[:at] + bytes(node) + raw[at + size:])
            for call in (lambda: ss.load(o), lambda: ss.convert(o, tmp_path / "ck")):
                with pytest.raises(ss.CheckpointCorruptError, match="Invalid key"):
                    call()
        finally:
            there.unlink()
        assert not (tmp_path / "ck").exists()


def test_a_metadata_file_nested_too_deeply_is_a_corrupt_error(tmp_path: Path) -> None:
    """JSON nested deeper than Python's recursion limit: the check of the array names in
    _METADATA let the RecursionError out of load, metadata and convert. A deeply nested
    array_metadatas file (read for typed keys, best effort) is ignored, as orbax does."""
    _save(tmp_path / "o", {"w": np.arange(4.0), "step": 3}, use_ocdbt=False)
    deep = "[" * 100_000 + "]" * 100_000
    (tmp_path / "o" / "array_metadatas").mkdir()
    (tmp_path / "o" / "array_metadatas" / "process_0").write_text(deep)
    assert ss.load(tmp_path / "o")["step"] == 3
    (tmp_path / "o" / "_METADATA").write_text(deep)
    for call in (lambda: ss.load(tmp_path / "o"), lambda: ss.metadata(tmp_path / "o"),
                 lambda: ss.convert(tmp_path / "o", tmp_path / "ck")):
        with pytest.raises(ss.CheckpointCorruptError, match=r"_METADATA: JSON nested too deep"):
            call()


def _number_outside(o: Path, secret: Path) -> dict:
    """Save an Orbax checkpoint at ``o`` whose number ``step`` is moved to ``secret``
    (outside it); its _METADATA, returned, keys it by that absolute path."""
    _save(o, {"step": 3, "lr": 0.5}, use_ocdbt=False)
    (o / "step").rename(secret)
    meta = json.loads((o / "_METADATA").read_text())
    entry = meta["tree_metadata"].pop("('step',)")
    entry["key_metadata"] = [{"key": str(secret), "key_type": 2}]
    meta["tree_metadata"][f"('{secret}',)"] = entry
    return meta


def test_an_empty_ocdbt_manifest_does_not_skip_the_check_of_array_names(
        tmp_path: Path) -> None:
    """Orbax decides OCDBT from _METADATA's use_ocdbt, and from whether manifest.ocdbt
    exists only when it gives none; statestream skipped its check of the array names
    whenever the file existed. An empty manifest.ocdbt beside "use_ocdbt": false and a
    number named by an absolute path loaded that number from outside the checkpoint."""
    o = tmp_path / "o"
    meta = _number_outside(o, tmp_path / "secret")
    (o / "_METADATA").write_text(json.dumps(meta))
    (o / "manifest.ocdbt").write_bytes(b"")
    for call in (lambda: ss.load(o), lambda: ss.metadata(o),
                 lambda: ss.convert(o, tmp_path / "ck")):
        with pytest.raises(ss.UnsafeCheckpointError, match="secret' in _METADATA are not "
                                                           "names inside the checkpoint"):
            call()


def _unstore(o: Path, name: str) -> None:
    """Remove every stored chunk of array ``name`` (zarr v3: its ``c/`` folder) and the
    flag of _METADATA that says every chunk is stored, as orbax wrote before it stored
    chunks equal to the fill value."""
    for p in sorted((o / name / "c").rglob("*"), reverse=True):
        p.rmdir() if p.is_dir() else p.unlink()
    meta = json.loads((o / "_METADATA").read_text())
    del meta["store_array_data_equal_to_fill_value"]
    (o / "_METADATA").write_text(json.dumps(meta))


def test_a_checkpoint_that_did_not_store_chunks_of_zeros_loads_as_orbax_loads_it(
        tmp_path: Path) -> None:
    """Orbax's zarr v3 checkpoints did not store a chunk equal to the fill value (an
    optimizer's fresh moments) before store_array_data_equal_to_fill_value; orbax reads
    those chunks as zeros, statestream refused them ("chunk ... is missing"). Loaded
    when small, and when the arrays add up to more than 8x the files + 64 MiB as long as
    the missing boxes stay within that."""
    o = tmp_path / "o"
    w = np.random.default_rng(0).standard_normal(1 << 18).astype(np.float64)  # 2 MiB
    state = {"w": w, "mu": np.zeros((1 << 11, 1 << 12), np.float32),  # 32 MiB
             "nu": np.zeros(1 << 24, np.float32), "step": 0}  # 64 MiB, stored
    _save(o, state, use_ocdbt=False, use_zarr3=True)
    _unstore(o, "mu")
    from statestream.interop._chunks import _STORED_SLACK, STORED_FACTOR

    files = sum(p.stat().st_size for p in o.rglob("*") if p.is_file())
    assert STORED_FACTOR * files + _STORED_SLACK < 98 << 20  # each array is asked
    out = ss.load(o)
    assert out["w"].tobytes() == w.tobytes() and out["mu"].shape == (1 << 11, 1 << 12)
    assert not out["mu"].any() and not out["nu"].any()
    ss.convert(o, tmp_path / "ck")
    assert not ss.load(tmp_path / "ck")["mu"].any()


def test_missing_chunks_read_as_fill_values_are_bounded(tmp_path: Path) -> None:
    """Where missing chunks read as the fill value, 1 KB of checkpoint claiming 2 GiB
    with no chunk stored is refused before a load allocates it, naming the key path;
    in chunks of one element too (each array is asked whole: asked for each of its
    storage chunks or bands of them, tensorstore visited all 2**28 chunks)."""
    o = tmp_path / "o"
    _save(o, {"w": np.arange(4.0), "b": np.ones(3)}, use_ocdbt=False, use_zarr3=True)
    _unstore(o, "w")
    for chunk, inner in (([1 << 28], [1 << 24]), ([1], [1])):
        meta = json.loads((o / "w" / "zarr.json").read_text())
        meta["shape"] = [1 << 28]
        meta["chunk_grid"]["configuration"]["chunk_shape"] = chunk
        meta["codecs"][0]["configuration"]["chunk_shape"] = inner
        (o / "w" / "zarr.json").write_text(json.dumps(meta))
        for call in (lambda: ss.load(o), lambda: ss.metadata(o)):
            with pytest.raises(ss.CheckpointCorruptError,
                               match=r"key path 'w': the arrays with chunks missing so far "
                                     r"\(read as the fill value\) add up to 2147483648 "
                                     "bytes"):
                call()


def test_a_metadata_file_too_large_to_check_is_refused(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """_METADATA larger than the check reads (256 MiB; 2 KiB here) skipped the check of
    the array names, and orbax then read a number keyed by an absolute path from outside
    the checkpoint. It is refused, naming the file."""
    from statestream.interop import _orbax_meta

    monkeypatch.setattr(_orbax_meta, "_MAX_METADATA", 2048)
    o = tmp_path / "o"
    meta = _number_outside(o, tmp_path / "secret")
    (o / "_METADATA").write_text(json.dumps(meta) + " " * 4096)
    for call in (lambda: ss.load(o), lambda: ss.metadata(o)):
        with pytest.raises(ss.CheckpointCorruptError, match=r"_METADATA is larger than 2048"):
            call()


def test_an_unknown_value_type_fails_without_printing_unawaited_coroutines(
        tmp_path: Path) -> None:
    """orbax makes each type handler's metadata() coroutine before awaiting them; an
    unknown value_type in _METADATA failed with the others never awaited, and each
    printed 'RuntimeWarning: coroutine ... was never awaited' when the caller's error
    was freed. The caller gets the error, and no such warning."""
    o = tmp_path / "o"
    _save(o, {"w": np.arange(4.0), "step": 3, "name": "run"}, use_ocdbt=False)
    meta = json.loads((o / "_METADATA").read_text())
    meta["tree_metadata"]["('w',)"]["value_metadata"]["value_type"] = "foo"
    (o / "_METADATA").write_text(json.dumps(meta))
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        for call in (ss.metadata, ss.load):
            with pytest.raises(ss.CheckpointCorruptError, match='Unknown type: "foo"'):
                call(o)
        gc.collect()  # the errors, and whatever they held, are freed
    assert not [w for w in got if "never awaited" in str(w.message)]


def test_a_sparse_file_does_not_raise_the_bound_on_claimed_bytes(tmp_path: Path) -> None:
    """The bound on what the arrays may claim is 8x the item's bytes + 64 MiB: a sparse
    file of 1 TiB beside them (a few bytes in a tar archive) counted as 1 TiB and let a
    claim of 2 GiB with no chunk stored through to the load's allocation."""
    o = tmp_path / "o"
    _save(o, {"w": np.arange(4.0), "b": np.ones(3)}, use_ocdbt=False)
    with open(o / "padding", "wb") as f:
        f.truncate(1 << 40)
    if os.stat(o / "padding").st_blocks * 512 >= 1 << 20:
        pytest.skip("this file system stores no sparse files")
    n = 1 << 28
    _edit_json(o / "w" / ".zarray", shape=[n], chunks=[n])
    (o / "w" / "0").unlink()
    with pytest.raises(ss.CheckpointCorruptError,  # either is refused: the holes too
                       match=r"key path 'w' claims 2147483648 bytes, but some of its chunks "
                             r"are missing|its files are sparse"):
        ss.metadata(o)


def test_a_sparse_chunk_file_claiming_far_more_than_is_stored_is_refused(
        tmp_path: Path) -> None:
    """An uncompressed chunk is read as it is stored: a 2 GiB sparse chunk file (nothing
    in a tar archive) is fully stored to tensorstore, and made a load of 1 KB of
    checkpoint allocate 2 GiB."""
    o = tmp_path / "o"
    _save(o, {"w": np.arange(4.0), "b": np.ones(3)}, use_ocdbt=False)
    n = 1 << 28
    _edit_json(o / "w" / ".zarray", shape=[n], chunks=[n], compressor=None)
    with open(o / "w" / "0", "wb") as f:
        f.truncate(n * 8)
    if os.stat(o / "w" / "0").st_blocks * 512 >= 1 << 20:
        pytest.skip("this file system stores no sparse files")
    with pytest.raises(ss.CheckpointCorruptError,
                       match=r"its files are sparse, \d+ bytes of holes"):
        ss.metadata(o)
