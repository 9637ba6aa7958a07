"""Load planning: intersect wanted boxes with saved chunks -> sorted byte ranges."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Sequence

import numpy as np

from statestream.format import ArrayEntry, ChunkEntry, checksum_of_blocks, dtype_from_name

__all__ = [
    "LoadPlan", "ReadPiece", "ReadRequest", "Wanted", "coalesce", "plan_load", "plan_verify",
]


@dataclasses.dataclass(frozen=True, slots=True)
class Wanted:
    """A destination box of an array: the engine fills ``dest`` (global box at ``start``)."""

    array: int
    start: tuple[int, ...]
    dest: np.ndarray
    #: ``dest`` is a private mapping of the array's own bytes in its data file
    #: (one contiguous range): nothing to read, only checksums to verify
    mapped: bool = False


@dataclasses.dataclass(slots=True)
class ReadPiece:
    """One saved chunk read whole, verified, then placed.

    ``direct`` is a 1-D uint8 view of destination memory the chunk lands in
    verbatim (no copy). Each ``scatter`` entry copies a region of the chunk
    (``chunk_index``) into a destination view.

    A compressed chunk (``codec``) is read whole (``nbytes`` stored bytes) into
    scratch, verified, then decoded to its ``raw_nbytes`` into ``direct`` or
    into scratch that is scattered (a load without destinations, ``verify``,
    decodes into scratch to check it).
    """

    array: int
    chunk: int
    file: int
    offset: int
    nbytes: int
    checksum: int
    chunk_shape: tuple[int, ...]
    dtype: np.dtype  # type: ignore[type-arg]
    direct: np.ndarray | None = None
    scatter: list[tuple[np.ndarray, tuple[slice, ...]]] = dataclasses.field(default_factory=list)
    #: (start, end, crc) byte ranges of this piece to verify; default: all of it
    #: against ``checksum``.
    verify: list[tuple[int, int, int]] | None = None
    codec: str | None = None
    shuffle: bool = False
    #: the decoded size of a compressed chunk (its ``nbytes`` are the stored ones)
    raw_nbytes: int = 0
    #: ``direct`` maps this piece's own file bytes: verify them, read nothing
    mapped: bool = False
    #: the XXH3-128 its raw bytes must have (``verify`` of a chunk recorded with one)
    digest: bytes | None = None

    def checks(self) -> list[tuple[int, int, int]]:
        """Byte ranges of the piece and the CRC-32C each must have."""
        if self.verify is not None:
            return self.verify
        return [(0, self.nbytes, self.checksum)]

    @property
    def staging_bytes(self) -> int:
        """Scratch memory needed to read this piece (0 when it lands in place)."""
        if self.codec is not None:  # stored bytes, and the decoded ones unless in place
            out = self.raw_nbytes if self.direct is None else 0
            unshuffle = self.raw_nbytes if self.shuffle else 0
            return self.nbytes + out + unshuffle
        return 0 if self.direct is not None else self.nbytes


def _coded(p: ReadPiece, c: ChunkEntry) -> ReadPiece:
    """``p`` reads compressed chunk ``c`` whole: its stored bytes, decoded after."""
    p.codec, p.shuffle = c.codec, c.shuffle
    p.raw_nbytes = p.nbytes
    p.offset, p.nbytes = c.offset, c.nbytes
    return p


@dataclasses.dataclass(slots=True)
class ReadRequest:
    """Consecutive pieces of one file read by a single vectored read."""

    file: int
    offset: int
    nbytes: int
    pieces: list[ReadPiece]


def _intersect(
    a0: tuple[int, ...], ash: tuple[int, ...], b0: tuple[int, ...], bsh: tuple[int, ...]
) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    lo = tuple(max(x, y) for x, y in zip(a0, b0))
    hi = tuple(min(x + n, y + m) for x, n, y, m in zip(a0, ash, b0, bsh))
    if any(h <= low for low, h in zip(lo, hi)):
        return None
    return lo, tuple(h - low for low, h in zip(lo, hi))


def _block_checks(c: ChunkEntry, first_row: int, nbytes: int) -> list[tuple[int, int, int]]:
    """(start, end, crc) of the checksum blocks of chunk ``c`` covered by a read of
    ``nbytes`` starting at row ``first_row`` (a block boundary). A read of the whole
    chunk checks its checksum over its bytes too where that is not the CRC-32C of its
    block checksums (statestream's): another writer's, as docs/format.md allows (until
    2026-12-08 that checksum was checked nowhere, so it could match nothing)."""
    step = c.block_rows * (c.nbytes // c.shape[0])
    b0 = first_row // c.block_rows
    out = [(a, min(a + step, nbytes), c.block_checksums[b0 + k])
           for k, a in enumerate(range(0, nbytes, step))]
    if not first_row and nbytes == c.nbytes and c.checksum != checksum_of_blocks(
            c.block_checksums):
        out.append((0, nbytes, c.checksum))
    return out


def _row_blocks(entry: ArrayEntry) -> bool:
    """True if every chunk spans the full extent of all axes but the first."""
    chunks = entry.chunks
    if len(chunks) == 1 and chunks[0].shape == entry.shape:  # most arrays: one chunk
        return not any(chunks[0].start)
    inner = entry.shape[1:]
    return all(c.shape[1:] == inner and not any(c.start[1:]) for c in entry.chunks)


def _plan_whole_array(w: Wanted, entry: ArrayEntry, dt: np.dtype,
                      pieces: dict[tuple[int, ...], ReadPiece]) -> None:
    """Pieces reading every row-block chunk straight into ``w.dest`` (the whole array)."""
    flat = w.dest.reshape(-1).view(np.uint8)
    chunks = entry.chunks
    if (len(chunks) == 1 and chunks[0].nbytes == flat.nbytes > 0 and not chunks[0].block_rows
            and chunks[0].codec is None):
        c = chunks[0]  # most arrays: one chunk, read whole into the whole destination
        pieces[(w.array, 0, 0, c.shape[0] if c.shape else 1)] = ReadPiece(
            w.array, 0, c.file, c.offset, c.nbytes, c.checksum, c.shape, dt, direct=flat,
            mapped=w.mapped)
        return
    row_bytes = math.prod(entry.shape[1:]) * dt.itemsize
    for ci, c in enumerate(chunks):
        if c.nbytes == 0:
            continue
        a = c.start[0] * row_bytes if c.start else 0
        raw = math.prod(c.shape) * dt.itemsize
        piece = ReadPiece(
            w.array, ci, c.file, c.offset, raw, c.checksum, c.shape, dt,
            direct=flat[a : a + raw], mapped=w.mapped and c.codec is None and c.ref is None,
        )
        if c.codec is not None:
            _coded(piece, c)
        elif c.block_rows:
            piece.verify = _block_checks(c, 0, c.nbytes)
        pieces[(w.array, ci, 0, c.shape[0] if c.shape else 1)] = piece


def _plan_chunk_boxes(w: Wanted, entry: ArrayEntry, dt: np.dtype, dshape: tuple[int, ...],
                      pieces: dict[tuple[int, ...], ReadPiece], checksums: bool = True) -> None:
    """Pieces for the part of each chunk that overlaps the box ``w`` wants
    (``checksums=False``: the chunks have none, a foreign format's, so a raw chunk's
    piece is just the rows the box needs).

    A piece already planned for the same rows of a chunk is shared (and
    scatters to this destination too).
    """
    for ci, c in enumerate(entry.chunks):
        if c.nbytes == 0:
            continue
        box = _intersect(c.start, c.shape, w.start, dshape)
        if box is None:
            continue
        lo, sh = box
        # Which rows of the chunk to read: all of them, or (when the chunk has
        # block checksums) just the blocks covering the rows this box needs, or
        # (no checksum to check) just those rows: a conversion's slabs of a 512 MiB
        # Orbax chunk read it whole once per 32 MiB slab
        r0, r1 = 0, (c.shape[0] if c.shape else 1)
        if not checksums and c.codec is None and c.shape:
            r0 = lo[0] - c.start[0]
            r1 = r0 + sh[0]
        elif c.block_rows and c.shape:
            need0 = lo[0] - c.start[0]
            need1 = need0 + sh[0]
            r0 = (need0 // c.block_rows) * c.block_rows
            r1 = min(c.shape[0], -(-need1 // c.block_rows) * c.block_rows)
        pstart = ((c.start[0] + r0,) + tuple(c.start[1:])) if c.shape else ()
        pshape = ((r1 - r0,) + tuple(c.shape[1:])) if c.shape else ()
        row_bytes = math.prod(c.shape[1:]) * dt.itemsize if c.shape else 0
        dsl = tuple(slice(x - s, x - s + n) for x, s, n in zip(lo, w.start, sh))
        psl = tuple(slice(x - s, x - s + n) for x, s, n in zip(lo, pstart, sh))
        dview = w.dest[dsl] if dsl else w.dest
        key = (w.array, ci, r0, r1)
        found = pieces.get(key)
        if found is not None:
            piece = found
        else:
            piece = ReadPiece(w.array, ci, c.file, c.offset + r0 * row_bytes,
                              (r1 - r0) * row_bytes if c.shape else dt.itemsize,
                              c.checksum, pshape, dt)
            if c.codec is not None:  # no blocks: r0, r1 span the chunk
                _coded(piece, c)
            elif c.block_rows:
                piece.verify = _block_checks(c, r0, piece.nbytes)
            pieces[key] = piece
        whole = sh == pshape
        if whole and piece.direct is None and dview.flags.c_contiguous:
            piece.direct = dview.reshape(-1).view(np.uint8)
        else:
            piece.scatter.append((dview, psl))


class LoadPlan:
    """The pieces that fill a load's destinations, planned as the walk finds them.

    :meth:`whole` is the common case in one step (a fresh or in-place buffer that
    one raw chunk fills verbatim); :meth:`add` plans any wanted box; :meth:`requests`
    sorts and coalesces. A chunk wanted by several destinations (tied leaves loaded
    into separate targets) is read once and scattered to the others.
    """

    __slots__ = ("arrays", "checksums", "pieces", "touched")

    def __init__(self, arrays: Sequence[ArrayEntry], *, checksums: bool = True) -> None:
        self.arrays = arrays
        #: False: the chunks carry no checksums (a foreign format's): a part of a chunk
        #: is planned as just the rows it needs
        self.checksums = checksums
        self.pieces: dict[tuple[int, ...], ReadPiece] = {}
        #: arrays with a piece already (a second destination of one scatters)
        self.touched: set[int] = set()

    def whole(self, array: int, c: ChunkEntry, dt: np.dtype, flat: np.ndarray,
              mapped: bool = False) -> ReadPiece:
        """Read chunk ``c`` -- raw, the whole of ``array``, no block checksums --
        straight into ``flat`` (1-D uint8, exactly its bytes); ``array`` is untouched.
        ``mapped``: ``flat`` maps the chunk's own file bytes; verify them, read nothing.
        Returns the piece planned."""
        self.touched.add(array)
        piece = self.pieces[(array, 0, 0, c.shape[0] if c.shape else 1)] = ReadPiece(
            array, 0, c.file, c.offset, c.nbytes, c.checksum, c.shape, dt, direct=flat,
            mapped=mapped)
        return piece

    def add(self, w: Wanted) -> None:
        """Plan the pieces that fill the box ``w`` wants."""
        first = w.array not in self.touched
        self.touched.add(w.array)
        entry = self.arrays[w.array]
        dt = dtype_from_name(entry.dtype)
        dshape = tuple(w.dest.shape)
        if (
            dshape == entry.shape
            and not any(w.start)
            and w.dest.flags.c_contiguous
            and first
            and _row_blocks(entry)
        ):
            # Fast path (the common single-process case): the destination is the
            # whole array and every chunk is a row block, i.e. a byte range of it.
            _plan_whole_array(w, entry, dt, self.pieces)
            return
        _plan_chunk_boxes(w, entry, dt, dshape, self.pieces, self.checksums)

    def requests(self, *, max_request_bytes: int = 32 << 20, max_gap_bytes: int = 64 << 10,
                 max_pieces_per_request: int = 512) -> list[ReadRequest]:
        """Every piece planned so far, as sorted, coalesced read requests."""
        return coalesce(self.pieces.values(), max_request_bytes=max_request_bytes,
                        max_gap_bytes=max_gap_bytes,
                        max_pieces_per_request=max_pieces_per_request)


def plan_load(
    arrays: Sequence[ArrayEntry],
    wanted: Sequence[Wanted],
    *,
    max_request_bytes: int = 32 << 20,
    max_gap_bytes: int = 64 << 10,
    max_pieces_per_request: int = 512,
    checksums: bool = True,
) -> list[ReadRequest]:
    """Plan reads that fill every wanted box, sorted by file and offset, coalesced
    (``checksums=False``: see :class:`LoadPlan`).

    Chunks that land contiguously in a destination are read straight into
    it; others are read into scratch and copied. Nearby pieces of a file
    merge into one request (gaps up to ``max_gap_bytes`` are read and dropped).
    """
    plan = LoadPlan(arrays, checksums=checksums)
    for w in wanted:
        plan.add(w)
    return plan.requests(max_request_bytes=max_request_bytes, max_gap_bytes=max_gap_bytes,
                         max_pieces_per_request=max_pieces_per_request)


def plan_verify(arrays: Sequence[ArrayEntry], *, max_request_bytes: int = 32 << 20
                ) -> list[ReadRequest]:
    """Read every chunk of every array (into scratch) so its checksum can be checked
    (and its hash, where it records one)."""
    pieces = []
    for ai, a in enumerate(arrays):
        for ci, c in enumerate(a.chunks):
            if not c.nbytes:
                continue
            dt = dtype_from_name(a.dtype)
            p = ReadPiece(ai, ci, c.file, c.offset, math.prod(c.shape) * dt.itemsize,
                          c.checksum, c.shape, dt, digest=c.digest)
            if c.codec is not None:
                _coded(p, c)
            elif c.block_rows:
                p.verify = _block_checks(c, 0, c.nbytes)
            pieces.append(p)
    return coalesce(pieces, max_request_bytes=max_request_bytes)


def coalesce(
    pieces: Iterable[ReadPiece],
    *,
    max_request_bytes: int = 32 << 20,
    max_gap_bytes: int = 64 << 10,
    max_pieces_per_request: int = 512,
) -> list[ReadRequest]:
    """Sort pieces by (file, offset) and merge neighbours into large requests."""
    ordered = sorted(pieces, key=lambda p: (p.file, p.offset, p.array, p.chunk))
    requests: list[ReadRequest] = []
    cur: ReadRequest | None = None
    for p in ordered:
        if cur is not None:
            end = cur.offset + cur.nbytes
            gap = p.offset - end
            if (
                p.file == cur.file
                and p.mapped == cur.pieces[0].mapped
                and 0 <= gap <= max_gap_bytes
                and cur.nbytes + gap + p.nbytes <= max_request_bytes
                and len(cur.pieces) < max_pieces_per_request
            ):
                cur.pieces.append(p)
                cur.nbytes += gap + p.nbytes
                continue
        cur = ReadRequest(p.file, p.offset, p.nbytes, [p])
        requests.append(cur)
    return requests
