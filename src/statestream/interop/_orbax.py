"""Orbax checkpoints, read through orbax-checkpoint and tensorstore (the optional extra
``statestream[orbax]``).

Orbax stores arrays through tensorstore (OCDBT or not), whose layout is orbax's own
business, so statestream does not parse it. It asks orbax for the tree's metadata
(shapes, dtypes, how each array is chunked in storage) and has orbax restore only the
values that are not arrays (numbers, strings). Each array is then read when the load asks
for it, one storage chunk at a time, through the tensorstore spec orbax itself builds to
read that array: a load or a conversion holds what it is working on, not the whole state
(restored whole it held the state, +624 MiB for 512 MiB).

A storage chunk is the unit tensorstore reads and decompresses (orbax writes one per
array or shard by default), so each becomes one chunk of the manifest. A chunk read in
parts (verify's steps, a conversion's slabs) is decoded once into a cache of its own and
each part read straight into its buffer (interop/_orbax_part.py); the reader tells the
engine a read holds the decoded chunk (``decode_bytes``), which the budget charges.
"""

from __future__ import annotations

import math
import os
import threading
import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np

from statestream._memory import fresh_bytes
from statestream.errors import (
    CheckpointCorruptError,
    InvalidOptionError,
    TruncatedFileError,
    UnsafeCheckpointError,
    UnsupportedTypeError,
)
from statestream.format import (
    ArrayEntry,
    ChunkEntry,
    FileEntry,
    Manifest,
    dtype_from_name,
    dtype_name,
)
from statestream.interop._chunks import ROW_BLOCK_BYTES, check_tiling
from statestream.interop._deps import require
from statestream.interop._files import FileSetReader
from statestream.interop._loopnoise import drop_abandoned, quiet_late_loop_callbacks
from statestream.interop._orbax_check import check_claims, check_scalars, leaves_where
from statestream.interop._orbax_direct import read_chunk_direct
from statestream.interop._orbax_meta import (
    item_files,
    key_impls,
    outside,
    refuse_links,
    refuse_outside_names,
)
from statestream.interop._orbax_part import PartReads, read_part
from statestream.storage import Buffer
from statestream.tree import Key, KeyPath, Node, format_keypath

__all__ = ["looks_like_orbax", "open_orbax"]

_MARKERS = ("_CHECKPOINT_METADATA", "_METADATA")

#: An array stored in more chunks than this is described in bands of whole chunk rows
#: (each read decompresses every chunk it touches, once), so that hostile or odd metadata
#: cannot make the manifest hold millions of chunk entries.
MAX_BLOCKS = 1024

#: Blocks read ahead of the one asked for, in the background (tensorstore decompresses them
#: on its own threads while the caller writes out the block it has): at most this many
#: bytes, so that a conversion, which reads one block at a time, decompresses on every
#: core. A block read ahead and not asked for next is dropped.
READ_AHEAD_BYTES = 32 << 20
#: ... and at most this many blocks (small arrays: one read each, tensorstore runs them
#: concurrently).
READ_AHEAD_BLOCKS = 64

#: In the name of the directory orbax writes a checkpoint into before it renames it.
_TMP_MARK = ".orbax-checkpoint-tmp"

#: Arrays whose tensorstores are opened at once, concurrently, when one is first needed.
OPEN_AHEAD = 256

#: Tensorstore's cache of OCDBT B-tree nodes (orbax uses 100 MB); data is never cached.
_BTREE_CACHE_BYTES = 16 << 20


def looks_like_orbax(directory: str) -> bool:
    """A directory with orbax's ``_CHECKPOINT_METADATA`` or ``_METADATA`` file."""
    return any(os.path.isfile(os.path.join(directory, m)) for m in _MARKERS)


