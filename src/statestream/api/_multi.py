"""Collective save across processes: global plan, parallel writes, one commit.

Each process walks its own state; descriptions are gathered so every
process computes the same plan (one writer per distinct box, spread
evenly); each writes its boxes into its own data files; the coordinator
(rank 0) merges trees and chunk tables into one manifest, checks it as a
reader would, and commits. Every phase ends in an agreement, so an error
on any rank makes every rank raise, naming it, and nothing is committed.
"""

from __future__ import annotations

import os
import time
from collections.abc import Collection
from typing import Any

from statestream import __version__, _hooks
from statestream.api._committed import committed_as_saved
from statestream.api._save import ChunkSource
from statestream.distributed import Collective, agree
from statestream.engine import ByteBudget, IOOptions, MemoryOptions, Progress, StreamWriter
from statestream.errors import CheckpointError
from statestream.format import (
    COMMIT_NAME,
    MANIFEST_NAME,
    ArrayEntry,
    ChunkEntry,
    FileEntry,
    Manifest,
    decode_manifest,
    decode_tree,
    encode_commit,
    encode_manifest,
    encode_tree,
    itemsize_of,
)
from statestream.format._dtypes import DTYPE_NAMES
from statestream.plan import ArraySpec, StreamPlanner, WriteItem, assign_writers
from statestream.providers import expand_pytree
from statestream.storage import storage_for
from statestream.tree import flatten, format_keypath

__all__ = ["save_collective"]


def _keyed_tree(doc: Any, keys: list[str]) -> Any:
    """Replace local array indices in an encoded tree by key paths."""
    if isinstance(doc, dict):
        out = {k: _keyed_tree(v, keys) for k, v in doc.items() if k != "a"}
        if "a" in doc:
            out["a"] = keys[doc["a"]]
        return out
    if isinstance(doc, list):
        return [_keyed_tree(v, keys) for v in doc]
    return doc


def _merge(a: Any, b: Any, path: str) -> Any:
    """Union of two processes' encoded trees (rank order decides plain values)."""
    if a["t"] != b["t"]:
        raise CheckpointError(
            f"processes saved different kinds of value at key path '{path or '<root>'}': "
            f"{a['t']} and {b['t']}"
        )
    t = a["t"]
    if "c" not in a:
        return a
    if "k" in a:
        keys = list(a["k"])
        kids = list(a["c"])
        index = {(type(k), k): i for i, k in enumerate(keys)}
        for k, c in zip(b["k"], b["c"]):
            i = index.get((type(k), k))
            if i is None:
                index[(type(k), k)] = len(keys)
                keys.append(k)
                kids.append(c)
            else:
                kids[i] = _merge(kids[i], c, f"{path}/{k}" if path else str(k))
        return {**a, "k": keys, "c": kids}
    if len(a["c"]) != len(b["c"]):
        raise CheckpointError(
            f"processes saved {t}s of different lengths at key path '{path or '<root>'}'"
        )
    return {**a, "c": [_merge(x, y, f"{path}/{i}" if path else str(i))
                       for i, (x, y) in enumerate(zip(a["c"], b["c"]))]}


def _number(doc: Any, order: dict[str, int]) -> Any:
    """Replace key paths in array leaves by global indices (in first-seen order)."""
    if isinstance(doc, dict):
        out = {k: _number(v, order) for k, v in doc.items() if k != "a"}
        if "a" in doc:
            out["a"] = order.setdefault(doc["a"], len(order))
        return out
    if isinstance(doc, list):
        return [_number(v, order) for v in doc]
    return doc


