"""Writers fed array by array, slab by slab: statestream and safetensors (one file or shards).

A writer is told every array's dtype and shape first, then receives each
array's bytes as consecutive row slabs (``Slabs``), so a conversion holds
one slab at a time, never the state.
"""

from __future__ import annotations

import errno
import functools
import json
import math
import os
import shutil
import struct
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from statestream._memory import aligned_bytes
from statestream._version import __version__
from statestream.engine import parallel_for
from statestream.engine._codec import encode_chunk
from statestream.engine._refs import refuse_replacing_a_base
from statestream.errors import (
    CheckpointExistsError,
    UnsupportedTypeError,
    storage_error,
)
from statestream.format import (
    COMMIT_NAME,
    MANIFEST_NAME,
    ArrayEntry,
    ChunkEntry,
    Compression,
    FileEntry,
    Manifest,
    checksum,
    encode_commit,
    encode_manifest,
    encode_tree,
    itemsize_of,
)
from statestream.interop import _safetensors as _st
from statestream.interop._publish import claim, holds_checkpoint, publish, staging_path, writing
from statestream.interop._safetensors import (
    META_KEY,
    NAMES_KEY,
    ST_CODES,
    TREE_KEY,
)
from statestream.plan import COMPRESSED_CHUNK_BYTES, chunk_offset
from statestream.storage import FileWriter, LocalStorage, Storage, storage_for
from statestream.tree import KeyPath, Node, format_keypath

__all__ = ["ArraySpec", "Slabs", "aligned_bytes", "array_paths", "slab_rows", "tensor_names",
           "write_safetensors", "write_statestream"]

#: (dtype name, shape) of each array, in the order the writer receives them
ArraySpec = tuple[str, tuple[int, ...]]
#: array index -> its row slabs as (first row, C-contiguous array)
Slabs = Callable[[int], Iterator[tuple[int, np.ndarray]]]
#: Hugging Face's default shard size ("5GB")
DEFAULT_SHARD_BYTES = 5_000_000_000
#: page size: direct I/O alignment, and where format.md puts chunks of 256 KiB or more
PAGE = 4096
_O_DIRECT = getattr(os, "O_DIRECT", 0)


