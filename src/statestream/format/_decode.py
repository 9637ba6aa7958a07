"""Manifest decoding, part 2: the streaming parser, chunk checks and the entry points.

Split out of ``_manifest.py`` (schema and encoder stay there); tree checks are in
``_decode_tree.py``.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from json.scanner import make_scanner
from typing import Any

import numpy as np

from statestream.errors import (
    CheckpointCorruptError,
    FormatVersionError,
    UnsafeCheckpointError,
)
from statestream.format._checksum import CHECKSUM_ALGORITHM
from statestream.format._chunks import (
    CODECS,
    FLAG_CODEC,
    FLAG_REF,
    ChunkEntry,
    ChunkExt,
    ChunkList,
    ChunkStore,
)
from statestream.format._decode_tree import (
    _Bad,
    _check_tree,
    _int,
    _list,
    _str,
    _TreeHook,
    validate_base_name,
    validate_file_name,
)
from statestream.format._dtypes import DTYPE_NAMES, itemsize_of
from statestream.format._manifest import (
    FORMAT_NAME,
    FORMAT_VERSION,
    FORMAT_VERSIONS,
    MAX_ARRAY_BYTES,
    MAX_ARRAYS,
    MAX_CODEC_RATIO,
    MAX_COMMIT_BYTES,
    MAX_DIM,
    MAX_FILE_BYTES,
    MAX_FILES,
    MAX_MANIFEST_BYTES,
    MAX_NDIM,
    ArrayEntry,
    FileEntry,
    Manifest,
)
from statestream.format._tiles import _check_file_ranges, _tiles_exactly
from statestream.tree import Node


class _Packed:
    """Where the chunks of one array entry went in the ChunkStore while parsing."""

    __slots__ = ("c0", "hi", "lo", "nd")

    def __init__(self, lo: int, hi: int, c0: int, nd: int) -> None:
        self.lo, self.hi, self.c0, self.nd = lo, hi, c0, nd


_SCAN = make_scanner(json.JSONDecoder())  # type: ignore[arg-type]


def _ws(s: str, i: int) -> int:
    n = len(s)
    while i < n and s[i] in " \t\n\r":
        i += 1
    return i


def _tree_scanner(hook: _TreeHook) -> Any:
    return make_scanner(json.JSONDecoder(object_hook=hook))  # type: ignore[arg-type]


def _value(s: str, i: int, scan: Any = None) -> tuple[Any, int]:
    try:
        v, end = (scan or _SCAN)(s, i)
    except StopIteration:
        raise json.JSONDecodeError("Expecting value", s, i) from None
    return v, int(end)


def _expect(s: str, i: int, ch: str) -> int:
    if s[i:i + 1] != ch:
        raise json.JSONDecodeError(f"Expecting '{ch}'", s, i)
    return _ws(s, i + 1)


def _parse_document(s: str, store: ChunkStore, doc: dict[str, Any]) -> Any:
    """``json.loads`` of a manifest, except that the chunk lists of array entries
    stream into ``store`` one chunk at a time (see :func:`_stream_chunks`).

    The top-level object's fields go into ``doc`` as they are parsed (so that a
    caller sees the version of a manifest that fails to parse).
    """
    i = _ws(s, 0)
    if s[i:i + 1] != "{":
        v, i = _value(s, i)
        if _ws(s, i) != len(s):
            raise json.JSONDecodeError("Extra data", s, i)
        return v
    i = _ws(s, i + 1)
    if s[i:i + 1] != "}":
        while True:
            key, i = _value(s, i)
            if type(key) is not str:
                raise json.JSONDecodeError("Expecting property name", s, i)
            if key in doc:  # (which one counts is ambiguous, and arrays fill the store)
                raise _Bad(f"the manifest gives {key!r:.40} twice")
            i = _expect(s, _ws(s, i), ":")
            if key == "arrays":
                doc[key], i = _arrays(s, i, store, _eager_files(doc))
            elif key == "bases":
                doc[key], i = _value(s, i)
                store.bases = _decode_bases(doc[key])
            elif key == "tree":
                hook = _TreeHook()
                doc[key], i = _value(s, i, _tree_scanner(hook))
                if hook.compact:
                    doc[_COMPACT] = True  # type: ignore[index]
            else:
                doc[key], i = _value(s, i)
            i = _ws(s, i)
            if s[i:i + 1] == ",":
                i = _ws(s, i + 1)
                continue
            break
    i = _expect(s, i, "}")
    if i != len(s):
        raise json.JSONDecodeError("Extra data", s, i)
    return doc


#: set (as a key no JSON text can make) in a parsed manifest whose tree has compact
#: array leaves, a format v3 field
_COMPACT = object()


class _DecodedArrays(list):  # type: ignore[type-arg]
    """Array entries already decoded while parsing (the files came first)."""


def _eager_files(doc: dict[str, Any]) -> tuple[list[FileEntry], np.ndarray] | None:
    """The file table, if the manifest so far says it is v1 and lists its files, so that
    array entries can be decoded as they are parsed (their JSON never piles up)."""
    if (doc.get("format") != FORMAT_NAME or type(doc.get("version")) is not int
            or doc.get("version") not in FORMAT_VERSIONS
            or doc.get("checksum") != CHECKSUM_ALGORITHM or "files" not in doc):
        return None
    files = _decode_files(doc["files"])
    return files, np.array([f.size for f in files], dtype=np.int64)


def _decode_bases(bases_l: Any) -> list[str]:
    """The v2 ``bases`` list: sibling checkpoint names, each once (each referenced is
    checked once every chunk is known)."""
    bases_l = _list(bases_l, "bases")
    seen: set[str] = set()
    for b in bases_l:
        validate_base_name(b)
        if b in seen:
            raise _Bad(f"base checkpoint {b} is listed twice")
        seen.add(b)
    return list(bases_l)


def _decode_files(files_l: Any) -> list[FileEntry]:
    files_l = _list(files_l, "files")
    if len(files_l) > MAX_FILES:
        raise _Bad(f"{len(files_l)} data files (limit {MAX_FILES})")
    files: list[FileEntry] = []
    seen: set[str] = set()
    for fl in files_l:
        fl = _list(fl, "file entry")
        if len(fl) != 2:
            raise _Bad("file entry must be [name, size]")
        name = validate_file_name(fl[0])
        if name in seen:
            raise _Bad(f"data file {name} is listed twice")
        seen.add(name)
        files.append(FileEntry(name, _int(fl[1], "file size", 0, MAX_FILE_BYTES)))
    return files


#: Manifests up to this size have each array entry read by the C JSON parser at once
#: (their Python objects cost at most ~15 MiB); larger ones stream chunk by chunk, so
#: that decoding stays within 4x the manifest's size. Same checks, same messages.
_SMALL_MANIFEST_BYTES = 1 << 20


def _arrays(s: str, i: int, store: ChunkStore,
            eager: tuple[list[FileEntry], np.ndarray] | None) -> tuple[Any, int]:
    if s[i:i + 1] != "[":
        return _value(s, i)
    if len(s) <= _SMALL_MANIFEST_BYTES and eager is not None:
        entries, i = _value(s, i)  # one C parse of the whole list, then a tight loop
        if type(entries) is list and len(entries) > MAX_ARRAYS:
            raise _Bad(f"{len(entries)} arrays (limit {MAX_ARRAYS})")
        return _decode_small(entries, store, eager[0], eager[1]), i
    out: list[Any] = _DecodedArrays() if eager is not None else []
    i = _ws(s, i + 1)
    if s[i:i + 1] == "]":
        return out, i + 1
    sizes = [f.size for f in eager[0]] if eager is not None else []
    while True:
        if len(out) >= MAX_ARRAYS:
            raise _Bad(f"more than {MAX_ARRAYS} arrays (the limit)")
        peeked = _peek(s, i) if eager is not None and s[i:i + 1] == "{" else None
        if peeked is not None:  # a short entry: read by the C parser
            d, i = peeked
            entry = _one_chunk(d, sizes) if len(d) == 3 else None
            if entry is not None:  # (as compact as the store: its tuples are shared)
                c = entry.chunks[0]
                store.fields.extend((c.file, c.offset, c.nbytes, c.checksum))
                store.flags.append(0)  # (one flag per chunk: FLAG_CODEC / FLAG_REF)
                out.append(entry)
            else:
                if type(d.get("chunks")) is list:
                    d["chunks"] = _pack_chunks(d["chunks"], store, len(out))
                assert eager is not None
                out.append(_decode_array(d, len(out), eager[0], store, eager[1]))
        else:
            if s[i:i + 1] == "{":
                v, i = _array_object(s, i, store, len(out))
            else:
                v, i = _value(s, i)
            if eager is not None:
                v = _decode_array(v, len(out), eager[0], store, eager[1])
            out.append(v)
        i = _ws(s, i)
        if s[i:i + 1] == ",":
            i = _ws(s, i + 1)
            continue
        if s[i:i + 1] != "]":
            raise json.JSONDecodeError("Expecting ',' delimiter", s, i)
        return out, i + 1


def _decode_small(entries: list[Any], store: ChunkStore, files: list[FileEntry],
                  file_sizes: np.ndarray) -> _DecodedArrays:
    """The array entries of a small manifest, parsed by the C parser at once.

    The common entry (one chunk covering the whole array, no block table) is
    checked by :func:`_one_chunk` in a few comparisons; any other entry, and any
    entry that fails one of those checks, takes the general path, which makes
    the same checks and raises the precise error.
    """
    out = _DecodedArrays()
    sizes = [f.size for f in files]
    fields, flags = store.fields, store.flags
    for ai, d in enumerate(entries):
        entry = _one_chunk(d, sizes) if type(d) is dict and len(d) == 3 else None
        if entry is not None:
            c = entry.chunks[0]
            fields.extend((c.file, c.offset, c.nbytes, c.checksum))
            flags.append(0)  # (one flag per chunk: FLAG_CODEC / FLAG_REF)
            out.append(entry)
            continue
        if type(d) is dict and type(d.get("chunks")) is list:
            d["chunks"] = _pack_chunks(d["chunks"], store, ai)
        out.append(_decode_array(d, ai, files, store, file_sizes, materialize=True))
    return out


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


#: Large manifests: an array entry whose text fits in this many characters is read by
#: the C parser at once (its objects are a few KiB); longer ones stream chunk by chunk.
_PEEK_CHARS = 2048


def _peek(s: str, i: int) -> tuple[dict[str, Any], int] | None:
    """The object at ``s[i]`` if it ends within :data:`_PEEK_CHARS`, else None.

    JSON objects parse the same from any prefix that holds them whole, so a
    cut one fails here and is then streamed.
    """
    try:
        v, end = _SCAN(s[i:i + _PEEK_CHARS], 0)
    except (StopIteration, ValueError):
        return None
    if type(v) is not dict:
        return None
    return v, i + int(end)


def _array_object(s: str, i: int, store: ChunkStore, ai: int) -> tuple[Any, int]:
    d: dict[str, Any] = {}
    i = _ws(s, i + 1)
    if s[i:i + 1] != "}":
        while True:
            key, i = _value(s, i)
            if type(key) is not str:
                raise json.JSONDecodeError("Expecting property name", s, i)
            i = _expect(s, _ws(s, i), ":")
            if key == "chunks" and s[i:i + 1] == "[":
                d[key], i = _stream_chunks(s, i, store, ai)
            else:
                d[key], i = _value(s, i)
            i = _ws(s, i)
            if s[i:i + 1] == ",":
                i = _ws(s, i + 1)
                continue
            break
    if s[i:i + 1] != "}":
        raise json.JSONDecodeError("Expecting '}'", s, i)
    return d, i + 1


def _stream_chunks(s: str, i: int, store: ChunkStore, ai: int) -> tuple[_Packed, int]:
    """Parse a chunk list chunk by chunk into ``store``; check what needs no context."""
    lo, c0, nd = len(store), len(store.coords), -1
    i = _ws(s, i + 1)
    j = 0
    while s[i:i + 1] != "]":
        c, i = _value(s, i)
        nd = _add_chunk(c, store, ai, j, nd, lo)
        j += 1
        i = _ws(s, i)
        if s[i:i + 1] == ",":
            i = _ws(s, i + 1)
            if s[i:i + 1] == "]":
                raise json.JSONDecodeError("Expecting value", s, i)
        elif s[i:i + 1] != "]":
            raise json.JSONDecodeError("Expecting ',' delimiter", s, i)
    return _Packed(lo, lo + j, c0, nd), i + 1


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
        codec = _CODEC_OBJ.get(e["codec"]) if type(e["codec"]) is str else None
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


def _bad_manifest(exc: _Bad, where: str) -> CheckpointCorruptError | FormatVersionError:
    if isinstance(exc, _UnknownCodec):
        return FormatVersionError(f"checkpoint manifest {where}: {exc}; upgrade statestream")
    return CheckpointCorruptError(f"manifest {where} is malformed: {exc}")


def _check_version(doc: Any, where: str) -> int:
    """The manifest's format version (1 or 2), or raise."""
    if type(doc) is not dict or doc.get("format") != FORMAT_NAME:
        raise CheckpointCorruptError(f"{where} is not a statestream manifest")
    version = doc.get("version")
    if type(version) is not int:
        raise CheckpointCorruptError(f"manifest {where} has no integer format version")
    if version not in FORMAT_VERSIONS:
        raise FormatVersionError(
            f"checkpoint manifest {where} uses format version {version}, but this statestream "
            f"reads versions {', '.join(map(str, FORMAT_VERSIONS))}; "
            + ("upgrade statestream" if version > FORMAT_VERSION else "it is not supported")
        )
    if doc.get("checksum") != CHECKSUM_ALGORITHM:
        raise CheckpointCorruptError(
            f"manifest {where} uses checksum {doc.get('checksum')!r:.40}; only "
            f"{CHECKSUM_ALGORITHM} is defined for format v{version}"
        )
    return version