class CollectiveSave:
    """The phases of a multi-process save, so sync and async saves share them.

    ``begin()`` (collective, on the caller's thread) walks the state, agrees
    on the plan and opens the shared staging area; ``items()`` are this
    rank's chunks to write; ``finish(sums, error)`` (collective) agrees that
    every rank wrote its part, merges and commits on rank 0.
    """

    def __init__(self, path: str | os.PathLike[str], state: Any, overwrite: bool,
                 io: IOOptions, coll: Collective, collector: Any,
                 user_meta: dict[str, Any] | None, leaf: Any = None) -> None:
        self.path, self.state, self.overwrite = path, state, overwrite
        self.io, self.coll, self.collector, self.user_meta = io, coll, collector, user_meta
        self._leaf = leaf or collector.leaf
        #: collective used by finish(); async saves run it on a forked channel so
        #: their background messages never interleave with the training thread's
        self.finish_coll: Collective = coll
        self.txn: Any = None
        self.planner: StreamPlanner | None = None

    def begin(self) -> None:
        coll = self.coll
        rank = coll.rank
        tree = None
        err: BaseException | None = None
        try:
            tree = flatten(self.state, self._leaf, pytree_fn=expand_pytree,
                           fallback_fn=self.collector.fallback)
        except BaseException as exc:
            err = exc
        agree(coll, "walking the state", err)
        assert tree is not None
        self.tree = tree
        arrays = self.arrays = self.collector.arrays
        keys = self.keys = [format_keypath(p) for p in self.collector.paths]
        descs = []
        for key, a in zip(keys, arrays):
            boxes = a.boxes if a.boxes is not None else [((0,) * len(a.shape), a.shape)]
            descs.append([key, a.dtype, list(a.shape),
                          [[list(s), list(sh)] for s, sh in boxes]])
        self.gathered = coll.all_gather_object(
            {"arrays": descs, "tree": _keyed_tree(encode_tree(tree), keys)})
        err = None
        mine: list[list[tuple[tuple[int, ...], tuple[int, ...]]]] = []
        try:
            per_rank = [
                [(k, dt, tuple(sh), [(tuple(s), tuple(b)) for s, b in boxes])
                 for k, dt, sh, boxes in g["arrays"]]
                for g in self.gathered
            ]
            owners = assign_writers(per_rank, {n: itemsize_of(n) for n in DTYPE_NAMES})
            for key, (_, _, _, boxes) in zip(keys, per_rank[rank]):
                mine.append([b for b in boxes if owners[(key, b[0], b[1])] == rank])
        except BaseException as exc:
            err = exc
        agree(coll, "planning", err)
        self.mine = mine
        storage, spath = storage_for(self.path)
        err = None
        if rank == 0:
            try:
                self.txn = storage.begin_write(spath, overwrite=self.overwrite)
            except BaseException as exc:
                err = exc
        agree(coll, "starting the save", err)
        token = coll.broadcast_object(self.txn.token if self.txn is not None else None, src=0)
        try:
            if self.txn is None:
                self.txn = storage.join_write(spath, token)
        except BaseException as exc:
            err = exc
        agree(coll, "joining the save", err)
        self.planner = StreamPlanner(file_prefix=f"data/r{rank}", max_files=self.io.write_threads(),
                                     max_chunk_bytes=self.io.max_chunk_bytes)

    def items(self, copies: bool) -> list[list[WriteItem]]:
        """This rank's chunks, per array (``copies``: charge staging to the writer)."""
        assert self.planner is not None
        out = []
        for i, a in enumerate(self.arrays):
            spec = ArraySpec(a.shape, itemsize_of(a.dtype), a.copies and copies)
            out.append(self.planner.add(i, spec, self.mine[i]))
        return out

    def finish(self, sums: dict[tuple[int, int], tuple[int, tuple[int, ...]]],
               error: BaseException | None) -> None:
        coll, planner = self.finish_coll, self.planner
        assert planner is not None
        try:
            agree(coll, "writing data", error)
            files = planner.files()
            table: dict[str, list[Any]] = {}
            for i in range(len(self.arrays)):
                rows = table.setdefault(self.keys[i], [])
                for ci, (start, cshape, nb) in enumerate(planner.chunks[i]):
                    if nb == 0:
                        continue
                    f, off = planner.offsets[(i, ci)]
                    crc, blocks = sums[(i, ci)]
                    rows.append([planner.file_name(f), off, nb, crc,
                                 list(start), list(cshape), list(blocks)])
            tables = coll.all_gather_object({
                "files": [[fp.name, fp.size] for fp in files], "arrays": table,
            })
            err = None
            if coll.rank == 0:
                try:
                    _commit(self.txn, self.gathered, tables, coll.world_size, self.user_meta)
                except BaseException as exc:
                    err = exc
            # a rank lost right after rank 0 committed must not fail a committed save
            agree(coll, "committing", err,
                  committed=lambda: committed_as_saved(self.path, self.gathered, tables,
                                                       self.user_meta))
        except BaseException:
            self.abort()
            raise

    def abort(self) -> None:
        if self.coll.rank == 0 and self.txn is not None:
            self.txn.abort()