def slab_rows(dtype: str, shape: tuple[int, ...], slab_bytes: int) -> list[tuple[int, int]]:
    """The row ranges ``[r0, r1)`` an array is read in: whole rows, at most ``slab_bytes``
    each (at least one row). A scalar is one slab ``(0, 0)``; an empty array has none."""
    if not shape:
        return [(0, 0)]
    row = max(1, math.prod(shape[1:]) * itemsize_of(dtype))
    step = max(1, slab_bytes // row)
    return [(r0, min(shape[0], r0 + step)) for r0 in range(0, shape[0], step)]


def array_paths(node: Node, path: KeyPath = ()) -> Iterator[tuple[KeyPath, Node]]:
    """Every array-holding node (arrays, bytes, pickles) with its key path, in tree order."""
    if node.array is not None:
        yield path, node
        return
    kids = node.children or []
    if node.kind == "stateful":
        for c in kids:
            yield from array_paths(c, path)
        return
    keys = list(node.keys) if node.keys is not None else list(range(len(kids)))
    for k, c in zip(keys, kids):
        yield from array_paths(c, path + (k,))


def tensor_names(root: Node) -> list[str]:
    """Flat tensor names (key path joined with ``.``) by array index; unique or an error.

    An array that several key paths share (tied weights) is named by the first
    one in tree order; the tree records the others."""
    first: dict[int, KeyPath] = {}
    for p, n in array_paths(root):
        first.setdefault(n.array or 0, p)
    found = sorted(first.items(), key=lambda x: x[0])
    # "tensor" names a lone array (the empty key path) only: a tensor saved under the
    # name "" (key path ('',)) kept its name (it was written back as "tensor")
    names = [".".join(str(k) for k in p) if p else "tensor" for _, p in found]
    seen: dict[str, KeyPath] = {}
    for (_, p), name in zip(found, names):
        if name in seen:
            raise UnsupportedTypeError(
                f"key paths '{format_keypath(seen[name])}' and '{format_keypath(p)}' both "
                f"become the flat tensor name {name!r}; rename one to convert")
        seen[name] = p
    return names


# ----------------------------------------------------------------------------- statestream


def _layout(specs: Sequence[ArraySpec], slab_bytes: int) -> tuple[list[list[int]], int]:
    """Data-file offset of every slab (one chunk each) and the file size: format.md's
    layout, chunks of 256 KiB or more on a page boundary, smaller ones on 64 bytes."""
    pos = 0
    offsets: list[list[int]] = []
    for dtype, shape in specs:
        mine = []
        row = math.prod(shape[1:]) * itemsize_of(dtype) if shape else itemsize_of(dtype)
        for r0, r1 in slab_rows(dtype, shape, slab_bytes):
            n = (r1 - r0) * row if shape else row
            if not n:
                continue
            pos += -pos % (PAGE if n >= 256 << 10 else 64)
            mine.append(pos)
            pos += n
        offsets.append(mine)
    return offsets, pos


def _pieces(buf: np.ndarray, itemsize: int, comp: Compression | None, threads: int
            ) -> list[tuple[int, np.ndarray, bytes | None]]:
    """``buf`` (a slab) as (first row, rows, stored bytes or None for raw).

    Raw: the slab whole. Compressed: row groups of at most
    ``COMPRESSED_CHUNK_BYTES`` (as a save chunks compressed arrays), encoded on
    ``threads`` threads (zstd releases the GIL).
    """
    if comp is None or buf.ndim == 0 or buf.shape[0] <= 1:
        return [(0, buf, encode_chunk(buf, itemsize, comp) if comp is not None else None)]
    row = buf.nbytes // buf.shape[0]
    step = max(1, COMPRESSED_CHUNK_BYTES // max(row, 1))
    groups = [(r, buf[r : r + step]) for r in range(0, buf.shape[0], step)]
    out: list[bytes | None] = [None] * len(groups)

    def encode(k: int) -> None:
        out[k] = encode_chunk(groups[k][1], itemsize, comp)

    parallel_for(encode, range(len(groups)), threads)
    return [(r, g, o) for (r, g), o in zip(groups, out)]


def write_statestream(dst: str | os.PathLike[str], root: Node, specs: Sequence[ArraySpec],
                      slabs: Slabs, meta: dict[str, Any], *, overwrite: bool,
                      slab_bytes: int, codecs: Sequence[Compression | None] | None = None,
                      threads: int = 1) -> None:
    """Write a statestream checkpoint (one data file, one chunk per slab), atomically.

    ``slabs`` must deliver the row ranges ``slab_rows(..., slab_bytes)`` gives.
    ``codecs``: each array's compression (None: raw): a slab is then stored as
    chunks of at most 4 MiB, compressed on ``threads`` threads, each stored raw
    where compressing does not pay, as a save does; the chunks are laid out as
    they come (their sizes are known only then)."""
    storage, spath = storage_for(dst)
    refuse_replacing_a_base(storage, spath, overwrite)
    write = functools.partial(_commit_statestream, storage, root=root, specs=specs,
                              slabs=slabs, meta=meta, slab_bytes=slab_bytes, codecs=codecs,
                              threads=threads)
    local = isinstance(storage, LocalStorage)
    if local and overwrite and os.path.lexists(spath):
        claim(spath, True, directory=True)  # what the other directory outputs replace
    if not (local and _foreign_checkpoint_dir(spath)):
        write(spath, overwrite=overwrite)
        return
    # the storage replaces only a statestream checkpoint or an empty directory (a save's
    # rule); a conversion also replaces a checkpoint of another format, as its other
    # directory outputs do: committed beside it, then moved over it
    if not overwrite:
        raise CheckpointExistsError(f"{spath} already exists; pass overwrite=True to replace it")
    staging = staging_path(spath)
    try:
        out = os.path.join(staging, "out")
        write(out, overwrite=False)
        publish(out, spath)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _foreign_checkpoint_dir(path: str) -> bool:
    """A local directory holding a checkpoint of another format that statestream reads
    (not a statestream one, committed or not, and not empty)."""
    if not os.path.isdir(path) or os.path.islink(path) or not os.listdir(path):
        return False
    if any(os.path.lexists(os.path.join(path, n)) for n in (COMMIT_NAME, MANIFEST_NAME)):
        return False
    return holds_checkpoint(path)


def _commit_statestream(storage: Storage, path: str, *, overwrite: bool, root: Node,
                        specs: Sequence[ArraySpec], slabs: Slabs, meta: dict[str, Any],
                        slab_bytes: int, codecs: Sequence[Compression | None] | None,
                        threads: int) -> None:
    """``write_statestream``'s checkpoint, written and committed at ``path`` by ``storage``."""
    txn = storage.begin_write(path, overwrite=overwrite)
    packed = codecs is not None and any(c is not None for c in codecs)
    fw: FileWriter | None = None
    try:
        name = "data/r0-0.bin"
        offsets, total = _layout(specs, slab_bytes)
        fw = txn.create_file(name, 0 if packed else total)
        arrays = []
        end = 0
        for i, (dtype, shape) in enumerate(specs):
            comp = codecs[i] if codecs is not None else None
            chunks: list[ChunkEntry] = []
            for row, buf in slabs(i):
                if not buf.nbytes:
                    continue
                for r, part, stored in _pieces(buf, itemsize_of(dtype), comp, threads):
                    data = part.reshape(-1).view(np.uint8) if stored is None else stored
                    n = len(data)
                    pos = chunk_offset(end, n) if packed else offsets[i][len(chunks)]
                    fw.write_at([data], pos)
                    end = pos + n
                    start = (row + r,) + (0,) * (len(shape) - 1) if shape else ()
                    entry = ChunkEntry(0, pos, n, checksum(data), start, tuple(part.shape))
                    if stored is not None and comp is not None:
                        entry.codec, entry.shuffle = comp.codec, bool(comp.shuffle)
                    chunks.append(entry)
                del buf  # before the next slab is read: one at a time
            arrays.append(ArrayEntry(dtype, tuple(shape), tuple(chunks)))
        done = fw
        fw = None  # finish closes it, whatever happens
        done.finish()
        size = end if packed else total
        data_bytes = sum(math.prod(s) * itemsize_of(d) for d, s in specs)
        full = {**meta, "library": f"statestream {__version__}", "created_unix": time.time(),
                "world_size": 1, "total_bytes": data_bytes}
        mbytes = encode_manifest(Manifest(root, arrays, [FileEntry(name, size)], full))
        txn.write_bytes(MANIFEST_NAME, mbytes)
        txn.write_bytes(COMMIT_NAME, encode_commit(mbytes))
        txn.commit()
    except BaseException:
        if fw is not None:  # its descriptors would hold the removed file's space
            fw.abort()
        txn.abort()
        raise


# ----------------------------------------------------------------------------- safetensors


def check_safetensors(root: Node, specs: Sequence[ArraySpec]) -> list[str]:
    """Tensor names, after checking every dtype has a safetensors code (error names paths)."""
    bad = [(format_keypath(p), specs[n.array or 0][0]) for p, n in array_paths(root)
           if specs[n.array or 0][0] not in ST_CODES]
    if bad:
        listed = ", ".join(f"'{p}' ({d})" for p, d in bad[:20])
        raise UnsupportedTypeError(
            f"safetensors cannot hold the dtype of the arrays at key paths {listed}"
            f"{' and more' if len(bad) > 20 else ''}; it holds {', '.join(sorted(ST_CODES))}")
    names = tensor_names(root)
    if "__metadata__" in names:  # the header's own key: the file would be unreadable
        p = next(p for p, n in array_paths(root) if names[n.array or 0] == "__metadata__")
        raise UnsupportedTypeError(
            f"the array at key path '{format_keypath(p)}' would be the safetensors tensor "
            "'__metadata__', the name of the header's metadata; rename it to convert")
    return names


def _st_metadata(root: Node, names: list[str], meta: dict[str, Any]) -> dict[str, str]:
    user = meta.get("__metadata__")
    out = {str(k): str(v) for k, v in user.items()} if isinstance(user, dict) else {}
    rest = {k: v for k, v in meta.items() if k != "__metadata__"}
    out[TREE_KEY] = json.dumps(encode_tree(root), separators=(",", ":"))
    out[NAMES_KEY] = json.dumps(names, separators=(",", ":"))
    if rest:
        out[META_KEY] = json.dumps(rest, separators=(",", ":"), allow_nan=False)
    return out


class _SeqFile:
    """A new file written front to back, made durable by ``close``.

    Bytes gather in a page-aligned block; each full block is written with
    O_DIRECT by a background thread (no page-cache copy, nothing left for the
    final fsync) while the caller fills the other block, so reading the source
    and writing the disk overlap. The last partial block is written through
    the page cache; the file is fsynced before ``close`` returns. A file
    system that refuses O_DIRECT gets ordinary writes.
    """

    def __init__(self, path: str, block_bytes: int) -> None:
        self.path = path
        self.block = max(PAGE, block_bytes - block_bytes % PAGE)
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        self.dfd = -1
        if _O_DIRECT:
            try:
                self.dfd = os.open(path, os.O_WRONLY | os.O_CLOEXEC | _O_DIRECT)
            except OSError:  # no O_DIRECT on this file system: buffered writes, then fsync
                self.dfd = -1
        self.blocks = [aligned_bytes(self.block), aligned_bytes(self.block)]
        self.cur = 0
        self.fill = 0
        self.at = 0  # file offset of the current block
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="statestream-convert-write")
        self.pending: Future[None] | None = None

    def write(self, data: np.ndarray) -> None:
        src = data.reshape(-1).view(np.uint8)
        done = 0
        while done < src.nbytes:
            n = min(self.block - self.fill, src.nbytes - done)
            self.blocks[self.cur][self.fill:self.fill + n] = src[done:done + n]
            self.fill += n
            done += n
            if self.fill == self.block:
                self._flush_block()

    def _flush_block(self) -> None:
        if self.pending is not None:
            self.pending.result()  # the other block is free again
        self.pending = self.pool.submit(self._put, self.blocks[self.cur], self.at)
        self.at += self.block
        self.cur ^= 1
        self.fill = 0

    def _put(self, block: np.ndarray, at: int) -> None:
        try:
            self._put_raw(block, at)
        except OSError as exc:
            raise storage_error(f"writing {self.path} at offset {at} failed: {exc}", exc) from exc

    def _put_raw(self, block: np.ndarray, at: int) -> None:
        view = memoryview(block.data)
        if self.dfd >= 0:
            try:
                while view.nbytes:
                    w = os.pwrite(self.dfd, view, at)
                    at += w
                    view = view[w:]
                return
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                # this file system takes O_DIRECT opens but not the writes: buffered from here
                os.close(self.dfd)
                self.dfd = -1
        while view.nbytes:
            w = os.pwrite(self.fd, view, at)
            at += w
            view = view[w:]

    def close(self) -> None:
        """Write what is left, fsync, close."""
        try:
            if self.pending is not None:
                self.pending.result()
                self.pending = None
            if self.fill:
                if self.dfd >= 0:
                    os.close(self.dfd)  # the tail is not a whole page: through the cache
                    self.dfd = -1
                self._put(self.blocks[self.cur][:self.fill], self.at)
            try:
                os.fsync(self.fd)
            except OSError as exc:
                raise storage_error(f"fsync of {self.path} failed: {exc}", exc) from exc
        finally:
            self.abort()

    def abort(self) -> None:
        if self.pending is not None:
            self.pending.cancel()
            try:
                self.pending.result()
            except Exception:  # noqa: BLE001 - the error being handled is the caller's
                pass
            self.pending = None
        self.pool.shutdown(wait=True)
        for fd in (self.dfd, self.fd):
            if fd >= 0:
                os.close(fd)
        self.dfd = self.fd = -1


def _write_one_file(path: str, members: list[int], names: list[str],
                    specs: Sequence[ArraySpec], slabs: Slabs, metadata: dict[str, str],
                    block_bytes: int) -> int:
    """One safetensors file holding arrays ``members``; returns its data size."""
    # lay data out by decreasing item size so every tensor is aligned to its dtype
    layout = sorted(members, key=lambda i: -itemsize_of(specs[i][0]))
    offsets: dict[int, tuple[int, int]] = {}
    pos = 0
    for i in layout:
        n = math.prod(specs[i][1]) * itemsize_of(specs[i][0])
        offsets[i] = (pos, pos + n)
        pos += n
    header: dict[str, Any] = {"__metadata__": metadata} if metadata else {}
    for i in members:
        header[names[i]] = {"dtype": ST_CODES[specs[i][0]], "shape": list(specs[i][1]),
                            "data_offsets": list(offsets[i])}
    hb = json.dumps(header, separators=(",", ":")).encode()
    hb += b" " * (-len(hb) % 8)
    if len(hb) > _st.MAX_HEADER_BYTES:  # no reader (ours, safetensors') would open the file
        raise UnsupportedTypeError(
            f"the safetensors header would be {len(hb)} bytes, above the "
            f"{_st.MAX_HEADER_BYTES}-byte limit of its readers (statestream's and "
            "safetensors'): too many tensors, or too large a tree; write shards "
            "(max_shard_bytes: the tree goes into the index) or convert fewer items")
    f = _SeqFile(path, block_bytes)
    try:
        f.write(np.frombuffer(struct.pack("<Q", len(hb)) + hb, np.uint8))
        for i in layout:  # the file is written front to back: tensors in layout order
            for _, buf in slabs(i):
                f.write(buf)
                del buf  # before the next slab is read: one slab at a time
        f.close()
    except BaseException:
        f.abort()
        raise
    return pos


def write_safetensors(dst: str, root: Node, specs: Sequence[ArraySpec], slabs: Slabs,
                      meta: dict[str, Any], *, overwrite: bool, sharded: bool,
                      max_shard_bytes: int | None, block_bytes: int = 16 << 20) -> None:
    """One ``.safetensors`` file, or Hugging Face shards plus ``model.safetensors.index.json``.

    Each file is written through two blocks of ``block_bytes`` (see ``_SeqFile``)."""
    names = check_safetensors(root, specs)
    metadata = _st_metadata(root, names, meta)
    claim(dst, overwrite, directory=sharded)
    staging = staging_path(dst)
    try:
        if not sharded:
            out = os.path.join(staging, "out.safetensors")
            _write_one_file(out, list(range(len(specs))), names, specs, slabs, metadata,
                            block_bytes)
            publish(out, dst)
            return
        limit = max_shard_bytes or DEFAULT_SHARD_BYTES
        shards: list[list[int]] = [[]]
        size = 0
        for i, (d, s) in enumerate(specs):
            n = math.prod(s) * itemsize_of(d)
            if shards[-1] and size + n > limit:
                shards.append([])
                size = 0
            shards[-1].append(i)
            size += n
        weight_map: dict[str, str] = {}
        total = 0
        for k, members in enumerate(shards):
            fname = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
            total += _write_one_file(os.path.join(staging, fname), members, names, specs,
                                     slabs, {"format": "pt"}, block_bytes)
            weight_map.update((names[i], fname) for i in members)
        index = {"metadata": {**metadata, "total_size": total},  # the user's total_size lost
                 "weight_map": {n: weight_map[n] for n in names}}
        ipath = os.path.join(staging, "model.safetensors.index.json")
        text = json.dumps(index, indent=2)
        if len(text.encode()) > _st.MAX_INDEX_BYTES:  # statestream would refuse to read it
            raise UnsupportedTypeError(
                f"the safetensors index would be {len(text.encode())} bytes, above the "
                f"{_st.MAX_INDEX_BYTES}-byte limit statestream reads: too many tensors or "
                "too large a tree; convert fewer items")
        with writing(ipath), open(ipath, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())  # durable before the directory moves into place
        publish(staging, dst)
        staging = ""
    finally:
        if staging:
            shutil.rmtree(staging, ignore_errors=True)