def _check_v2_fields(doc: dict[str, Any], store: ChunkStore, version: int) -> None:
    """A v1 manifest has no v2 field, nor a v2 one a v3 field; a later one's bases are
    each referenced."""
    if version < 3 and _COMPACT in doc:
        raise _Bad(f"a format v{version} manifest has a format v3 field (compact array "
                   "leaves)")
    if version == 1:
        if "bases" in doc or store.ext:
            raise _Bad("a format v1 manifest has a format v2 field ("
                       + ("bases" if "bases" in doc else "a chunk extension") + ")")
        return
    used = {e[3] for e in store.ext.values()}
    missing = [b for k, b in enumerate(store.bases) if k not in used]
    if missing:
        raise _Bad(f"base checkpoint {missing[0]} is listed but no chunk refers to it")


def decode_manifest(data: bytes | str, where: str) -> Manifest:
    """Parse and fully validate manifest bytes read from ``where`` (format v1, v2 or v3).

    Raises:
        FormatVersionError: the manifest is from an unknown format version, or a
            chunk uses a codec this statestream does not know.
        UnsafeCheckpointError: a file name escapes the checkpoint, or a base is
            not a sibling's name.
        CheckpointCorruptError: anything else is malformed or out of limits.
    """
    if len(data) > MAX_MANIFEST_BYTES:
        raise CheckpointCorruptError(
            f"manifest {where} is {len(data)} bytes, over the {MAX_MANIFEST_BYTES}-byte limit"
        )
    store = ChunkStore()
    head: dict[str, Any] = {}
    try:
        text = data if isinstance(data, str) else data.decode("utf-8")
        doc = _parse_document(text, store, head)
    except UnsafeCheckpointError:
        if type(head.get("version")) is int and head.get("format") == FORMAT_NAME:
            _check_version(head, where)  # a future version's fields are not "unsafe"
        raise
    except (ValueError, RecursionError) as exc:
        raise CheckpointCorruptError(f"manifest {where} is not valid JSON: {exc}") from exc
    except _Bad as exc:
        if type(head.get("version")) is int and head.get("format") == FORMAT_NAME:
            _check_version(head, where)
        raise _bad_manifest(exc, where) from None
    del text
    version = _check_version(doc, where)
    try:
        if version < 3:
            _check_v2_fields(doc, store, version)
        files = _decode_files(doc.get("files"))
        arrays_l = doc.get("arrays")
        if version == 3:  # the table (its chunks checked as a whole)
            if type(arrays_l) is _DecodedArrays:
                raise _Bad("format v3 arrays must be a table (an object of columns)")
            arrays: list[ArrayEntry] = decode_table(
                arrays_l, files, store, np.array([f.size for f in files], dtype=np.int64))
            _check_v2_fields(doc, store, version)
        elif type(arrays_l) is _DecodedArrays:
            arrays = list(arrays_l)
        else:
            arrays_l = _list(arrays_l, "arrays")
            if len(arrays_l) > MAX_ARRAYS:
                raise _Bad(f"{len(arrays_l)} arrays (limit {MAX_ARRAYS})")
            sizes = np.array([f.size for f in files], dtype=np.int64)
            arrays = [_decode_array(a, i, files, store, sizes) for i, a in enumerate(arrays_l)]
        del arrays_l, doc["arrays"]
        _check_store_ranges(files, store)
        tree = _check_tree(doc.get("tree"), len(arrays))
        meta = doc.get("meta", {})
        if type(meta) is not dict:
            raise _Bad("meta must be an object")
    except _Bad as exc:
        raise _bad_manifest(exc, where) from None
    except RecursionError:
        raise CheckpointCorruptError(f"manifest {where} is nested too deeply") from None
    _check_leaf_arrays(tree, arrays, where)
    return Manifest(tree=tree, arrays=arrays, files=files, meta=meta, version=version,
                    bases=list(store.bases))