def _item_dir(directory: str) -> str:
    """The PyTree item directory to restore: ``directory`` itself, or for a
    CheckpointManager step (``_CHECKPOINT_METADATA`` and one subdirectory per item)
    its one item's directory (``default``, or the single item's name).

    Raises:
        InvalidOptionError: a step with several items (naming them: pass one); the
            path names the wrong directory, the checkpoint is not damaged.
    """
    if os.path.isfile(os.path.join(directory, "_METADATA")):
        return directory
    try:
        subs = sorted(e.name for e in os.scandir(directory) if e.is_dir(follow_symlinks=False))
    except OSError:
        return directory  # orbax's own restore reports what is wrong
    items = [n for n in subs if looks_like_orbax(os.path.join(directory, n))]
    if len(items) == 1 and len(subs) == 1:
        return os.path.join(directory, items[0])
    if len(subs) > 1:  # suggest a PyTree item (a JSON item's one file is plain JSON)
        trees = [n for n in subs if os.path.isfile(os.path.join(directory, n, "_METADATA"))]
        other = [n for n in subs if n not in trees]
        raise InvalidOptionError(  # the path names the wrong thing: not damage
            f"{directory} is an Orbax CheckpointManager step with items {', '.join(subs)}; "
            f"pass one item's directory (e.g. {os.path.join(directory, (trees or subs)[0])})"
            + (f"; not PyTree items, which statestream does not read: {', '.join(other)} (a "
               "JsonSave item is the plain JSON file <item>/metadata)" if trees and other else ""))
    return directory


def _corrupt(item: str, exc: BaseException,
             what: str = "this Orbax checkpoint") -> CheckpointCorruptError:
    return CheckpointCorruptError(
        f"{item}: orbax could not restore {what} ({type(exc).__name__}: {str(exc)[:500]})")


def open_orbax(directory: str) -> tuple[FileSetReader, Manifest]:
    """Describe an Orbax checkpoint as a manifest whose arrays are read when asked for
    (a CheckpointManager step with one item reads that item)."""
    ocp = require("orbax.checkpoint", "orbax", "reading Orbax checkpoints")
    from etils import epath
    from orbax.checkpoint._src.metadata import value as ometa  # the metadata classes

    item = os.path.abspath(_item_dir(directory))
    for d in {item, os.path.abspath(directory)}:
        if _TMP_MARK in os.path.basename(d):  # what orbax's own restore refuses, locally
            raise CheckpointCorruptError(
                f"{d} is an Orbax checkpoint still being written (orbax's temporary "
                "directory); it is incomplete")
    stored, holes = refuse_links(item)
    layout = refuse_outside_names(item)
    use_ocdbt = layout.use_ocdbt
    # orbax's handler, not a Checkpointer: a Checkpointer's restore waits for every
    # process of a multi-process JAX job at a barrier, so metadata() on one rank hung
    handler = ocp.PyTreeCheckpointHandler()
    quiet_late_loop_callbacks()  # before: an abandoned open may finish at any moment
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            meta = handler.metadata(epath.Path(item))
            tree = getattr(meta, "tree", None)
            if tree is None:
                raise ValueError("no tree metadata (_METADATA)")

            def is_array(m: Any) -> bool:
                return (isinstance(m, ometa.ArrayMetadata)
                        and not isinstance(m, ometa.ScalarMetadata))

            # a number is restored by reading its whole stored array: it must be 0-d
            ctx = _ts_context()
            check_scalars(item, leaves_where(tree, lambda m: isinstance(
                m, ometa.ScalarMetadata)), lambda name: _read_spec(
                    item, name, bool(getattr(meta, "use_zarr3", False)), use_ocdbt, ctx),
                ctx)
            # orbax restores everything but the arrays (numbers, strings): small
            values = handler.restore(epath.Path(item), args=ocp.args.PyTreeRestore(
                item=_map_leaves(tree, lambda m: ocp.PLACEHOLDER if is_array(m) else m)))
    except (MemoryError, PermissionError, KeyboardInterrupt, CheckpointCorruptError):
        raise
    except Exception as exc:  # orbax and tensorstore raise many types for one damage
        drop_abandoned(exc)
        raise _corrupt(item, exc) from exc
    finally:
        handler.close()
    use_zarr3 = bool(getattr(meta, "use_zarr3", False))
    walk = _Walk(item, use_ocdbt, key_impls(item))
    root = walk.node(values, tree, (), is_array)
    reader = _OrbaxReader(directory, item, walk.memory, walk.blocks, walk.leaves,
                          use_zarr3=use_zarr3, use_ocdbt=use_ocdbt, fills=layout.fills)
    try:  # a load allocates what the metadata claims: refuse claims of missing chunks
        check_claims(item, walk.leaves, reader._store, (stored, holes), layout.fills)
    except BaseException:
        reader.close()
        raise
    return reader, Manifest(root, walk.arrays, walk.files)


