"""Manifest decoding, part 3: array entries and their chunks.

Every check of one array entry and its chunk list that needs no parser state: a chunk's
fields and extension (:func:`_add_chunk`, :func:`_chunk_ext`), an array's coverage,
bounds and sizes (:func:`_decode_array`, with a plain-Python path for a few chunks and a
columnar one for many), the fast path for an array of one whole chunk
(:func:`_one_chunk`), and the file-range check across all chunks. The streaming parser
and the entry points are in ``_decode.py``; the columnar decoder of large manifests
(``_table.py``) shares these checks and messages.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from typing import Any

import numpy as np

from statestream.format._chunks import (
    CODECS,
    FLAG_CODEC,
    FLAG_REF,
    ChunkEntry,
    ChunkExt,
    ChunkList,
    ChunkStore,
)
from statestream.format._decode_tree import _Bad, _int, _list, _str
from statestream.format._dtypes import DTYPE_NAMES, itemsize_of
from statestream.format._manifest import (
    MAX_ARRAY_BYTES,
    MAX_CODEC_RATIO,
    MAX_DIM,
    MAX_FILE_BYTES,
    MAX_NDIM,
    ArrayEntry,
    FileEntry,
)
from statestream.format._tiles import _check_file_ranges, _tiles_exactly


class _Packed:
    """Where the chunks of one array entry went in the ChunkStore while parsing."""

    __slots__ = ("c0", "hi", "lo", "nd")

    def __init__(self, lo: int, hi: int, c0: int, nd: int) -> None:
        self.lo, self.hi, self.c0, self.nd = lo, hi, c0, nd


def _pack_chunks(chunks: list[Any], store: ChunkStore, ai: int) -> _Packed:
    """:func:`_stream_chunks` for a chunk list the C parser already read (small manifests)."""
    lo, c0, nd = len(store), len(store.coords), -1
    for j, c in enumerate(chunks):
        nd = _add_chunk(c, store, ai, j, nd, lo)
    return _Packed(lo, lo + len(chunks), c0, nd)


def _add_chunk(c: Any, store: ChunkStore, ai: int, j: int, nd: int, lo: int) -> int:
    """Check chunk ``j`` of array ``ai`` and append it to ``store``; returns its ndim."""
    if type(c) is not list or len(c) not in (6, 7, 8):
        raise _Bad(f"array {ai} chunk {j} must be a list of 6, 7 or 8 fields")
    f, off, nb, crc, start_l, shape_l = c[:6]
    if type(f) is not int or not 0 <= f <= 1 << 62:
        raise _Bad(f"array {ai} chunk {j} refers to file {f!r:.40}")
    if type(off) is not int or not 0 <= off <= MAX_FILE_BYTES:
        raise _Bad(f"array {ai} chunk {j} has a bad offset {off!r:.40}")
    if type(nb) is not int or not 0 <= nb <= MAX_ARRAY_BYTES:
        raise _Bad(f"array {ai} chunk {j} has a bad length {nb!r:.40}")
    if type(crc) is not int or not 0 <= crc <= 0xFFFFFFFF:
        raise _Bad(f"array {ai} chunk {j} has a bad checksum {crc!r:.40}")
    if nd < 0 and type(start_l) is list:
        nd = len(start_l)
    if (type(start_l) is not list or type(shape_l) is not list or len(start_l) != nd
            or len(shape_l) != nd):
        raise _Bad(f"array {ai} chunk {j} must give start and shape with {nd} dimensions")
    for a in range(nd):
        x, n = start_l[a], shape_l[a]
        if type(x) is not int or type(n) is not int or not 0 <= x <= MAX_DIM \
                or not 0 <= n <= MAX_DIM:
            raise _Bad(f"array {ai} chunk {j} has a bad start/shape on axis {a}")
    flags = 0
    if len(c) == 8:
        flags, ext = _chunk_ext(c[7], store, ai, j)
        if c[6] is not None and flags & FLAG_CODEC:
            raise _Bad(f"array {ai} chunk {j} is compressed and has block checksums")
        store.ext[lo + j] = ext
    if len(c) >= 7 and c[6] is not None:
        blk = c[6]
        if (
            type(blk) is not list or len(blk) != 2 or type(blk[0]) is not int
            or blk[0] < 1 or nd == 0 or type(blk[1]) is not list
            or len(blk[1]) != -(-shape_l[0] // blk[0])
            or not all(type(x) is int and 0 <= x <= 0xFFFFFFFF for x in blk[1])
        ):
            raise _Bad(f"array {ai} chunk {j} has a malformed block checksum table")
        store.blocks[lo + j] = (blk[0], tuple(blk[1]))
    store.fields.extend((f, off, nb, crc))
    store.flags.append(flags)
    store.coords.extend(start_l)
    store.coords.extend(shape_l)
    return nd


_HASH_RE = re.compile(r"[0-9a-f]{32}")
_EXT_KEYS = frozenset(("codec", "shuffle", "hash", "ref"))
_CODEC_OBJ = {c: c for c in CODECS}


class _UnknownCodec(_Bad):
    """A chunk names a codec this statestream does not know (a FormatVersionError)."""


def _chunk_ext(e: Any, store: ChunkStore, ai: int, j: int) -> tuple[int, ChunkExt]:
    """A v2 chunk's extension object -> (flags, (codec, shuffle, digest, ref))."""
    if type(e) is not dict or not e or not _EXT_KEYS.issuperset(e):
        extra = sorted(set(e) - _EXT_KEYS)[:1] if type(e) is dict else []
        raise _Bad(f"array {ai} chunk {j} has a malformed extension" +
                   (f" (unknown field {extra[0]!r:.40})" if extra else
                    " (must be a non-empty object)"))
    flags, codec, digest, ref = 0, None, None, -1
    if "codec" in e:
        if type(e["codec"]) is not str:  # malformed, not a codec of a newer version
            raise _Bad(f"array {ai} chunk {j}: its codec {e['codec']!r:.40} is not a name")
        codec = _CODEC_OBJ.get(e["codec"])
        if codec is None:
            raise _UnknownCodec(f"array {ai} chunk {j} is encoded with codec "
                                f"{e['codec']!r:.40}; this statestream knows {list(CODECS)}")
        flags |= FLAG_CODEC
    if "shuffle" in e and (e["shuffle"] is not True or codec is None):
        raise _Bad(f"array {ai} chunk {j}: shuffle must be true, with a codec")
    if "hash" in e:
        h = e["hash"]
        if type(h) is not str or not _HASH_RE.fullmatch(h):
            raise _Bad(f"array {ai} chunk {j} has a bad hash {h!r:.40} (32 lowercase hex digits)")
        digest = bytes.fromhex(h)
    if "ref" in e:
        ref = e["ref"]
        if type(ref) is not int or not 0 <= ref < len(store.bases):
            raise _Bad(f"array {ai} chunk {j} refers to base {ref!r:.40}, not one of the "
                       f"{len(store.bases)} listed before the arrays")
        if digest is None:
            raise _Bad(f"array {ai} chunk {j} refers to a base checkpoint without a hash")
        flags |= FLAG_REF
    return flags, (codec, "shuffle" in e, digest, ref)


