"""engine._committed: a survivor recognises the committed checkpoint as its save's
(real local storage; the multi-process cases are in tests/distributed/*_rank_death.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from statestream.engine._committed import committed_as_saved
from statestream.format import (
    COMMIT_NAME,
    MANIFEST_NAME,
    ChunkEntry,
    FileEntry,
    encode_commit,
    encode_manifest,
)
from statestream.plan import ArrayDecl, RankPart, RankTree, build_manifest, merge_trees
from statestream.storage import LocalStorage
from statestream.tree import Node

META: dict[str, Any] = {"library": "statestream x", "created_unix": 1.0, "world_size": 2,
                        "user": {"epoch": 3}}


def _save(step: int) -> tuple[Any, list[RankPart]]:
    tree = Node("dict", keys=["w", "step"],
                children=[Node("array", array=0, attrs={"kind": "numpy"}),
                          Node("int", value=step)])
    merged = merge_trees([RankTree(tree, [ArrayDecl("w", "uint8", (8,))])] * 2)
    parts = [RankPart([FileEntry(f"data/r{r}-0.bin", 4)],
                      {0: [ChunkEntry(0, 0, 4, 10 + r, (4 * r,), (4,))]}) for r in range(2)]
    return merged, parts


def _commit(storage: LocalStorage, path: str, manifest: bytes, marker: bytes) -> None:
    txn = storage.begin_write(path, overwrite=True)
    for r in range(2):
        w = txn.create_file(f"data/r{r}-0.bin", 4)
        w.write_at([b"abcd"], 0)
        w.finish()
    txn.write_bytes(MANIFEST_NAME, manifest)
    txn.write_bytes(COMMIT_NAME, marker)
    txn.commit()


def test_only_the_committed_manifest_of_this_save_counts(tmp_path: Path) -> None:
    storage, path = LocalStorage(), str(tmp_path / "ck")
    merged, parts = _save(7)
    later = dict(META, created_unix=2.0)  # the survivor's clock
    assert not committed_as_saved(storage, path, merged, parts, later)  # nothing committed
    data = encode_manifest(build_manifest(merged, parts, META))
    _commit(storage, path, data, encode_commit(data))
    assert committed_as_saved(storage, path, merged, parts, later)
    assert not committed_as_saved(storage, path, merged, parts, dict(later, user={"epoch": 4}))
    old, _ = _save(3)  # an older checkpoint of the same arrays at the path
    assert not committed_as_saved(storage, path, old, parts, later)
    # a manifest its commit marker does not name is not trusted
    _commit(storage, path, data, encode_commit(data + b" "))
    assert not committed_as_saved(storage, path, merged, parts, later)


def test_a_process_without_the_parts_checks_the_save_id(tmp_path: Path) -> None:
    # Only rank 0 holds every part; the others know the save by its id.
    storage, path = LocalStorage(), str(tmp_path / "ck")
    merged, parts = _save(7)
    meta = dict(META, save_id="0f" * 16)
    later = dict(meta, created_unix=2.0)
    data = encode_manifest(build_manifest(merged, parts, meta))
    _commit(storage, path, data, encode_commit(data))
    assert committed_as_saved(storage, path, merged, None, later)
    # another save's checkpoint at the path (same arrays, same metadata but its id)
    assert not committed_as_saved(storage, path, merged, None, dict(later, save_id="1e" * 16))
    # metadata without an id proves nothing about the parts
    plain = dict(META, created_unix=2.0)
    data2 = encode_manifest(build_manifest(merged, parts, META))
    _commit(storage, path, data2, encode_commit(data2))
    assert not committed_as_saved(storage, path, merged, None, plain)
    assert committed_as_saved(storage, path, merged, parts, plain)
    # a torn marker: not trusted either way
    _commit(storage, path, data, encode_commit(data + b" "))
    assert not committed_as_saved(storage, path, merged, None, later)
