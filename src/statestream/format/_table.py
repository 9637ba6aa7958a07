"""Manifest decoding, part 3: the array table of format v3 (docs/format.md, "Format v3").

A v3 manifest writes its arrays as one object of integer columns instead of one
object per array. The C JSON parser reads each column as a list of ints; the checks
the list form makes entry by entry (:func:`_decode.decode_manifest`) are made here on
whole columns with NumPy, with the same messages naming the array and chunk; only the
objects a load uses are built one by one.
"""

from __future__ import annotations

import math
from array import array
from typing import Any

import numpy as np

from statestream.format._chunks import FLAG_CODEC, FLAG_REF, ChunkEntry, ChunkList, ChunkStore
from statestream.format._decode_arrays import (
    _DTYPE_OBJ,
    _ZEROS,
    _chunk_ext,
    _first,
    _intern,
    _stored_size_msg,
)
from statestream.format._decode_tree import _Bad, over_limit
from statestream.format._dtypes import DTYPE_NAMES, itemsize_of
from statestream.format._manifest import (
    MAX_ARRAY_BYTES,
    MAX_ARRAYS,
    MAX_CODEC_RATIO,
    MAX_DIM,
    MAX_FILE_BYTES,
    MAX_MANIFEST_BYTES,
    MAX_NDIM,
    ArrayEntry,
    FileEntry,
)
from statestream.format._tiles import _check_file_ranges, _tiles_exactly

__all__ = ["decode_table"]

_COLUMNS = ("dtypes", "dtype", "ndim", "shape", "nchunks", "chunks", "boxes")
_OPTIONAL = ("blocks", "ext")
_INT = frozenset((int,))
#: at most this many chunks per array: no more fit in a manifest (each takes at least
#: the 8 bytes ``0,0,0,0,`` of the chunks column). MAX_ARRAYS of them sum to 2^51, so the
#: int64 sum of the nchunks column is exact (with 2^40, 2^24 arrays wrapped it to 0).
_MAX_CHUNKS = MAX_MANIFEST_BYTES // 8


def _column(t: dict[str, Any], key: str, lo: int, hi: int, n: int | None = None) -> np.ndarray:
    """Column ``key`` as int64, every value in [lo, hi]. The parsed list is dropped from
    ``t`` (its Python ints cost five times the array)."""
    v = t.pop(key)
    if type(v) is not list:
        raise _Bad(f"array table column {key} must be a list")
    if n is not None and len(v) != n:
        raise _Bad(f"array table column {key} has {len(v)} values, not {n}")
    if not _INT.issuperset(map(type, v)):  # (bool is not int here: True == 1)
        bad = next(x for x in v if type(x) is not int)
        raise _Bad(f"array table column {key} holds {bad!r:.40}, not an integer")
    try:
        a = np.array(v, dtype=np.int64)
    except OverflowError:
        raise _Bad(f"array table column {key} holds an integer out of range") from None
    del v
    if len(a) and (int(a.min()) < lo or int(a.max()) > hi):
        j = _first((a < lo) | (a > hi))
        raise _Bad(f"array table column {key}[{j}] is {int(a[j])}, not in [{lo}, {hi}]")
    return a


def _starts(counts: np.ndarray) -> np.ndarray:
    """Where each segment of the given lengths starts in their concatenation."""
    out = np.zeros(len(counts), dtype=np.int64)
    np.cumsum(counts[:-1], out=out[1:])
    return out


