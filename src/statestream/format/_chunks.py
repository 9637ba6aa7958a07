"""Compact chunk tables: a decoded manifest keeps its chunks in flat integer columns.

A million chunks as Python objects (a list, two tuples and a dataclass each)
cost about 300 bytes apiece, six times their JSON. Here they cost 40-70
bytes: one ``array('q')`` column per field for the whole manifest, read as
:class:`ChunkEntry` objects made on demand by :class:`ChunkList`.
"""

from __future__ import annotations

import dataclasses
from array import array
from collections.abc import Iterator, Sequence
from typing import Any, overload

import numpy as np

__all__ = ["CODECS", "ChunkEntry", "ChunkList", "ChunkRef", "ChunkStore"]


#: Codecs this statestream reads and writes (format v2, docs/format.md "Codecs").
CODECS = ("zstd",)


@dataclasses.dataclass(frozen=True, slots=True)
class ChunkRef:
    """Where a chunk's bytes live in *another* checkpoint (format v2, incremental saves).

    ``base`` is the base checkpoint's directory name, a sibling of this
    checkpoint (one of the manifest's ``bases``); ``file`` is an index into
    the *base* manifest's ``files`` and equals the chunk's own ``file``. The
    chunk's offset, nbytes, crc32c, codec and hash are the base's record of it.
    """

    base: str
    file: int


@dataclasses.dataclass(slots=True)  # not frozen: built 1000s of times per load
class ChunkEntry:
    """A box of an array stored contiguously (C order) in one data file.

    ``nbytes`` is the number of bytes *stored* in the file; the raw size is
    ``prod(shape) * itemsize``. They are equal unless ``codec`` names an
    encoding (compression; ``shuffle``: the raw bytes were byte-shuffled by
    element before it, see docs/format.md). ``digest`` is the XXH3-128 of
    the raw bytes (16 bytes, big-endian as ``xxhash.xxh3_128().digest()``).
    ``ref`` says the bytes live in a base checkpoint instead of this one's
    files. All of them are format v2: a chunk without them is written as in v1.
    """

    file: int
    offset: int
    nbytes: int
    checksum: int
    start: tuple[int, ...]
    shape: tuple[int, ...]
    #: Optional finer checksums so partial (row-range) reads can be verified:
    #: the chunk's rows (axis 0) in groups of ``block_rows``, one CRC-32C each.
    block_rows: int = 0
    block_checksums: tuple[int, ...] = ()
    codec: str | None = None
    shuffle: bool = False
    digest: bytes | None = None
    ref: ChunkRef | None = None

    def in_file(self, file: int) -> ChunkEntry:
        """A copy recorded in data file ``file`` (every other field the same).

        Built field by field: ``dataclasses.replace`` costs ~4 us, and rank 0
        renumbers every chunk of every other rank when it joins their parts.

        Example:
            >>> ChunkEntry(0, 64, 4, 7, (0,), (4,)).in_file(3).file
            3
        """
        return ChunkEntry(file, self.offset, self.nbytes, self.checksum, self.start, self.shape,
                          self.block_rows, self.block_checksums, self.codec, self.shuffle,
                          self.digest, self.ref)


#: ``ChunkStore.flags`` bits: the chunk has a codec / is a reference to a base.
FLAG_CODEC = 1
FLAG_REF = 2

#: (codec, shuffle, digest, index into ``ChunkStore.bases`` or -1) of a v2 chunk
ChunkExt = tuple[str | None, bool, bytes | None, int]


class ChunkStore:
    """Every chunk of a manifest, column by column (appended while decoding)."""

    __slots__ = ("bases", "blocks", "coords", "ext", "fields", "flags", "spans")

    def __init__(self) -> None:
        #: first chunk, end chunk, first coordinate and ndim of each array, flat (4 each)
        self.spans = array("q")
        #: file, offset, nbytes, crc32c of each chunk, flat (4 per chunk)
        self.fields = array("q")
        #: start then shape of each chunk, flat (2 x ndim per chunk)
        self.coords = array("q")
        #: chunk number -> (block_rows, block checksums), for the few that have them
        self.blocks: dict[int, tuple[int, tuple[int, ...]]] = {}
        #: chunk number -> its v2 fields (codec, shuffle, digest, ref), for those that have any
        self.ext: dict[int, ChunkExt] = {}
        #: FLAG_CODEC | FLAG_REF of each chunk (one byte per chunk; 0 for a v1 chunk)
        self.flags = array("b")
        #: the manifest's ``bases`` (names a ref's index resolves to)
        self.bases: list[str] = []

    def __len__(self) -> int:
        return len(self.fields) // 4


