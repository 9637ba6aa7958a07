"""``save``: flatten, plan, write through the engine, commit atomically."""

from __future__ import annotations

import json
import os
import pickle
import threading
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

import numpy as np

from statestream import __version__, _hooks
from statestream._gc import gc_paused
from statestream.distributed import Collective, default_collective
from statestream.engine import (
    ByteBudget,
    IOOptions,
    MemoryOptions,
    Progress,
    StreamWriter,
    pinned_pool,
)
from statestream.errors import CheckpointError, UnsupportedTypeError
from statestream.format import (
    COMMIT_NAME,
    MANIFEST_NAME,
    ArrayEntry,
    ChunkEntry,
    FileEntry,
    Manifest,
    encode_commit,
    encode_manifest,
    itemsize_of,
)
from statestream.plan import ArraySpec, StreamPlanner, WriteItem, block_rows_for
from statestream.providers import _BY_TYPE as _provider_cache
from statestream.providers import (
    PreparedArray,
    array_provider_for,
    expand_pytree,
)
from statestream.providers.numpy import prepare_host_array
from statestream.storage import storage_for
from statestream.tree import KeyPath, Node, flatten, format_keypath, parse_keypath

__all__ = ["save"]


_CONTAINER_TYPES = frozenset({dict, list, tuple})
_PROVIDER_BY_TYPE = _provider_cache


class _Collector:
    """Turns leaves into manifest nodes and remembers the arrays to write."""

    def __init__(self, pickle_paths: Collection[str]) -> None:
        self.arrays: list[PreparedArray] = []
        self.paths: list[KeyPath] = []
        self._pickle = {parse_keypath(p) for p in pickle_paths}
        self.on_array: Callable[[int, PreparedArray], None] | None = None
        #: async saves map tensor memory (data_ptr) to array indices for hooks
        self.track_ptrs = False
        self.ptrs: dict[int, list[int]] = {}

    def _add(self, prepared: PreparedArray, path: KeyPath) -> int:
        self.arrays.append(prepared)
        self.paths.append(path)
        index = len(self.arrays) - 1
        if self.on_array is not None:
            self.on_array(index, prepared)
        return index

    def leaf(self, path: KeyPath, x: Any) -> Node | None:
        t = type(x)
        if t in _CONTAINER_TYPES:
            return None
        p = _PROVIDER_BY_TYPE.get(t)
        if p is not None:  # the common case first: an array of a known type
            return self._array(p, path, x)
        if x is None:
            return Node("none")
        if t is bool:
            return Node("bool", value=x)
        if t is int:
            return Node("int", value=x)
        if t is float:
            return Node("float", value=x)
        if t is str:
            return Node("str", value=x)
        if t is bytes:
            blob = np.frombuffer(x, dtype=np.uint8)
            return Node("bytes", array=self._add(prepare_host_array(blob, path, "bytes"), path))
        p = array_provider_for(x)
        if p is None:
            return None
        return self._array(p, path, x)

    def _array(self, p: Any, path: KeyPath, x: Any) -> Node:
        prepared = p.prepare(x, path)
        attrs = {"kind": prepared.kind}
        if prepared.attrs:
            attrs.update(prepared.attrs)
        index = self._add(prepared, path)
        if self.track_ptrs and prepared.kind == "torch":
            local = x.to_local() if hasattr(x, "to_local") else x
            self.ptrs.setdefault(index, []).append(int(local.data_ptr()))
        return Node("array", array=index, attrs=attrs)

    def fallback(self, path: KeyPath, x: Any) -> Node | None:
        spath = tuple(str(k) for k in path)
        if not any(spath[: len(p)] == p for p in self._pickle):
            return None
        try:
            data = pickle.dumps(x, protocol=5)
        except Exception as exc:
            raise UnsupportedTypeError(
                f"pickling the value at key path '{format_keypath(path)}' failed: {exc}"
            ) from exc
        blob = np.frombuffer(data, dtype=np.uint8)
        return Node(
            "pickle", array=self._add(prepare_host_array(blob, path, "pickle"), path),
            attrs={"type": f"{type(x).__module__}.{type(x).__qualname__}"},
        )