def save_collective(
    path: str | os.PathLike[str],
    state: Any,
    overwrite: bool,
    pickle_paths: Collection[str],
    io: IOOptions,
    memory: MemoryOptions,
    coll: Collective,
    progress: Progress | None,
    collector: Any,
    user_meta: dict[str, Any] | None = None,
) -> None:
    """The multi-process save (see module docstring)."""
    job = CollectiveSave(path, state, overwrite, io, coll, collector, user_meta)
    job.begin()
    assert job.planner is not None
    try:
        source = ChunkSource(job.arrays, lambda i: job.keys[i], memory,
                             reuse=not storage_for(path)[0].capabilities.retains_buffers)
        writer = StreamWriter(job.txn, job.planner.file_name, source,
                              budget=ByteBudget(memory.resolved()), progress=progress,
                              after_write=source.after_write)
    except BaseException:
        job.abort()
        raise
    err: BaseException | None = None
    sums: dict[tuple[int, int], tuple[int, tuple[int, ...]]] = {}
    _hooks.fire("save.planned")
    try:
        for its in job.items(copies=True):
            writer.submit(its)
        sums = writer.close()
        _hooks.fire("save.data_synced")
    except BaseException as exc:
        writer.abort()
        err = exc
    job.finish(sums, err)


def _commit(txn: Any, gathered: list[Any], tables: list[Any], world: int,
            user_meta: dict[str, Any] | None) -> None:
    merged = gathered[0]["tree"]
    for g in gathered[1:]:
        merged = _merge(merged, g["tree"], "")
    order: dict[str, int] = {}
    numbered = _number(merged, order)
    files: list[FileEntry] = []
    file_index: dict[str, int] = {}
    for t in tables:
        for name, size in t["files"]:
            file_index[name] = len(files)
            files.append(FileEntry(name, size))
    meta: dict[str, tuple[str, tuple[int, ...]]] = {}
    for g in gathered:
        for key, dtype, shape, _ in g["arrays"]:
            meta.setdefault(key, (dtype, tuple(shape)))
    chunks: dict[str, list[ChunkEntry]] = {k: [] for k in order}
    for t in tables:
        for key, rows in t["arrays"].items():
            dtype = meta[key][0]
            for name, off, nb, crc, start, cshape, blocks in rows:
                from statestream.plan import block_rows_for

                br = block_rows_for(tuple(cshape), itemsize_of(dtype)) if blocks else 0
                chunks[key].append(ChunkEntry(file_index[name], off, nb, crc, tuple(start),
                                              tuple(cshape), br, tuple(blocks)))
    arrays = [ArrayEntry(meta[k][0], meta[k][1], tuple(chunks[k]))
              for k, _ in sorted(order.items(), key=lambda kv: kv[1])]
    tree = decode_tree(numbered, len(arrays))
    manifest = Manifest(
        tree=tree, arrays=arrays, files=files,
        meta={"library": f"statestream {__version__}", "created_unix": time.time(),
              "world_size": world, "total_bytes": sum(a.nbytes for a in arrays),
              **({"user": user_meta} if user_meta is not None else {})},
    )
    mbytes = encode_manifest(manifest)
    # Check the merged manifest exactly as a reader will (coverage, overlaps, sizes)
    # before it becomes visible: a planning bug must fail the save, not the load.
    decode_manifest(mbytes, f"{txn.location}/{MANIFEST_NAME} (being committed)")
    txn.write_bytes(MANIFEST_NAME, mbytes)
    _hooks.fire("commit.manifest_written")
    txn.write_bytes(COMMIT_NAME, encode_commit(mbytes))
    _hooks.fire("commit.marker_written")
    txn.commit()
    _hooks.fire("commit.renamed")