def _products(values: np.ndarray, counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per segment: the product of its values (1 for an empty one), exact as int64 when
    the float64 product (also returned) is at most 2^53."""
    exact = np.ones(len(counts), dtype=np.int64)
    approx = np.ones(len(counts), dtype=np.float64)
    some = counts > 0
    if some.any():
        first = _starts(counts)[some]
        # (an int64 product that overflows on the way meets a zero later: still 0)
        exact[some] = np.multiply.reduceat(values, first)
        approx[some] = np.multiply.reduceat(values.astype(np.float64), first)
    return exact, approx


def _dtypes(t: dict[str, Any]) -> list[str]:
    names = t["dtypes"]
    if type(names) is not list:
        raise _Bad("array table column dtypes must be a list")
    for name in names:
        if type(name) is not str or name not in DTYPE_NAMES:
            raise _Bad(f"array table names unknown dtype {name!r:.40}")
    if len(set(names)) != len(names):
        raise _Bad("array table lists a dtype twice")
    return [_DTYPE_OBJ[x] for x in names]


class _Table:
    """The columns of one table, checked; indexes of arrays and chunks."""

    def __init__(self, t: Any, max_arrays: int = MAX_ARRAYS) -> None:
        if type(t) is not dict:
            raise _Bad("format v3 arrays must be a table (an object of columns)")
        missing = [k for k in _COLUMNS if k not in t]
        extra = sorted(set(t) - set(_COLUMNS) - set(_OPTIONAL))
        if missing or extra:
            raise _Bad(f"array table lacks column {missing[0]}" if missing else
                       f"array table has unknown column {extra[0]!r:.40}")
        self.t = t
        self.names = _dtypes(t)
        if type(t["dtype"]) is list and len(t["dtype"]) > MAX_ARRAYS:
            raise _Bad(f"{len(t['dtype'])} arrays (limit {MAX_ARRAYS})")
        if type(t["dtype"]) is list:
            over_limit(len(t["dtype"]), max_arrays)
        self.dtype = _column(t, "dtype", 0, len(self.names) - 1)
        n = self.n = len(self.dtype)
        self.ndim = _column(t, "ndim", 0, MAX_NDIM, n)
        self.nchunks = _column(t, "nchunks", 0, _MAX_CHUNKS, n)
        self.dims = _column(t, "shape", 0, MAX_DIM, int(self.ndim.sum()))
        nc = self.c = int(self.nchunks.sum())
        # (exact: see _MAX_CHUNKS) the chunks column must hold that many chunks before
        # anything is sized by the counts
        self.fields = _column(t, "chunks", 0, 1 << 62, 4 * nc).reshape(nc, 4)
        #: each chunk's array, each array's first chunk, each chunk's ndim
        self.owner = np.repeat(np.arange(n, dtype=np.int64), self.nchunks)
        self.first = _starts(self.nchunks)
        self.cnd = self.ndim[self.owner]
        self.boxes = _column(t, "boxes", 0, MAX_DIM, 2 * int(self.cnd.sum()))
        #: where each chunk's box and each array's dims start in their columns
        self.cstart = 2 * _starts(self.cnd)
        self.dstart = _starts(self.ndim)
        self.flags = np.zeros(nc, dtype=np.int8)
        self.whole = np.zeros(0, dtype=bool)

    def shape(self, i: int) -> tuple[int, ...]:
        p = int(self.dstart[i])
        return tuple(self.dims[p:p + int(self.ndim[i])].tolist())

    def box(self, g: int) -> list[int]:
        """Chunk ``g``'s start then shape."""
        p = int(self.cstart[g])
        return self.boxes[p:p + 2 * int(self.cnd[g])].tolist()  # type: ignore[no-any-return]

    def where(self, g: int) -> tuple[int, int]:
        """(array, chunk within it) of chunk ``g``."""
        i = int(self.owner[g])
        return i, g - int(self.first[i])

    def check_fields(self) -> None:
        for col, what, hi in ((1, "offset", MAX_FILE_BYTES), (2, "length", MAX_ARRAY_BYTES),
                              (3, "checksum", 0xFFFFFFFF)):
            g = _first(self.fields[:, col] > hi)
            if g >= 0:
                i, j = self.where(g)
                raise _Bad(f"array {i} chunk {j} has a bad {what} {int(self.fields[g, col])}")


def _sparse(t: dict[str, Any], key: str, width: int, nc: int) -> list[list[Any]]:
    """Optional column ``key``: ``[chunk, ...]`` rows, chunk numbers ascending."""
    rows = t.get(key, [])
    if type(rows) is not list:
        raise _Bad(f"array table column {key} must be a list")
    last = -1
    for r in rows:
        if type(r) is not list or len(r) != width or type(r[0]) is not int:
            raise _Bad(f"array table column {key} must hold [chunk, ...] rows of {width}")
        if not last < r[0] < nc:
            raise _Bad(f"array table column {key} names chunk {r[0]!r:.40} out of order "
                       f"or out of range")
        last = r[0]
    return rows  # type: ignore[no-any-return]


def _extensions(tb: _Table, store: ChunkStore) -> None:
    """The chunks' v2 fields (``ext``) and block checksum tables (``blocks``)."""
    for g, e in _sparse(tb.t, "ext", 2, tb.c):
        i, j = tb.where(g)
        flags, ext = _chunk_ext(e, store, i, j)
        tb.flags[g] = flags
        store.ext[g] = ext
    for g, rows, crcs in _sparse(tb.t, "blocks", 3, tb.c):
        i, j = tb.where(g)
        nd = int(tb.cnd[g])
        first_dim = tb.box(g)[nd] if nd else 0
        if tb.flags[g] & FLAG_CODEC:
            raise _Bad(f"array {i} chunk {j} is compressed and has block checksums")
        if (type(rows) is not int or rows < 1 or nd == 0 or type(crcs) is not list
                or len(crcs) != -(-first_dim // rows)
                or not all(type(x) is int and 0 <= x <= 0xFFFFFFFF for x in crcs)):
            raise _Bad(f"array {i} chunk {j} has a malformed block checksum table")
        store.blocks[g] = (rows, tuple(crcs))


def _check_chunks(tb: _Table, files: list[FileEntry], file_sizes: np.ndarray) -> None:
    """What :func:`_decode_arrays._check_chunk_columns` checks, for every array at once."""
    f, cnd = tb.fields, tb.cnd
    own = (tb.flags & FLAG_REF) == 0
    coded = (tb.flags & FLAG_CODEC) != 0
    g = _first(own & (f[:, 0] >= len(files)))
    if g >= 0:
        i, j = tb.where(g)
        raise _Bad(f"array {i} chunk {j} refers to file {int(f[g, 0])}, not one of {len(files)}")
    # coordinate k of chunk g: start at cstart[g] + k, size at cstart[g] + nd + k,
    # bounded by its array's dimension at dstart[owner] + k
    cstart = tb.cstart
    k = np.arange(int(cnd.sum()), dtype=np.int64) - np.repeat(_starts(cnd), cnd)
    spos = np.repeat(cstart, cnd) + k
    size = tb.boxes[spos + np.repeat(cnd, cnd)]
    dpos = np.repeat(tb.dstart[tb.owner], cnd) + k
    start, dim = tb.boxes[spos], tb.dims[dpos]
    tb.whole = np.ones(tb.c, dtype=bool)  # chunks that are their whole array
    tb.whole[np.repeat(np.arange(tb.c, dtype=np.int64), cnd)[(start != 0) | (size != dim)]] = False
    out = np.nonzero(start + size > dim)[0]
    del start, dim
    if len(out):
        g = int(np.searchsorted(np.cumsum(cnd), out[0], side="right"))
        i, j = tb.where(g)
        raise _Bad(f"array {i} chunk {j} lies outside the array's shape {tb.shape(i)}")
    vol, approx = _products(size, cnd)
    isz = np.array([itemsize_of(x) for x in tb.names], dtype=np.int64)[tb.dtype][tb.owner]
    # a chunk inside its array is no larger than it, but the array's own size is checked
    # later (_check_cover): a box beyond int64 would be named with a wrapped size here
    g = _first(approx * isz > MAX_ARRAY_BYTES)
    if g >= 0:
        i, j = tb.where(g)
        raise _Bad(f"array {i} chunk {j} of shape {tuple(tb.box(g)[int(cnd[g]):])} holds more "
                   f"than {MAX_ARRAY_BYTES} bytes")
    raw = vol * isz
    g = _first(~coded & (f[:, 2] != raw))
    if g >= 0:
        i, j = tb.where(g)
        raise _Bad(f"array {i} chunk {j} is {int(f[g, 2])} bytes but its shape "
                   f"{tuple(tb.box(g)[int(cnd[g]):])} x {int(isz[g])} bytes per "
                   f"element needs {int(raw[g])}")
    g = _first(coded & ((f[:, 2] < 1) | (f[:, 2] >= raw)
                        | ((raw + MAX_CODEC_RATIO - 1) // MAX_CODEC_RATIO > f[:, 2])))
    if g >= 0:
        i, j = tb.where(g)
        raise _Bad(_stored_size_msg(i, j, int(f[g, 2]), int(raw[g])))
    ends = f[:, 1] + f[:, 2]
    limit = np.concatenate([file_sizes, [0]])[np.where(own, f[:, 0], -1)]
    g = _first(own & (ends > limit))
    if g >= 0:
        i, j = tb.where(g)
        fe = files[int(f[g, 0])]
        raise _Bad(f"array {i} chunk {j} spans bytes [{int(f[g, 1])}, {int(ends[g])}) of "
                   f"{fe.name}, which the manifest says has only {fe.size} bytes")
    _check_cover(tb, vol, cnd, cstart)


def _check_cover(tb: _Table, vol: np.ndarray, cnd: np.ndarray, cstart: np.ndarray) -> None:
    """Each array's chunks cover it exactly once (its volume, no overlap)."""
    total, approx = _products(tb.dims, tb.ndim)
    isz = np.array([itemsize_of(x) for x in tb.names], dtype=np.int64)[tb.dtype]
    i = _first(approx * isz > MAX_ARRAY_BYTES)
    if i >= 0:
        raise _Bad(f"array {i} is {math.prod(tb.shape(i)) * int(isz[i])} bytes "
                   f"(limit {MAX_ARRAY_BYTES})")
    some = tb.nchunks > 0
    covered = np.zeros(tb.n, dtype=np.int64)
    if tb.c:  # (each volume <= 2^48 and at most 2^15 of them sum exactly; beyond, floats)
        covered[some] = np.add.reduceat(vol, tb.first[some])
        far = np.zeros(tb.n, dtype=bool)
        far[some] = np.add.reduceat(vol.astype(np.float64), tb.first[some]) >= 2.0**62
        covered[far] = -1
    i = _first(covered != total)
    if i >= 0:
        c = int(covered[i])
        raise _Bad(f"array {i}'s chunks cover {c if c >= 0 else 'far more than'} of its "
                   f"{int(total[i])} elements")
    live = np.zeros(tb.n, dtype=np.int64)
    if tb.c:
        live[some] = np.add.reduceat((vol > 0).astype(np.int64), tb.first[some])
    for i in np.nonzero(live > 1)[0].tolist():  # several chunks: no two may overlap
        lo, hi, nd = int(tb.first[i]), int(tb.first[i] + tb.nchunks[i]), int(tb.ndim[i])
        b = tb.boxes[int(cstart[lo]):int(cstart[lo]) + 2 * nd * (hi - lo)].reshape(hi - lo, 2 * nd)
        keep = vol[lo:hi] > 0
        starts, sizes = b[keep, :nd], b[keep, nd:]
        if nd == 0 or not _tiles_exactly(starts, starts + sizes, tb.shape(i)):
            raise _Bad(f"array {i} has overlapping chunks")


def _fill_store(tb: _Table, store: ChunkStore, listed: np.ndarray) -> None:
    """The chunks of the ``listed`` arrays (those read through a :class:`ChunkList`) as
    the store's columns, numbered among themselves; the others are kept as objects."""
    keep = np.repeat(listed, tb.nchunks)
    renumber = np.cumsum(keep) - 1
    store.ext = {int(renumber[g]): e for g, e in store.ext.items()}
    store.blocks = {int(renumber[g]): b for g, b in store.blocks.items()}
    nc = tb.nchunks[listed]
    spans = np.empty((len(nc), 4), dtype=np.int64)
    spans[:, 0] = _starts(nc)
    spans[:, 1] = spans[:, 0] + nc
    spans[:, 2] = _starts(2 * tb.ndim[listed] * nc)
    spans[:, 3] = tb.ndim[listed]
    store.spans = array("q", spans.tobytes())
    store.fields = array("q", tb.fields[keep].tobytes())
    store.coords = array("q", tb.boxes[np.repeat(keep, 2 * tb.cnd)].tobytes())
    store.flags = array("b", tb.flags[keep].tobytes())


def decode_table(t: Any, files: list[FileEntry], store: ChunkStore,
                 file_sizes: np.ndarray, max_arrays: int = MAX_ARRAYS) -> list[ArrayEntry]:
    """The array entries of a v3 manifest's table ``t`` (parsed JSON; its columns are
    taken out of it), checked as the list form's are.

    An array of one plain chunk (most) gets it as a :class:`ChunkEntry`, as small
    manifests do; the others read theirs from ``store`` (empty before), through a
    :class:`ChunkList`.
    """
    tb = _Table(t, max_arrays)
    tb.check_fields()
    _extensions(tb, store)
    _check_chunks(tb, files, file_sizes)
    own = (tb.flags & FLAG_REF) == 0
    _check_file_ranges(files, tb.fields[own, :3])
    plain = np.ones(tb.c, dtype=bool)
    if store.ext or store.blocks:
        plain[list(store.ext.keys() | store.blocks.keys())] = False
    one = tb.nchunks == 1
    one[one] = plain[tb.first[one]]
    _fill_store(tb, store, ~one)
    # what building the entries does not need goes before they are built (1M arrays:
    # ~60 MB of index columns)
    del tb.owner, tb.cnd, tb.flags
    return _entries(tb, one, store)


def _entries(tb: _Table, one: np.ndarray, store: ChunkStore) -> list[ArrayEntry]:
    names = tb.names
    dtype, ndim, nchunks, one_l = (tb.dtype.tolist(), tb.ndim.tolist(), tb.nchunks.tolist(),
                                   one.tolist())
    dims, fields, whole = tb.dims.tolist(), tb.fields.reshape(-1).tolist(), tb.whole.tolist()
    del tb.dims, tb.fields, tb.whole
    out: list[ArrayEntry] = []
    p = g = k = 0
    for i in range(tb.n):
        nd = ndim[i]
        shape = _intern(tuple(dims[p:p + nd]))
        p += nd
        if one_l[i]:
            if whole[g]:  # (most: shared tuples)
                start, cshape = _ZEROS.setdefault(nd, (0,) * nd), shape
            else:  # (an empty array's chunk)
                c0 = int(tb.cstart[g])
                box = tb.boxes[c0:c0 + 2 * nd].tolist()
                start, cshape = tuple(box[:nd]), tuple(box[nd:])
            q = 4 * g
            chunk = ChunkEntry(fields[q], fields[q + 1], fields[q + 2], fields[q + 3],
                               start, cshape)
            out.append(ArrayEntry(names[dtype[i]], shape, (chunk,)))
        else:
            out.append(ArrayEntry(names[dtype[i]], shape, ChunkList.of(store, k)))
            k += 1
        g += nchunks[i]
    return out