def _check_leaf_arrays(tree: Node, arrays: list[ArrayEntry], where: str) -> None:
    stack = [tree]
    plain: set[int] = set()
    aliases: set[int] = set()
    while stack:
        n = stack.pop()
        if n.children:
            stack.extend(n.children)
        if n.kind == "alias" and n.array is not None:
            aliases.add(n.array)
        elif n.kind == "array" and n.array is not None:
            plain.add(n.array)
        if n.kind in ("bytes", "pickle") and n.array is not None:
            a = arrays[n.array]
            if a.dtype != "uint8" or len(a.shape) != 1:
                raise CheckpointCorruptError(
                    f"manifest {where} is malformed: {n.kind} leaf must be a 1-D uint8 blob"
                )
    if not aliases <= plain:
        raise CheckpointCorruptError(
            f"manifest {where} is malformed: an alias refers to array "
            f"{min(aliases - plain)}, which no array leaf holds"
        )


def decode_commit(data: bytes, where: str) -> tuple[int, int]:
    """Parse a commit marker; return (manifest size, manifest CRC-32C)."""
    if len(data) > MAX_COMMIT_BYTES:
        raise CheckpointCorruptError(
            f"commit marker {where} is larger than {MAX_COMMIT_BYTES} bytes"
        )
    try:
        doc = json.loads(data)
    except (ValueError, RecursionError) as exc:
        raise CheckpointCorruptError(f"commit marker {where} is not valid JSON: {exc}") from exc
    if type(doc) is not dict or doc.get("format") != FORMAT_NAME:
        raise CheckpointCorruptError(f"{where} is not a statestream commit marker")
    version = doc.get("version")
    if type(version) is int and version not in FORMAT_VERSIONS:
        raise FormatVersionError(
            f"checkpoint {where} uses format version {version}; this statestream reads "
            f"versions {', '.join(map(str, FORMAT_VERSIONS))}"
        )
    try:
        size = _int(doc.get("manifest_bytes"), "manifest_bytes", 0, MAX_MANIFEST_BYTES)
        crc = _int(doc.get("manifest_crc32c"), "manifest_crc32c", 0, 0xFFFFFFFF)
    except _Bad as exc:
        raise CheckpointCorruptError(f"commit marker {where} is malformed: {exc}") from None
    return size, crc


# The v3 array table's decoder uses the checks above; imported last (it imports them).
from statestream.format._table import decode_table  # noqa: E402