def _map_leaves(tree: Any, fn: Any) -> Any:
    if isinstance(tree, dict):
        return {k: _map_leaves(v, fn) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_map_leaves(v, fn) for v in tree)
    return fn(tree)


def _ts_context() -> Any:
    """A tensorstore context for orbax's read specs (their OCDBT B-tree cache, bounded)."""
    ts = require("tensorstore", "orbax", "reading Orbax checkpoints")
    return ts.Context({"cache_pool#ocdbt": {"total_bytes_limit": _BTREE_CACHE_BYTES}})


def _read_spec(item: str, name: str, use_zarr3: bool, use_ocdbt: bool, context: Any,
               fills: bool = False) -> Any:
    """The tensorstore spec orbax builds to read its array ``name`` of ``item`` (missing
    chunks read as the fill value where ``fills``, else an error)."""
    from etils import epath
    from orbax.checkpoint import type_handlers

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        info = type_handlers.ParamInfo(name=name, parent_dir=epath.Path(item),
                                       use_zarr3=use_zarr3, ts_context=context)
        return type_handlers.get_json_tspec_read(
            info, use_ocdbt=use_ocdbt, raise_array_data_missing_error=not fills)


class _Leaf:
    """One array of the checkpoint: where orbax keeps it, what it must be, and its
    tensorstore once opened."""

    def __init__(self, index: int, path: KeyPath, name: str, dtype: str,
                 shape: tuple[int, ...]) -> None:
        self.index, self.path, self.name, self.dtype, self.shape = index, path, name, dtype, shape
        self.store: Any = None
        #: the tensorstore future while it opens (or the error its spec raised)
        self.opening: Any = None


