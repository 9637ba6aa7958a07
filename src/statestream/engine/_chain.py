"""Reading an incremental checkpoint: its references followed into its bases.

A reader follows a reference only to a committed sibling whose manifest lists a
chunk at that file and offset with the same stored size, checksums, codec, hash and
raw size (docs/format.md "References"). Loading, verifying and converting then read
the base's files through :class:`ChainReader` as if they were the checkpoint's own.
The writing side (hashes, matching a base's chunks) is in ``_refs``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from statestream.engine._refs import _open_committed, _same_record
from statestream.errors import TruncatedFileError, UnsafeCheckpointError
from statestream.format import (
    MAX_ARRAYS,
    ArrayEntry,
    ChunkEntry,
    FileEntry,
    Manifest,
    itemsize_of,
)
from statestream.storage import CheckpointReader, MappedReader, Storage, file_where

__all__ = ["ChainReader", "MappedChainReader", "follow_bases"]

_Buffer = Any


class ChainReader:
    """A checkpoint's reader that also reads its bases' data files.

    A base file appears under a name of its own (``../<base>/data/...``, a
    key of this reader only: it never reaches a storage backend), so the
    read pipeline handles referenced chunks as the checkpoint's own; errors
    name the base file's real location.
    """

    list_files: Callable[[], list[str]]

    def __init__(self, main: CheckpointReader,
                 extra: dict[str, tuple[CheckpointReader, str]],
                 bases: Sequence[CheckpointReader]) -> None:
        self.main = main
        self.location = main.location
        self._extra = extra
        self._bases = list(bases)
        lf = getattr(main, "list_files", None)
        if lf is not None:
            self.list_files = lf

    def _route(self, name: str) -> tuple[CheckpointReader, str]:
        got = self._extra.get(name)
        return got if got is not None else (self.main, name)

    def read_bytes(self, name: str, max_bytes: int) -> bytes:
        return self.main.read_bytes(name, max_bytes)

    def file_url(self, name: str) -> str:
        """Where file ``name`` really is: a base's file in the base (its reader's
        ``file_url``: an object store's includes the root its marker names), never
        the alias ``../<base>/...``, which no store resolves."""
        r, n = self._route(name)
        return file_where(r, n)

    def file_size(self, name: str) -> int:
        r, n = self._route(name)
        return r.file_size(n)

    def read_into(self, name: str, offset: int, buffers: Sequence[_Buffer]) -> None:
        r, n = self._route(name)
        r.read_into(n, offset, buffers)

    def close(self) -> None:
        for r in [self.main, *self._bases]:
            r.close()


class MappedChainReader(ChainReader):
    """A :class:`ChainReader` whose checkpoint and bases are all local files: it maps
    file ranges and tells the page cache's state as their readers do, so incremental
    checkpoints load mapped (and drop behind) like full ones."""

    def _mapped(self, name: str) -> tuple[MappedReader, str]:
        r, n = self._route(name)
        assert isinstance(r, MappedReader)
        return r, n

    def map_range(self, name: str, offset: int, nbytes: int) -> memoryview | None:
        r, n = self._mapped(name)
        return r.map_range(n, offset, nbytes)

    def map_ranges(self, ranges: Sequence[tuple[str, int, int]]) -> memoryview | None:
        """One mapping of ranges of one checkpoint's files; None (read them) when the
        ranges lie in different checkpoints."""
        routed = [(*self._mapped(name), off, nb) for name, off, nb in ranges]
        if len({id(r) for r, _, _, _ in routed}) != 1:
            return None
        return routed[0][0].map_ranges([(n, off, nb) for _, n, off, nb in routed])

    def cold_ranges(self, name: str, offset: int, nbytes: int) -> list[tuple[int, int]]:
        r, n = self._mapped(name)
        return r.cold_ranges(n, offset, nbytes)

    def drop_cached(self, name: str, ranges: list[tuple[int, int]], lo: int, hi: int) -> None:
        r, n = self._mapped(name)
        r.drop_cached(n, ranges, lo, hi)

    def read_ahead(self, name: str, offset: int, nbytes: int) -> None:
        r, n = self._mapped(name)
        r.read_ahead(n, offset, nbytes)


def _own_chunks(m: Manifest) -> dict[tuple[int, int], tuple[ChunkEntry, int]]:
    """(file, offset) -> (chunk, raw size) of every chunk a base stores itself."""
    out: dict[tuple[int, int], tuple[ChunkEntry, int]] = {}
    for a in m.arrays:
        isz = itemsize_of(a.dtype)
        for c in a.chunks:
            if c.ref is None:
                out[(c.file, c.offset)] = (c, math.prod(c.shape) * isz)
    return out


def _check_ref(c: ChunkEntry, raw: int, held: tuple[ChunkEntry, int] | None, key: str,
               where: str) -> None:
    """Refuse a reference unless the base lists exactly this chunk there."""
    assert c.ref is not None
    base = c.ref.base
    if held is None:
        raise UnsafeCheckpointError(
            f"array at key path '{key}' of {where} refers to bytes at offset {c.offset} of "
            f"file {c.file} of base checkpoint {base}, where {base}'s manifest lists no chunk "
            "of its own; refusing to follow the reference (corrupt or hostile manifest)")
    b, braw = held
    if not (braw == raw and _same_record(b, c)):
        raise UnsafeCheckpointError(
            f"array at key path '{key}' of {where} refers to a chunk of base checkpoint "
            f"{base} (file {c.file}, offset {c.offset}) whose record there differs (stored "
            f"size {b.nbytes} vs {c.nbytes}, CRC-32C {b.checksum:08x} vs {c.checksum:08x}, "
            "codec, hash or raw size); refusing to follow the reference")


@dataclasses.dataclass
class _Bases:
    """The opened bases of one checkpoint while its references are resolved."""

    storage: Storage
    spath: str
    where: str
    max_arrays: int
    readers: dict[str, CheckpointReader] = dataclasses.field(default_factory=dict)
    manifests: dict[str, Manifest] = dataclasses.field(default_factory=dict)
    own: dict[str, dict[tuple[int, int], tuple[ChunkEntry, int]]] = dataclasses.field(
        default_factory=dict)

    def open(self, names: Iterable[str]) -> None:
        for name in names:
            # a checkpoint whose base is gone is damaged (its chunks' files are missing)
            r, m, _, _ = _open_committed(self.storage, self.spath, name, of=self.where,
                                         missing=TruncatedFileError,
                                         max_arrays=self.max_arrays)
            self.readers[name] = r
            self.manifests[name] = m
            self.own[name] = _own_chunks(m)

    def close(self) -> None:
        for r in self.readers.values():
            r.close()


def follow_bases(storage: Storage, spath: str, reader: CheckpointReader, m: Manifest,
                 key_of: Callable[[int], str], max_arrays: int = MAX_ARRAYS,
                 ) -> tuple[CheckpointReader, Manifest]:
    """Resolve ``m``'s references: a reader and manifest where they are plain chunks.

    Every referenced chunk is checked against its base's manifest first
    (:func:`_check_ref`); the returned manifest lists the bases' files after
    the checkpoint's own, and the reader reads them from the bases. A
    manifest without bases comes back unchanged. A base's manifest of more than
    ``max_arrays`` arrays is refused as the checkpoint's own is (``read_manifest``).

    Raises:
        TruncatedFileError: a base is missing, naming it (the files holding the
            referenced chunks are gone: the checkpoint is damaged).
        UnsafeCheckpointError: a base is not committed, or does not list a
            referenced chunk exactly as the reference records it.
        CheckpointError: a base's manifest holds more than ``max_arrays`` arrays.
    """
    if not m.bases:
        return reader, m
    bases = _Bases(storage, spath, reader.location, max_arrays)
    try:
        bases.open(m.bases)
        files = list(m.files)
        index: dict[tuple[str, int], int] = {}
        extra: dict[str, tuple[CheckpointReader, str]] = {}
        arrays: list[ArrayEntry] = []
        for ai, a in enumerate(m.arrays):
            if not any(c.ref is not None for c in a.chunks):
                arrays.append(a)
                continue
            isz = itemsize_of(a.dtype)
            out = []
            for c in a.chunks:
                if c.ref is None:
                    out.append(c)
                    continue
                bname = c.ref.base
                _check_ref(c, math.prod(c.shape) * isz, bases.own[bname].get((c.file, c.offset)),
                           key_of(ai), reader.location)
                k = (bname, c.file)
                if k not in index:
                    f = bases.manifests[bname].files[c.file]
                    alias = f"../{bname}/{f.name}"
                    index[k] = len(files)
                    files.append(FileEntry(alias, f.size))
                    extra[alias] = (bases.readers[bname], f.name)
                out.append(dataclasses.replace(c, file=index[k], ref=None))
            arrays.append(ArrayEntry(a.dtype, a.shape, tuple(out)))
    except BaseException:
        bases.close()
        raise
    readers = list(bases.readers.values())
    chain = (MappedChainReader if all(isinstance(r, MappedReader) for r in [reader, *readers])
             else ChainReader)
    return (chain(reader, extra, readers),
            dataclasses.replace(m, arrays=arrays, files=files))
