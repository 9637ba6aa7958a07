"""Manifest decoding, part 2: the streaming parser and the entry points.

Split out of ``_manifest.py`` (schema and encoder stay there); tree checks are in
``_decode_tree.py``, array entries and their chunks in ``_decode_arrays.py``.
"""

from __future__ import annotations

import json
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
    ChunkStore,
)
from statestream.format._decode_arrays import (
    _add_chunk,
    _check_store_ranges,
    _decode_array,
    _one_chunk,
    _pack_chunks,
    _Packed,
    _UnknownCodec,
)
from statestream.format._decode_tree import (
    OverLimit,
    _Bad,
    _check_leaf_arrays,
    _check_tree,
    _int,
    _list,
    _TreeHook,
    over_limit,
    validate_base_name,
    validate_file_name,
)
from statestream.format._manifest import (
    FORMAT_NAME,
    FORMAT_VERSION,
    FORMAT_VERSIONS,
    MAX_ARRAYS,
    MAX_COMMIT_BYTES,
    MAX_FILE_BYTES,
    MAX_FILES,
    MAX_MANIFEST_BYTES,
    ArrayEntry,
    FileEntry,
    Manifest,
)

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


def _parse_document(s: str, store: ChunkStore, doc: dict[str, Any],
                    max_arrays: int = MAX_ARRAYS) -> Any:
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
                doc[key], i = _arrays(s, i, store, _eager_files(doc), max_arrays)
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
            eager: tuple[list[FileEntry], np.ndarray] | None,
            max_arrays: int = MAX_ARRAYS) -> tuple[Any, int]:
    if s[i:i + 1] != "[":  # a v3 table: its arrays counted before the tree is parsed
        table, i = _value(s, i)
        if type(table) is dict and type(table.get("dtype")) is list:
            over_limit(len(table["dtype"]), max_arrays)
        return table, i
    if len(s) <= _SMALL_MANIFEST_BYTES and eager is not None:
        entries, i = _value(s, i)  # one C parse of the whole list, then a tight loop
        if type(entries) is list and len(entries) > MAX_ARRAYS:
            raise _Bad(f"{len(entries)} arrays (limit {MAX_ARRAYS})")
        if type(entries) is list:
            over_limit(len(entries), max_arrays)
        return _decode_small(entries, store, eager[0], eager[1]), i
    out: list[Any] = _DecodedArrays() if eager is not None else []
    i = _ws(s, i + 1)
    if s[i:i + 1] == "]":
        return out, i + 1
    sizes = [f.size for f in eager[0]] if eager is not None else []
    while True:
        if len(out) >= MAX_ARRAYS:
            raise _Bad(f"more than {MAX_ARRAYS} arrays (the limit)")
        over_limit(len(out) + 1, max_arrays, exact=False)
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


def decode_manifest(data: bytes | str, where: str, max_arrays: int = MAX_ARRAYS) -> Manifest:
    """Parse and fully validate manifest bytes read from ``where`` (format v1, v2 or v3).

    ``max_arrays``: a caller's bound on the arrays the manifest may hold (a load's
    option), at most the format's :data:`MAX_ARRAYS`; checked as the arrays are
    parsed, before their entries are built.

    Raises:
        FormatVersionError: the manifest is from an unknown format version, or a
            chunk uses a codec this statestream does not know.
        UnsafeCheckpointError: a file name escapes the checkpoint, or a base is
            not a sibling's name.
        CheckpointCorruptError: anything else is malformed or out of limits.
        CheckpointError: more arrays than ``max_arrays`` (within the format's limit).
    """
    if len(data) > MAX_MANIFEST_BYTES:
        raise CheckpointCorruptError(
            f"manifest {where} is {len(data)} bytes, over the {MAX_MANIFEST_BYTES}-byte limit"
        )
    store = ChunkStore()
    head: dict[str, Any] = {}
    try:
        text = data if isinstance(data, str) else data.decode("utf-8")
        doc = _parse_document(text, store, head, max_arrays)
    except OverLimit as exc:
        raise exc.error(where) from None
    except UnsafeCheckpointError as exc:
        if type(head.get("version")) is int and head.get("format") == FORMAT_NAME:
            _check_version(head, where)  # a future version's fields are not "unsafe"
        # which manifest (an incremental save's base's, say): the message named none
        said = str(exc)
        raise UnsafeCheckpointError(
            f"manifest {where} {said[9:]}" if said.startswith("manifest ")
            else f"manifest {where}: {said}") from None
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
                arrays_l, files, store, np.array([f.size for f in files], dtype=np.int64),
                max_arrays)
            _check_v2_fields(doc, store, version)
        elif type(arrays_l) is _DecodedArrays:
            arrays = list(arrays_l)
        else:
            arrays_l = _list(arrays_l, "arrays")
            if len(arrays_l) > MAX_ARRAYS:
                raise _Bad(f"{len(arrays_l)} arrays (limit {MAX_ARRAYS})")
            over_limit(len(arrays_l), max_arrays)
            sizes = np.array([f.size for f in files], dtype=np.int64)
            arrays = [_decode_array(a, i, files, store, sizes) for i, a in enumerate(arrays_l)]
        del arrays_l, doc["arrays"]
        _check_store_ranges(files, store)
        tree = _check_tree(doc.get("tree"), len(arrays))
        meta = doc.get("meta", {})
        if type(meta) is not dict:
            raise _Bad("meta must be an object")
        _check_leaf_arrays(tree, arrays)
    except _Bad as exc:
        raise _bad_manifest(exc, where) from None
    except OverLimit as exc:
        raise exc.error(where) from None
    except RecursionError:
        raise CheckpointCorruptError(f"manifest {where} is nested too deeply") from None
    return Manifest(tree=tree, arrays=arrays, files=files, meta=meta, version=version,
                    bases=list(store.bases))


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
    if type(version) is not int:
        raise CheckpointCorruptError(f"commit marker {where} is malformed: its version "
                                     f"{version!r:.40} is not an integer")
    if version not in FORMAT_VERSIONS:
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