def save(
    path: str | os.PathLike[str],
    state: Any,
    *,
    overwrite: bool = False,
    pickle_paths: Collection[str] = (),
    io: IOOptions | None = None,
    memory: MemoryOptions | None = None,
    collective: Collective | None = None,
    progress: Progress | None = None,
    meta: Mapping[str, Any] | None = None,
) -> None:
    """Save ``state`` as a checkpoint at ``path``, atomically.

    Args:
        path: a directory path (it must not exist unless ``overwrite``).
        state: nested dict/list/tuple/namedtuple/dataclass/JAX pytree of
            arrays (NumPy, torch, JAX), plain values and objects with
            ``state_dict()``/``load_state_dict()``. Top-level keys are the
            checkpointables that ``load(items=...)`` selects.
        overwrite: replace an existing checkpoint atomically (the old one
            stays loadable until the new one is committed).
        pickle_paths: key paths (``"a/b"``) whose otherwise unsupported
            values may be pickled; loading them needs ``allow_pickle=True``.
        io: thread count and chunk sizes.
        memory: the host staging budget.
        collective: how processes agree; by default torch.distributed when a
            process group is initialised, multi-process JAX when running, else
            one process. Every process of the collective must call ``save``.
        progress: called as ``progress(bytes_done, bytes_total)`` while writing.
        meta: small JSON-able user metadata, stored in the manifest
            (``metadata(path).meta["user"]``).

    Raises:
        UnsupportedTypeError: a leaf cannot be saved (the key path is named);
            nothing is written.
        CheckpointExistsError: ``path`` exists and ``overwrite`` is false.
        StorageError: the file system failed; nothing is committed.

    Example:
        >>> import numpy as np, tempfile, os, statestream as ss
        >>> d = os.path.join(tempfile.mkdtemp(), "ckpt")
        >>> ss.save(d, {"w": np.arange(3.0), "step": 7})
        >>> ss.load(d)["step"]
        7
    """
    coll = collective if collective is not None else default_collective()
    user = check_user_meta(meta)
    with gc_paused():
        if coll.world_size > 1:
            from statestream.api._multi import save_collective

            save_collective(path, state, overwrite, pickle_paths, io or IOOptions(),
                            memory or MemoryOptions(), coll, progress, _Collector(pickle_paths),
                            user)
            return
        _save(path, state, overwrite, pickle_paths, io or IOOptions(), memory or MemoryOptions(),
              coll, progress, user)


def _save(
    path: str | os.PathLike[str],
    state: Any,
    overwrite: bool,
    pickle_paths: Collection[str],
    io: IOOptions,
    memory: MemoryOptions,
    coll: Collective,
    progress: Progress | None,
    user_meta: dict[str, Any] | None = None,
) -> None:
    storage, spath = storage_for(path)
    txn = storage.begin_write(spath, overwrite=overwrite)
    planner = StreamPlanner(file_prefix=f"data/r{coll.rank}", max_files=io.write_threads(),
                            max_chunk_bytes=io.max_chunk_bytes)
    collector = _Collector(pickle_paths)
    arrays = collector.arrays
    source = ChunkSource(arrays, lambda i: format_keypath(collector.paths[i]), memory,
                         reuse=not storage.capabilities.retains_buffers)
    writer = StreamWriter(txn, planner.file_name, source,
                          budget=ByteBudget(memory.resolved()), progress=progress,
                          after_write=source.after_write)

    def on_array(index: int, prepared: PreparedArray) -> None:
        # Writers start on this array while the walk goes on to the next.
        writer.submit(planner.add(index, ArraySpec(prepared.shape, itemsize_of(prepared.dtype),
                                                   prepared.copies), prepared.boxes))

    collector.on_array = on_array
    try:
        try:
            tree = flatten(state, collector.leaf, pytree_fn=expand_pytree,
                           fallback_fn=collector.fallback)
        except BaseException:
            writer.abort()
            raise
        _hooks.fire("save.planned")
        sums = writer.close()
        _hooks.fire("save.data_synced")
        commit_single(txn, tree, arrays, planner, sums, user_meta)
    except BaseException:
        txn.abort()
        raise