class _Walk:
    """Builds the manifest from orbax's restored values and metadata, side by side."""

    def __init__(self, item: str, use_ocdbt: bool, key_impls: dict[str, str]) -> None:
        self.item, self.use_ocdbt = item, use_ocdbt
        #: orbax's name of each typed-key array -> its impl (see key_impls)
        self.key_impls = key_impls
        self.arrays: list[ArrayEntry] = []
        self.files: list[FileEntry] = []
        self.memory: dict[str, memoryview] = {}
        #: file name -> (leaf index, the block's start and shape)
        self.blocks: dict[str, tuple[int, tuple[int, ...], tuple[int, ...]]] = {}
        self.leaves: list[_Leaf] = []

    def node(self, x: Any, m: Any, p: KeyPath, is_array: Any) -> Node:
        if is_array(m):
            data = self._lazy(m, p)
            impl = self.key_impls.get(str(m.name))
            if impl is None:
                return data
            # a typed key, as statestream saves one (providers/stateful.JaxKeyAdapter)
            return Node("stateful", type_name="jax.random.key", children=[
                Node("dict", keys=["impl", "data"],
                     children=[Node("str", value=impl), data])])
        if x is None:
            return Node("none")
        for t, kind in ((bool, "bool"), (int, "int"), (float, "float"), (str, "str")):
            if type(x) is t:
                return Node(kind, value=x)
        if isinstance(x, dict):
            keys: list[Key] = [k for k in x if type(k) in (str, int)]
            if len(keys) != len(x):
                raise UnsupportedTypeError(
                    f"a key at key path '{format_keypath(p)}' is not str/int")
            sub = m if isinstance(m, dict) else {}
            return Node("dict", keys=keys,
                        children=[self.node(x[k], sub.get(k), p + (k,), is_array) for k in keys])
        if isinstance(x, (list, tuple)):
            seq = list(m) if isinstance(m, (list, tuple)) and len(m) == len(x) else [None] * len(x)
            kids = [self.node(v, s, p + (i,), is_array) for i, (v, s) in enumerate(zip(x, seq))]
            return Node("list" if isinstance(x, list) else "tuple", children=kids)
        if not hasattr(x, "dtype") or not hasattr(x, "shape"):
            raise UnsupportedTypeError(
                f"key path '{format_keypath(p)}' holds a {type(x).__name__} restored by orbax, "
                "which statestream cannot represent")
        a = np.require(np.asarray(x), requirements="C")  # ascontiguousarray makes 0-d 1-d
        name = dtype_name(a.dtype)
        if name is None:
            raise UnsupportedTypeError(f"key path '{format_keypath(p)}' has dtype {a.dtype}, "
                                       "which statestream cannot hold")
        fname = f"<array {len(self.files)}>"
        self.memory[fname] = memoryview(a.reshape(-1).view(np.uint8).data)
        self.files.append(FileEntry(fname, a.nbytes))
        chunk = ChunkEntry(len(self.files) - 1, 0, a.nbytes, 0, (0,) * a.ndim, tuple(a.shape))
        self.arrays.append(ArrayEntry(name, tuple(a.shape), (chunk,) if a.nbytes else ()))
        return Node("array", array=len(self.arrays) - 1)

    def _lazy(self, m: Any, p: KeyPath) -> Node:
        where = f"{self.item}: key path '{format_keypath(p)}'"
        try:
            shape = tuple(int(n) for n in m.shape)
            name = dtype_name(np.dtype(m.dtype))
        except (TypeError, ValueError) as exc:
            raise CheckpointCorruptError(f"{where}: unreadable shape or dtype ({exc})") from exc
        if name is None:
            raise UnsupportedTypeError(f"{where} has dtype {m.dtype}, "
                                       "which statestream cannot hold")
        oname = str(m.name)
        if not isinstance(m.name, str) or "\0" in oname or (
                not self.use_ocdbt and outside(oname)):
            raise UnsafeCheckpointError(f"{where}: orbax's name {oname!r} for it is not a "
                                        "name inside the checkpoint")
        leaf = len(self.leaves)
        self.leaves.append(_Leaf(leaf, p, oname, name, shape))
        itemsize = dtype_from_name(name).itemsize
        chunks: list[ChunkEntry] = []
        storage_chunk = getattr(getattr(m, "storage", None), "chunk_shape", None)
        for start, bshape in _blocks(shape, storage_chunk, itemsize):
            fname = f"<array {len(self.arrays)} block {len(chunks)}>"
            nbytes = math.prod(bshape) * itemsize
            self.blocks[fname] = (leaf, start, bshape)
            self.files.append(FileEntry(fname, nbytes))
            chunks.append(ChunkEntry(len(self.files) - 1, 0, nbytes, 0, start, bshape))
        entry = ArrayEntry(name, shape, tuple(chunks))
        check_tiling(entry, where)
        self.arrays.append(entry)
        return Node("array", array=len(self.arrays) - 1)