class ChunkList(Sequence[ChunkEntry]):
    """The chunks of one array: a read-only view of a :class:`ChunkStore`."""

    __slots__ = ("_k", "_store")

    def __init__(self, store: ChunkStore, lo: int, hi: int, c0: int, nd: int) -> None:
        # the span lives in the store: four ints here would cost more than the chunks
        self._store, self._k = store, len(store.spans) // 4
        store.spans.extend((lo, hi, c0, nd))

    @classmethod
    def of(cls, store: ChunkStore, k: int) -> ChunkList:
        """The chunks of the store's array ``k``, whose span the store holds already."""
        out = cls.__new__(cls)
        out._store, out._k = store, k
        return out

    def span(self) -> tuple[int, int, int, int]:
        """First chunk, end chunk, first coordinate and ndim in the store."""
        sp, k = self._store.spans, 4 * self._k
        return sp[k], sp[k + 1], sp[k + 2], sp[k + 3]

    def __len__(self) -> int:
        sp, k = self._store.spans, 4 * self._k
        return sp[k + 1] - sp[k]

    def columns(self) -> tuple[np.ndarray, np.ndarray]:
        """(n, 4) [file, offset, nbytes, crc] and (n, 2 * ndim) [start..., shape...]."""
        lo, hi, c0, nd = self.span()
        n = hi - lo
        f = np.frombuffer(self._store.fields, dtype=np.int64)[4 * lo:4 * hi]
        c = np.frombuffer(self._store.coords, dtype=np.int64)[c0:c0 + 2 * nd * n]
        return f.reshape(n, 4), c.reshape(n, 2 * nd)

    def flags(self) -> np.ndarray:
        """(n,) int8: ``FLAG_CODEC | FLAG_REF`` of each chunk."""
        lo, hi, _, _ = self.span()
        if not len(self._store.flags):
            return np.zeros(hi - lo, dtype=np.int8)
        return np.frombuffer(self._store.flags, dtype=np.int8)[lo:hi]

    def _entry(self, j: int) -> ChunkEntry:
        s = self._store
        lo, _, c0, nd = self.span()
        g = lo + j
        f = s.fields
        c0 += 2 * nd * j
        cs = s.coords
        blk = s.blocks.get(g) if s.blocks else None
        ext = s.ext.get(g) if s.ext else None
        if ext is None:
            return ChunkEntry(f[4 * g], f[4 * g + 1], f[4 * g + 2], f[4 * g + 3],
                              tuple(cs[c0:c0 + nd]), tuple(cs[c0 + nd:c0 + 2 * nd]),
                              blk[0] if blk else 0, blk[1] if blk else ())
        codec, shuffle, digest, ref = ext
        return ChunkEntry(f[4 * g], f[4 * g + 1], f[4 * g + 2], f[4 * g + 3],
                          tuple(cs[c0:c0 + nd]), tuple(cs[c0 + nd:c0 + 2 * nd]),
                          blk[0] if blk else 0, blk[1] if blk else (), codec, shuffle,
                          digest, ChunkRef(s.bases[ref], f[4 * g]) if ref >= 0 else None)

    @overload
    def __getitem__(self, i: int) -> ChunkEntry: ...

    @overload
    def __getitem__(self, i: slice) -> tuple[ChunkEntry, ...]: ...

    def __getitem__(self, i: int | slice) -> ChunkEntry | tuple[ChunkEntry, ...]:
        if isinstance(i, slice):
            return tuple(self._entry(j) for j in range(*i.indices(len(self))))
        n = len(self)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError("chunk index out of range")
        return self._entry(i)

    def __iter__(self) -> Iterator[ChunkEntry]:
        for j in range(len(self)):
            yield self._entry(j)

    def __eq__(self, other: Any) -> bool:
        if isinstance(other, (ChunkList, tuple, list)):
            return len(self) == len(other) and all(a == b for a, b in zip(self, other))
        return NotImplemented

    def __hash__(self) -> int:
        return hash(tuple((c.file, c.offset, c.nbytes, c.checksum, c.start, c.shape, c.codec,
                           c.digest, c.ref) for c in self))

    def __repr__(self) -> str:
        return f"ChunkList({list(self)!r})"