class ChunkSource:
    """The bytes of each planned chunk, for the writers (any thread).

    Host arrays hand out views or copies from their provider. Device arrays
    (``PreparedArray.stage``) are copied into page-locked staging buffers from
    the pinned pool, which go back to the pool once written
    (:meth:`after_write`), so later chunks and later saves reuse them.
    """

    def __init__(self, arrays: list[PreparedArray], key_of: Callable[[int], str],
                 memory: MemoryOptions, *, reuse: bool = True) -> None:
        self._arrays = arrays
        self._key_of = key_of
        self._keep = memory.keep_staging and reuse
        self._pool = pinned_pool()
        self._pool.set_capacity(memory.resolved())
        self._lent: dict[tuple[int, int], np.ndarray] = {}
        self._lock = threading.Lock()

    def __call__(self, item: WriteItem) -> np.ndarray:
        a = self._arrays[item.array]
        try:
            if a.stage is None:
                data: np.ndarray = a.chunk(item.start, item.shape)
                return data
            buf = self._pool.take(item.nbytes)
            try:
                a.stage(item.start, item.shape, buf)()
            except BaseException:
                self._pool.give(buf, keep=False)
                raise
            with self._lock:
                self._lent[(item.array, item.chunk)] = buf
            return buf
        except CheckpointError:
            raise
        except Exception as exc:
            raise UnsupportedTypeError(
                f"reading the value at key path '{self._key_of(item.array)}' failed: {exc}"
            ) from exc

    def after_write(self, items: Sequence[WriteItem]) -> None:
        """Give the staging buffers of written items back to the pool."""
        if not self._lent:
            return
        with self._lock:
            bufs = [self._lent.pop((it.array, it.chunk), None) for it in items]
        for b in bufs:
            if b is not None:
                self._pool.give(b, keep=self._keep)


def check_user_meta(meta: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """Validate user metadata: a JSON-able mapping of at most 1 MiB."""
    if meta is None:
        return None
    try:
        text = json.dumps(dict(meta), allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise UnsupportedTypeError(
            f"meta must be a JSON-able mapping (str keys; numbers, strings, lists, dicts): {exc}"
        ) from exc
    if len(text) > 1 << 20:
        raise UnsupportedTypeError(f"meta is {len(text)} bytes of JSON; keep it under 1 MiB")
    out: dict[str, Any] = json.loads(text)
    return out


def commit_single(txn: Any, tree: Node, arrays: list[PreparedArray], planner: StreamPlanner,
                  sums: dict[tuple[int, int], tuple[int, tuple[int, ...]]],
                  user_meta: dict[str, Any] | None = None) -> None:
    """Write the manifest of a one-process save and commit it."""
    files = planner.files()
    entries: list[ArrayEntry] = []
    offsets = planner.offsets
    for ai, a in enumerate(arrays):
        chunks = []
        for ci, (start, cshape, nb) in enumerate(planner.chunks[ai]):
            if nb == 0:
                continue
            f, off = offsets[(ai, ci)]
            crc, blocks = sums[(ai, ci)]
            chunks.append(ChunkEntry(f, off, nb, crc, start, cshape,
                                     block_rows_for(cshape, itemsize_of(a.dtype)), blocks))
        entries.append(ArrayEntry(a.dtype, a.shape, tuple(chunks)))
    manifest = Manifest(
        tree=tree,
        arrays=entries,
        files=[FileEntry(fp.name, fp.size) for fp in files],
        meta={
            "library": f"statestream {__version__}",
            "created_unix": time.time(),
            "world_size": 1,
            "total_bytes": planner.total_bytes,
            **({"user": user_meta} if user_meta is not None else {}),
        },
    )
    mbytes = encode_manifest(manifest)
    txn.write_bytes(MANIFEST_NAME, mbytes)
    _hooks.fire("commit.manifest_written")
    txn.write_bytes(COMMIT_NAME, encode_commit(mbytes))
    _hooks.fire("commit.marker_written")
    txn.commit()
    _hooks.fire("commit.renamed")