def _blocks(shape: tuple[int, ...], chunk_shape: Any, itemsize: int
            ) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """The storage chunks of an array of ``shape`` as (start, shape) boxes, from orbax's
    ``chunk_shape`` (the whole array when it names none or an unusable one); in bands of
    whole chunk rows of about ``ROW_BLOCK_BYTES`` when there would be more than
    ``MAX_BLOCKS``."""
    if math.prod(shape) == 0:
        return []
    try:
        cs = tuple(int(c) for c in chunk_shape) if chunk_shape is not None else ()
    except (TypeError, ValueError):
        cs = ()
    if len(cs) != len(shape) or any(c < 1 for c in cs) or not shape:
        return [((0,) * len(shape), shape)]
    cs = tuple(min(c, n) for c, n in zip(cs, shape))
    grid = [math.ceil(n / c) for n, c in zip(shape, cs)]
    if math.prod(grid) > MAX_BLOCKS:
        row = math.prod(shape[1:]) * itemsize
        rows = cs[0] * max(1, ROW_BLOCK_BYTES // max(1, row * cs[0]))
        if math.ceil(shape[0] / rows) > MAX_BLOCKS:
            rows = math.ceil(shape[0] / MAX_BLOCKS)
        return [((r,) + (0,) * (len(shape) - 1), (min(rows, shape[0] - r),) + shape[1:])
                for r in range(0, shape[0], rows)]
    out = []
    for idx in np.ndindex(*grid):
        start = tuple(i * c for i, c in zip(idx, cs))
        out.append((start, tuple(min(c, n - s) for c, n, s in zip(cs, shape, start))))
    return out


class _OrbaxReader(FileSetReader):
    """Values orbax restored from memory; each array block read through tensorstore when
    it is asked for, straight into the caller's buffers (a part of a block through the
    block's own decoded chunk, :class:`PartReads`)."""

    def __init__(self, location: str, item: str, memory: dict[str, memoryview],
                 blocks: dict[str, tuple[int, tuple[int, ...], tuple[int, ...]]],
                 leaves: list[_Leaf], *, use_zarr3: bool, use_ocdbt: bool,
                 fills: bool = False) -> None:
        super().__init__(location, {}, memory=memory)
        self._item = item
        self._blocks = blocks
        self._leaves = leaves
        self._use_zarr3 = use_zarr3
        self._use_ocdbt = use_ocdbt
        self._fills = fills
        self._ts_context: Any = None
        self._open_lock = threading.Lock()
        self._order = {n: i for i, n in enumerate(blocks)}
        self._names = list(blocks)
        #: blocks being read ahead: name -> (tensorstore write future, buffer)
        self._ahead: dict[str, tuple[Any, np.ndarray]] = {}
        self._free: list[np.ndarray] = []
        self._ahead_lock = threading.RLock()
        #: blocks being read in parts (each decoded once)
        self._parts = PartReads()

    def file_size(self, name: str) -> int:
        return self._size(name) if name in self._blocks else super().file_size(name)

    def disk_files(self, files: Sequence[FileEntry]) -> list[tuple[str, int]]:
        """The item's files on disk (its manifest's are blocks of arrays and values)."""
        return item_files(self._item, os.path.abspath(self.location))

    def _store(self, leaf: _Leaf) -> Any:
        """``leaf``'s tensorstore, opened and checked against the metadata. Opening
        one also starts opening the ``OPEN_AHEAD`` leaves after it: tensorstore opens
        them concurrently (each reads its array's metadata), where one at a time the
        opens of 2,000 small arrays took longer than their reads."""
        with self._open_lock:
            if leaf.store is not None:
                return leaf.store
            if leaf.opening is None:
                for other in self._leaves[leaf.index:leaf.index + OPEN_AHEAD]:
                    if other.store is None and other.opening is None:
                        other.opening = self._open_async(other)
            opening = leaf.opening
        where = f"key path '{format_keypath(leaf.path)}'"
        try:
            if isinstance(opening, BaseException):
                raise opening
            store = opening.result()
        except (MemoryError, KeyboardInterrupt):
            raise
        except Exception as exc:
            raise _corrupt(self._item, exc, where) from exc
        shape = tuple(int(n) for n in store.shape)
        if shape != leaf.shape or dtype_name(np.dtype(store.dtype.numpy_dtype)) != leaf.dtype:
            raise CheckpointCorruptError(
                f"{self._item}: {where} is stored as {store.dtype.name} {shape}, but its "
                f"metadata says {leaf.dtype} {leaf.shape}")
        with self._open_lock:
            leaf.store = store
        return store

    def _open_async(self, leaf: _Leaf) -> Any:
        """The tensorstore future of ``leaf``'s array (under ``_open_lock``), or the error
        building its spec raised (raised when the leaf is asked for)."""
        ts = require("tensorstore", "orbax", "reading Orbax checkpoints")
        if self._ts_context is None:
            self._ts_context = _ts_context()
        try:
            spec = _read_spec(self._item, leaf.name, self._use_zarr3, self._use_ocdbt,
                              self._ts_context, self._fills)
            return ts.open(spec, context=self._ts_context, open=True, read=True)
        except (MemoryError, KeyboardInterrupt):
            raise
        except Exception as exc:
            return exc

    def read_into(self, name: str, offset: int, buffers: Sequence[Buffer]) -> None:
        b = self._blocks.get(name)
        if b is None:
            return super().read_into(name, offset, buffers)
        leaf = self._leaves[b[0]]
        size = self._size(name)
        views = [memoryview(x).cast("B") for x in buffers]
        total = sum(v.nbytes for v in views)
        if offset < 0 or offset + total > size:
            raise TruncatedFileError(f"{self.location}: {name} is too short")
        store = self._store(leaf)
        # reads ahead go with whole blocks read one after another; a block read in parts
        # (verify's steps, slabs) reads through its own decoded chunk, and reading the next
        # blocks ahead meanwhile held them too (+2 chunks of 32 MiB verifying 4 of them)
        whole = len(views) == 1 and offset == 0 and total == size
        ahead = self._take_ahead(name) if whole else None
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                self._read_block(name, leaf, store, views, offset, ahead)
        except (MemoryError, KeyboardInterrupt):
            raise
        except Exception as exc:
            raise _corrupt(self._item, exc, f"key path '{format_keypath(leaf.path)}'") from exc
        finally:
            if ahead is not None:
                self._give_back(ahead)

    def _read_block(self, name: str, leaf: _Leaf, store: Any, views: list[memoryview],
                    offset: int, ahead: tuple[Any, np.ndarray] | None) -> None:
        """Bytes from ``offset`` of block ``name`` into ``views``: from its read ahead,
        straight into the one view that is the whole block, or each part as the boxes it
        spans straight into its view (:mod:`._orbax_part`), never the whole block read to
        copy a part out of it."""
        _, start, bshape = self._blocks[name]
        dt = dtype_from_name(leaf.dtype)
        size = self._size(name)
        if ahead is not None:
            ahead[0].result()
            for v in views:
                v[:] = ahead[1][offset:offset + v.nbytes].data
                offset += v.nbytes
            return
        if len(views) == 1 and offset == 0 and views[0].nbytes == size and size:
            if read_chunk_direct(store, start, bshape, np.dtype(dt), views[0],
                                 f"{self._item}: key path '{format_keypath(leaf.path)}'"):
                return  # decompressed into the view: tensorstore's decode buffer held it twice
            ts = require("tensorstore", "orbax", "reading Orbax checkpoints")
            dst = np.frombuffer(views[0], dtype=dt).reshape(bshape)
            box = tuple(slice(s, s + n) for s, n in zip(start, bshape))
            ts.array(dst, copy=False, write=True).write(store[box]).result()
            return
        part = self._parts.store(name, store, size)
        for v in views:
            read_part(part, start, bshape, dt, offset, v)
            offset += v.nbytes
        self._parts.done(name, sum(v.nbytes for v in views), size)

    def decode_bytes(self, name: str, offset: int, nbytes: int) -> int:
        """Memory that a read of ``name`` holds beyond the caller's buffers: tensorstore
        decodes the block's storage chunk whole for any read of it (the engine charges
        that to the memory budget, so reads of several large blocks wait for one
        another)."""
        return self._size(name) if name in self._blocks else 0

    def _size(self, name: str) -> int:
        """Bytes of block ``name`` (C order)."""
        b = self._blocks[name]
        return math.prod(b[2]) * dtype_from_name(self._leaves[b[0]].dtype).itemsize

    def _take_ahead(self, name: str) -> tuple[Any, np.ndarray] | None:
        """The read of ``name`` already under way, as (future, buffer), or None; after
        starting the reads of the blocks that follow it, up to ``READ_AHEAD_BYTES``, into
        buffers reused from block to block. Reads ahead of an earlier block are dropped
        (the caller went past them).

        Whoever takes an entry with a future out of ``_ahead`` owns its buffer and gives
        it back (:meth:`_give_back`) once tensorstore is done with it; an entry still
        being started (no future yet) stays its starter's, who gives it back on finding
        it gone."""
        i = self._order[name]
        stale: list[tuple[Any, np.ndarray]] = []
        start: list[tuple[str, tuple[Any, np.ndarray]]] = []
        with self._ahead_lock:
            got = self._ahead.pop(name, None)
            for n in [n for n in self._ahead if self._order[n] < i]:
                stale.append(self._ahead.pop(n))
            for n in self._names[i + 1:i + 1 + READ_AHEAD_BLOCKS]:
                if n in self._ahead or n == name:
                    continue
                buf = self._spare(self._size(n))
                if buf is None:
                    break
                claim = (None, buf)
                self._ahead[n] = claim
                start.append((n, claim))
        for e in stale:
            if e[0] is not None:
                self._give_back(e)
        for n, claim in start:
            b = self._blocks[n]
            try:
                store = self._store(self._leaves[b[0]])
                dst = claim[1][:self._size(n)].view(dtype_from_name(self._leaves[b[0]].dtype))
                ts = require("tensorstore", "orbax", "reading Orbax checkpoints")
                f = ts.array(dst.reshape(b[2]), copy=False, write=True).write(
                    store[tuple(slice(s, s + k) for s, k in zip(b[1], b[2]))])
            except Exception:  # the block's own read reports what is wrong
                f = None
            with self._ahead_lock:
                mine = self._ahead.get(n) is not claim  # taken or dropped meanwhile
                if not mine and f is not None:
                    self._ahead[n] = (f, claim[1])
                elif not mine:
                    del self._ahead[n]
                    mine = True
            if mine:
                self._give_back((f, claim[1]))
        return got if got is not None and got[0] is not None else None

    def _spare(self, n: int) -> np.ndarray | None:
        """A free read-ahead buffer of at least ``n`` bytes (under ``_ahead_lock``), or None
        when the read-ahead buffers would exceed ``READ_AHEAD_BYTES``."""
        fits = [i for i, b in enumerate(self._free) if b.nbytes >= n]
        if fits:
            return self._free.pop(min(fits, key=lambda i: self._free[i].nbytes))
        held = sum(b.nbytes for b in self._free) + sum(
            x[1].nbytes for x in self._ahead.values())
        while self._free and held + n > READ_AHEAD_BYTES:
            held -= self._free.pop(0).nbytes
        if held + n > READ_AHEAD_BYTES:
            return None
        return fresh_bytes(n)

    def _give_back(self, entry: tuple[Any, np.ndarray]) -> None:
        """Return a read-ahead buffer to the free list once tensorstore is done with it."""
        f, buf = entry
        if f is not None:
            try:
                f.result()
            except Exception:  # nobody asked for this block (or will read it again)
                pass
        with self._ahead_lock:
            self._free.append(buf)

    def close(self) -> None:
        with self._ahead_lock:
            taken = [e for e in self._ahead.values() if e[0] is not None]
            self._ahead.clear()
        for e in taken:
            self._give_back(e)
        with self._ahead_lock:
            self._free.clear()
        self._parts.close()
        with self._open_lock:
            for leaf in self._leaves:
                leaf.store = leaf.opening = None
            self._ts_context = None
        super().close()
