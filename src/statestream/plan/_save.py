"""Save planning: split arrays into chunks and lay chunks out in data files.

Pure functions over plain dataclasses; every item carries its byte cost.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from statestream.errors import TargetMismatchError
from statestream.format import Compression
from statestream.plan._cover import Box, cover_fault, cover_message
from statestream.plan._keys import shown_key

__all__ = [
    "COMPRESSED_CHUNK_BYTES",
    "ArraySpec",
    "FilePlan",
    "StreamPlanner",
    "WriteItem",
    "assign_writers",
    "block_rows_for",
    "chunk_offset",
    "split_chunks",
]

#: Chunks of at least this size start on a page boundary (O_DIRECT/mmap friendly).
PAGE_ALIGN = 4096
PAGE_ALIGN_MIN_BYTES = 256 * 1024
#: Smaller chunks are packed on cache-line boundaries.
SMALL_ALIGN = 64
#: Compressed arrays are split into chunks of at most this size (or ``max_chunk_bytes``
#: if smaller): a compressed chunk is decoded whole, so a partial load reads little
#: more than it needs, and more chunks keep more threads compressing.
COMPRESSED_CHUNK_BYTES = 4 << 20


@dataclasses.dataclass(frozen=True, slots=True)
class ArraySpec:
    """What the planner needs to know about one array to save."""

    shape: tuple[int, ...]
    itemsize: int
    #: the writer allocates each chunk (charged to its budget as ``staging_bytes``)
    copies: bool = False
    #: how its chunks are compressed (None: stored raw)
    codec: Compression | None = None
    #: each chunk is a copy taken whole (by the writer or a snapshot's direct read):
    #: chunks of at most the planner's ``copy_chunk_bytes``
    copied_whole: bool = False


@dataclasses.dataclass(slots=True)  # not frozen: frozen __init__ is ~3x slower
class WriteItem:
    """One chunk to write: which array box, where in which file, and its cost."""

    array: int
    chunk: int
    start: tuple[int, ...]
    shape: tuple[int, ...]
    nbytes: int
    file: int
    offset: int
    #: Host bytes the engine must stage (copy) to write this item; 0 if zero-copy.
    staging_bytes: int
    #: Rows (axis 0) per checksum block; 0 = one checksum for the whole chunk.
    block_rows: int = 0
    #: Compress the chunk so (the writer then places it: ``offset`` is only planned).
    codec: Compression | None = None


@dataclasses.dataclass(slots=True)
class FilePlan:
    """A data file: its name, final size and items in offset order."""

    name: str
    size: int
    items: list[WriteItem]


def split_chunks(
    shape: tuple[int, ...], itemsize: int, max_chunk_bytes: int
) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Split an array into row blocks (along axis 0) of at most ``max_chunk_bytes``.

    Each block is contiguous in C order. Empty arrays have no chunks; 0-d
    arrays have one.

    Example:
        >>> split_chunks((10, 4), 4, 48)
        [((0, 0), (3, 4)), ((3, 0), (3, 4)), ((6, 0), (3, 4)), ((9, 0), (1, 4))]
    """
    if not shape:
        return [((), ())]
    if math.prod(shape) == 0:
        return []
    row_bytes = math.prod(shape[1:]) * itemsize
    rows = max(1, max_chunk_bytes // max(row_bytes, 1))
    out = []
    for r in range(0, shape[0], rows):
        n = min(rows, shape[0] - r)
        out.append(((r,) + (0,) * (len(shape) - 1), (n,) + tuple(shape[1:])))
    return out


#: Chunks larger than this get a checksum per block of rows of about this size,
#: so a load that needs only some rows of a chunk (resharding) can verify them.
CHECKSUM_BLOCK_BYTES = 1 << 20


def block_rows_for(shape: tuple[int, ...], itemsize: int) -> int:
    """Rows per checksum block for a chunk of ``shape`` (0: a single checksum).

    Example:
        >>> block_rows_for((4096, 1024), 4), block_rows_for((10, 10), 4)
        (256, 0)
    """
    if not shape or shape[0] < 2:
        return 0
    row_bytes = math.prod(shape[1:]) * itemsize
    if row_bytes * shape[0] <= CHECKSUM_BLOCK_BYTES or row_bytes == 0:
        return 0
    rows = max(1, CHECKSUM_BLOCK_BYTES // row_bytes)
    return rows if rows < shape[0] else 0


def _align(offset: int, nbytes: int) -> int:
    a = PAGE_ALIGN if nbytes >= PAGE_ALIGN_MIN_BYTES else SMALL_ALIGN
    return -(-offset // a) * a


def chunk_offset(end: int, nbytes: int) -> int:
    """Where a chunk of ``nbytes`` goes after a file's first ``end`` bytes (its alignment,
    docs/format.md "Layout").

    Example:
        >>> chunk_offset(100, 10), chunk_offset(100, 1 << 20)
        (128, 4096)
    """
    return _align(end, nbytes)


class StreamPlanner:
    """Plan a save incrementally, array by array, as the state is walked.

    Chunks go to ``max_files`` files in round-robin blocks of
    ``block_bytes``, so writers can start on the first arrays while later
    ones are still being prepared, and bytes stay balanced across files
    without knowing the total in advance. Small states stay in one file.

    Example:
        >>> sp = StreamPlanner(file_prefix="data/r0", max_files=2, max_chunk_bytes=8,
        ...                    block_bytes=8)
        >>> [(it.file, it.offset) for it in sp.add(0, ArraySpec((4,), 4))]
        [(0, 0), (1, 0)]
        >>> [(f.name, f.size) for f in sp.files()]
        [('data/r0-0.bin', 8), ('data/r0-1.bin', 8)]
    """

    def __init__(self, *, file_prefix: str, max_files: int, max_chunk_bytes: int,
                 block_bytes: int = 16 << 20, copy_chunk_bytes: int | None = None,
                 codec_chunk_bytes: int | None = None) -> None:
        self._prefix = file_prefix
        self._max_files = max(1, max_files)
        self._max_chunk = max_chunk_bytes
        #: the largest chunk of an array whose chunks are copies (``ArraySpec.copies``):
        #: each is allocated whole, so it is kept within the memory budget
        self._copy_chunk = min(max_chunk_bytes, copy_chunk_bytes or max_chunk_bytes)
        #: the largest chunk of a compressed array: compressing one takes buffers
        #: of its size (COMPRESSED_CHUNK_BYTES at most)
        self._codec_chunk = min(COMPRESSED_CHUNK_BYTES,
                                codec_chunk_bytes or COMPRESSED_CHUNK_BYTES)
        self._block = max(1, block_bytes)
        self._sizes: list[int] = [0]
        self._file = 0
        self._in_block = 0
        self.chunks: list[list[tuple[tuple[int, ...], tuple[int, ...], int]]] = []
        self.total_bytes = 0

    def add(self, array: int, spec: ArraySpec,
            boxes: list[tuple[tuple[int, ...], tuple[int, ...]]] | None = None
            ) -> list[WriteItem]:
        """Chunk array number ``array`` (must be the next index) and place its chunks.

        ``boxes`` are the parts of the array this process writes (default:
        all of it); each is split into row-block chunks.
        """
        assert array == len(self.chunks), "arrays must be added in order"
        shape = spec.shape
        limit = self._copy_chunk if spec.copies or spec.copied_whole else self._max_chunk
        if spec.codec is not None:
            limit = min(limit, self._codec_chunk)
        if boxes is None:
            nb = math.prod(shape) * spec.itemsize
            if 0 < nb <= CHECKSUM_BLOCK_BYTES and nb <= limit:
                # Fast path for small arrays (most leaves of a big state): one
                # chunk, no block checksums.
                start = (0,) * len(shape)
                self.chunks.append([(start, shape, nb)])
                if self._in_block >= self._block:
                    self._file = (self._file + 1) % self._max_files
                    self._in_block = 0
                    if self._file == len(self._sizes):
                        self._sizes.append(0)
                f = self._file
                off = _align(self._sizes[f], nb)
                self._sizes[f] = off + nb
                self._in_block += nb
                self.total_bytes += nb
                return [WriteItem(array, 0, start, shape, nb, f, off,
                                  nb if spec.copies else 0, codec=spec.codec)]
        per: list[tuple[tuple[int, ...], tuple[int, ...], int]] = []
        items: list[WriteItem] = []
        max_chunk = limit
        if boxes is None:
            whole = math.prod(shape) * spec.itemsize
            if 0 < whole <= max_chunk:  # the common case: one chunk
                chunk_boxes = [((0,) * len(shape), shape)]
            else:
                chunk_boxes = split_chunks(shape, spec.itemsize, max_chunk)
        else:
            chunk_boxes = []
            for bstart, bshape in boxes:
                for rstart, rshape in split_chunks(bshape, spec.itemsize, max_chunk):
                    chunk_boxes.append(
                        (tuple(a + b for a, b in zip(bstart, rstart)), rshape)
                    )
        for ci, (start, cshape) in enumerate(chunk_boxes):
            nb = math.prod(cshape) * spec.itemsize
            per.append((start, cshape, nb))
            if nb == 0:
                continue
            if self._in_block >= self._block:
                self._file = (self._file + 1) % self._max_files
                self._in_block = 0
                if self._file == len(self._sizes):
                    self._sizes.append(0)
            off = _align(self._sizes[self._file], nb)
            item = WriteItem(array, ci, start, cshape, nb, self._file, off,
                             nb if spec.copies else 0, codec=spec.codec)
            if spec.codec is None:  # a compressed chunk is verified (and decoded) whole
                item.block_rows = block_rows_for(cshape, spec.itemsize)
            items.append(item)
            self._sizes[self._file] = off + nb
            self._in_block += nb
            self.total_bytes += nb
        self.chunks.append(per)
        return items

    def file_name(self, index: int) -> str:
        return f"{self._prefix}-{index}.bin"

    def files(self) -> list[FilePlan]:
        """The files written so far with their final sizes (items are not kept)."""
        return [FilePlan(self.file_name(i), size, []) for i, size in enumerate(self._sizes)
                if size > 0]


#: One process's description of an array: (key path, dtype, shape, held boxes).
ArrayDesc = tuple[str, str, tuple[int, ...], list[tuple[tuple[int, ...], tuple[int, ...]]]]


def assign_writers(
    per_rank: Sequence[Sequence[ArrayDesc]], itemsize: dict[str, int]
) -> dict[tuple[str, tuple[int, ...], tuple[int, ...]], int]:
    """Choose exactly one writing process for every distinct box of every array.

    Every process runs this on the same gathered input and gets the same
    answer, so no second round of messages is needed. Boxes held by several
    processes (replicas) go to the holder with the fewest bytes assigned so
    far, biggest boxes first, so writing work is spread evenly.

    The distinct boxes of each array must cover it exactly once (a box held by
    several processes counts once): checked here, before anything is written.

    Raises:
        TargetMismatchError: two processes disagree on an array's dtype or shape,
            or the boxes of an array leave part of it to no process or hold
            part of it in two different boxes (naming the key path, the part,
            and which process holds which box).

    Example:
        >>> a = [("w", "float32", (4,), [((0,), (4,))])]
        >>> assign_writers([a, a], {"float32": 4})
        {('w', (0,), (4,)): 0}
        >>> b = [("w", "float32", (4,), [((0,), (4,))]), ("v", "float32", (4,), [((0,), (4,))])]
        >>> sorted(assign_writers([b, b], {"float32": 4}).values())
        [0, 1]
    """
    meta: dict[str, tuple[str, tuple[int, ...]]] = {}
    held: dict[str, dict[Box, list[int]]] = {}  # key path -> distinct box -> holders
    for rank, arrays in enumerate(per_rank):
        for key, dtype, shape, boxes in arrays:
            shape = tuple(shape)
            seen = meta.setdefault(key, (dtype, shape))
            if seen != (dtype, shape):
                raise TargetMismatchError(
                    f"processes disagree about the array at key path '{shown_key(key)}': "
                    f"{seen[0]}{list(seen[1])} on one, {dtype}{list(shape)} on rank {rank}"
                )
            mine = held.get(key)
            if mine is None:
                mine = held[key] = {}
            for start, bshape in boxes:
                mine.setdefault((tuple(start), tuple(bshape)), []).append(rank)
    for key, mine in held.items():
        if len(mine) == 1 and next(iter(mine)) == ((0,) * len(meta[key][1]), meta[key][1]):
            continue  # one box of all of it (a plain or replicated array): the usual case
        fault = cover_fault(meta[key][1], mine)
        if fault is not None:
            declared = [r for r, arrays in enumerate(per_rank) if any(a[0] == key for a in arrays)]
            raise TargetMismatchError(cover_message(shown_key(key), *meta[key], fault, mine,
                                                    declared, len(per_rank)))
    holders = {(key, s, b): ranks for key, mine in held.items() for (s, b), ranks in mine.items()}
    load = [0] * len(per_rank)
    owners: dict[tuple[str, tuple[int, ...], tuple[int, ...]], int] = {}
    costs = {k: math.prod(k[2]) * itemsize[meta[k[0]][0]] for k in holders}
    for k in sorted(holders, key=lambda k: (-costs[k], k[0], k[1])):
        ranks = holders[k]
        best = ranks[0] if len(ranks) == 1 else min(ranks, key=lambda r: (load[r], r))
        owners[k] = best
        load[best] += costs[k]
    return owners