def _first(mask: np.ndarray) -> int:
    """Index of the first True of a 1-D mask, or -1."""
    idx = np.flatnonzero(mask)
    return int(idx[0]) if len(idx) else -1


def _decode_array(d: Any, i: int, files: list[FileEntry], store: ChunkStore,
                  file_sizes: np.ndarray, *, materialize: bool = False) -> ArrayEntry:
    """One array entry; ``materialize``: keep its few chunks as ChunkEntry objects
    (small manifests: read several times per load, cheaper than the store's views)."""
    if type(d) is not dict:
        raise _Bad(f"array {i} must be an object")
    dtype = _str(d.get("dtype"), f"array {i} dtype")
    if dtype not in DTYPE_NAMES:
        raise _Bad(f"array {i} has unknown dtype {dtype!r:.40}")
    dtype = _DTYPE_OBJ[dtype]  # one shared str per dtype name
    shape_l = _list(d.get("shape"), f"array {i} shape")
    if len(shape_l) > MAX_NDIM:
        raise _Bad(f"array {i} has {len(shape_l)} dimensions (limit {MAX_NDIM})")
    shape = tuple(_int(s, f"array {i} dimension", 0, MAX_DIM) for s in shape_l)
    shape = _intern(shape)
    itemsize = itemsize_of(dtype)
    total = math.prod(shape)
    if total * itemsize > MAX_ARRAY_BYTES:
        raise _Bad(f"array {i} is {total * itemsize} bytes (limit {MAX_ARRAY_BYTES})")
    packed = d.get("chunks")
    if type(packed) is not _Packed:
        raise _Bad(f"array {i} chunks must be a list")
    nd = len(shape)
    n = packed.hi - packed.lo
    if n and packed.nd != nd:
        raise _Bad(f"array {i} chunk 0 must give start and shape with {nd} dimensions")
    chunks = ChunkList(store, packed.lo, packed.hi, packed.c0, nd)
    if n == 0:
        if total:
            raise _Bad(f"array {i}'s chunks cover 0 of its {total} elements")
        return ArrayEntry(dtype, shape, chunks)
    if n <= 4:  # most arrays: plain Python beats a dozen tiny numpy calls
        few = tuple(chunks)
        _check_few_chunks(i, few, shape, itemsize, total, files)
        if materialize:
            return ArrayEntry(dtype, shape, few)
    else:
        fl, co = chunks.columns()
        _check_chunk_columns(i, fl, co, chunks.flags(), shape, itemsize, total, files,
                             file_sizes)
    return ArrayEntry(dtype, shape, chunks)


def _check_few_chunks(i: int, chunks: Sequence[ChunkEntry], shape: tuple[int, ...], itemsize: int,
                      total: int, files: list[FileEntry]) -> None:
    """:func:`_check_chunk_columns` for a handful of chunks, same checks, same messages."""
    covered = 0
    live: list[ChunkEntry] = []
    for j, c in enumerate(chunks):
        if c.ref is None and c.file >= len(files):
            raise _Bad(f"array {i} chunk {j} refers to file {c.file}, not one of {len(files)}")
        if any(x + n > m for x, n, m in zip(c.start, c.shape, shape)):
            raise _Bad(f"array {i} chunk {j} lies outside the array's shape {shape}")
        vol = math.prod(c.shape)
        if c.codec is not None and not (0 < c.nbytes < vol * itemsize
                                        and vol * itemsize <= c.nbytes * MAX_CODEC_RATIO):
            raise _Bad(_stored_size_msg(i, j, c.nbytes, vol * itemsize))
        if c.codec is None and c.nbytes != vol * itemsize:
            raise _Bad(f"array {i} chunk {j} is {c.nbytes} bytes but its shape {c.shape} x "
                       f"{itemsize} bytes per element needs {vol * itemsize}")
        f = files[c.file] if c.ref is None else None
        if f is not None and c.offset + c.nbytes > f.size:
            raise _Bad(f"array {i} chunk {j} spans bytes [{c.offset}, {c.offset + c.nbytes}) "
                       f"of {f.name}, which the manifest says has only {f.size} bytes")
        covered += vol
        if vol:
            live.append(c)
    if covered != total:
        raise _Bad(f"array {i}'s chunks cover {covered} of its {total} elements")
    for a in range(len(live)):
        for b in range(a + 1, len(live)):
            p, q = live[a], live[b]
            if all(x < y + m and y < x + n
                   for x, n, y, m in zip(p.start, p.shape, q.start, q.shape)):
                raise _Bad(f"array {i} has overlapping chunks")


_DTYPE_OBJ = {n: n for n in DTYPE_NAMES}
_SHAPES: dict[tuple[int, ...], tuple[int, ...]] = {}
#: the most shapes kept shared; then the table starts over (a process that decodes
#: many manifests, or one with millions of distinct shapes, must not grow forever)
_MAX_SHAPES = 1 << 16


def _intern(shape: tuple[int, ...]) -> tuple[int, ...]:
    """One shared tuple per distinct shape (a manifest repeats a few shapes many times)."""
    if len(_SHAPES) >= _MAX_SHAPES:
        _SHAPES.clear()
    return _SHAPES.setdefault(shape, shape)


def _stored_size_msg(i: int, j: int, nbytes: int, raw: int) -> str:
    if nbytes and raw > nbytes * MAX_CODEC_RATIO:
        return (f"array {i} chunk {j} claims {raw} raw bytes from {nbytes} compressed ones, "
                f"more than {MAX_CODEC_RATIO} times as many (no codec expands that far)")
    return (f"array {i} chunk {j} is compressed to {nbytes} bytes, which is not between 1 "
            f"and its raw size {raw} minus one (a chunk that does not shrink is stored raw)")


def _check_chunk_columns(i: int, fl: np.ndarray, co: np.ndarray, flags: np.ndarray,
                         shape: tuple[int, ...], itemsize: int, total: int,
                         files: list[FileEntry], file_sizes: np.ndarray) -> None:
    """Every check of an array's chunks that needs its shape and the file table
    (``flags``: FLAG_CODEC / FLAG_REF per chunk)."""
    nd = len(shape)
    coded, own = (flags & FLAG_CODEC) != 0, (flags & FLAG_REF) == 0
    j = _first(own & (fl[:, 0] >= len(files)))
    if j >= 0:
        raise _Bad(f"array {i} chunk {j} refers to file {int(fl[j, 0])}, not one of "
                   f"{len(files)}")
    starts, sizes = co[:, :nd], co[:, nd:]
    ends = starts + sizes
    shp = np.asarray(shape, dtype=np.int64)
    j = _first(np.any(ends > shp, axis=1)) if nd else -1
    if j >= 0:
        raise _Bad(f"array {i} chunk {j} lies outside the array's shape {shape}")
    vol = np.prod(sizes, axis=1, dtype=np.int64)  # each <= total <= 2^48: no overflow
    j = _first(~coded & (fl[:, 2] != vol * itemsize))
    if j >= 0:
        raise _Bad(
            f"array {i} chunk {j} is {int(fl[j, 2])} bytes but its shape "
            f"{tuple(int(x) for x in sizes[j])} x {itemsize} bytes per element needs "
            f"{int(vol[j]) * itemsize}")
    raw = vol * itemsize
    j = _first(coded & ((fl[:, 2] < 1) | (fl[:, 2] >= raw)
                        | ((raw + MAX_CODEC_RATIO - 1) // MAX_CODEC_RATIO > fl[:, 2])))
    if j >= 0:
        raise _Bad(_stored_size_msg(i, j, int(fl[j, 2]), int(vol[j]) * itemsize))
    past = fl[:, 1] + fl[:, 2] > (file_sizes[fl[:, 0]] if own.all() else
                                  np.concatenate([file_sizes, [0]])[np.where(own, fl[:, 0], -1)])
    j = _first(own & past)
    if j >= 0:
        f = files[int(fl[j, 0])]
        raise _Bad(
            f"array {i} chunk {j} spans bytes [{int(fl[j, 1])}, {int(fl[j, 1] + fl[j, 2])}) "
            f"of {f.name}, which the manifest says has only {f.size} bytes")
    covered = int(vol.sum()) if float(vol.sum(dtype=np.float64)) < 2.0**62 else -1
    if covered != total:
        raise _Bad(f"array {i}'s chunks cover {covered if covered >= 0 else 'far more than'} "
                   f"of its {total} elements")
    live = vol > 0
    if int(live.sum()) > 1:
        if nd == 0 or not _tiles_exactly(starts[live], ends[live], shape):
            raise _Bad(f"array {i} has overlapping chunks")


def _check_store_ranges(files: list[FileEntry], store: ChunkStore) -> None:
    """No two chunks share a byte of a file (see :func:`_check_file_ranges`)."""
    if len(store) < 2:
        return
    r = np.frombuffer(store.fields, dtype=np.int64).reshape(-1, 4)[:, :3]
    if store.ext:  # chunks that live in a base are checked against it when followed
        r = r[(np.frombuffer(store.flags, dtype=np.int8) & FLAG_REF) == 0]
    _check_file_ranges(files, r)


def _one_chunk(d: dict[str, Any], sizes: list[int]) -> ArrayEntry | None:
    """An array entry of one chunk covering the whole array, if it passes every check
    (those of :func:`_add_chunk` and :func:`_decode_array`); None to take the general path."""
    dtype, shape_l, chunks = d.get("dtype"), d.get("shape"), d.get("chunks")
    if (type(dtype) is not str or dtype not in _DTYPE_OBJ or type(shape_l) is not list
            or type(chunks) is not list or len(chunks) != 1 or len(shape_l) > MAX_NDIM):
        return None
    c = chunks[0]
    if type(c) is not list or len(c) != 6:
        return None
    f, off, nb, crc, start_l, cshape_l = c
    if (cshape_l != shape_l or type(start_l) is not list or len(start_l) != len(shape_l)
            or any(start_l) or type(f) is not int or type(off) is not int
            or type(nb) is not int or type(crc) is not int or not 0 <= f < len(sizes)
            or not 0 <= crc <= 0xFFFFFFFF or not 0 <= off or not 0 <= nb):
        return None
    for x, a, b in zip(shape_l, start_l, cshape_l):  # (True == 1 and 0.0 == 0: check types)
        if type(x) is not int or type(a) is not int or type(b) is not int or not 0 <= x <= MAX_DIM:
            return None
    shape = tuple(shape_l)
    shape = _intern(shape)
    dtype = _DTYPE_OBJ[dtype]
    total = math.prod(shape)
    if nb != total * itemsize_of(dtype) or nb > MAX_ARRAY_BYTES or off + nb > sizes[f]:
        return None  # (offset + nbytes <= a file size <= MAX_FILE_BYTES bounds the offset)
    if not total:  # empty arrays: the general path's rule for their chunks
        return None
    start = _ZEROS.setdefault(len(shape), (0,) * len(shape))
    return ArrayEntry(dtype, shape, (ChunkEntry(f, off, nb, crc, start, shape),))


_ZEROS: dict[int, tuple[int, ...]] = {}
