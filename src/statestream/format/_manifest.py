"""Manifest schema (format v1 and v2), limits and encoder; the decoder is in ``_decode.py``,
``_decode_arrays.py`` and ``_decode_tree.py`` (re-exported here).

See ``docs/format.md`` for the document this code enforces.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Sequence
from typing import Any

from statestream.errors import (
    FormatVersionError,
)
from statestream.format._checksum import CHECKSUM_ALGORITHM, checksum
from statestream.format._chunks import CODECS, ChunkEntry, ChunkRef
from statestream.format._dtypes import itemsize_of
from statestream.tree import Node

__all__ = [
    "ARRAY_TABLE_MIN",
    "CODECS",
    "COMMIT_NAME",
    "DATA_DIR",
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "FORMAT_VERSIONS",
    "MANIFEST_NAME",
    "MAX_ARRAYS",
    "MAX_ARRAY_BYTES",
    "MAX_CODEC_RATIO",
    "MAX_COMMIT_BYTES",
    "MAX_DIM",
    "MAX_FILES",
    "MAX_MANIFEST_BYTES",
    "MAX_NDIM",
    "ArrayEntry",
    "ChunkEntry",
    "ChunkRef",
    "FileEntry",
    "Manifest",
    "check_max_arrays",
    "decode_commit",
    "decode_manifest",
    "decode_tree",
    "encode_commit",
    "encode_manifest",
    "encode_tree",
    "manifest_version",
    "over_max_arrays",
    "validate_base_name",
    "validate_file_name",
]

FORMAT_NAME = "statestream"
#: The newest format version this statestream reads and writes. A writer emits
#: version 3 for a manifest of many arrays (its arrays as one table of integer
#: columns, :data:`ARRAY_TABLE_MIN`); otherwise version 2 only when a checkpoint uses
#: a v2 feature (a codec, a hash, a reference to a base), else version 1, byte for
#: byte as before.
FORMAT_VERSION = 3
#: Every version this statestream reads.
FORMAT_VERSIONS = (1, 2, 3)
#: A manifest of at least this many arrays writes them as one table (format v3):
#: half the text, decoded by a few whole-column checks instead of one object per
#: array (docs/format.md, "Format v3"). Smaller ones keep the readable list.
ARRAY_TABLE_MIN = 1024
MANIFEST_NAME = "manifest.json"
COMMIT_NAME = "COMMITTED"
DATA_DIR = "data"

#: Limits enforced on load before anything is allocated (docs/format.md, "Limits").
MAX_MANIFEST_BYTES = 1 << 30
MAX_COMMIT_BYTES = 4096
MAX_NDIM = 32
MAX_DIM = 1 << 48
MAX_ARRAY_BYTES = 1 << 48
MAX_FILES = 1 << 20
#: Arrays in one manifest. Each costs a few hundred bytes decoded whatever its text;
#: a v3 table needs as little as ~10 characters for one, so without this bound a
#: 1 GiB manifest could make a load allocate ~20x its size.
MAX_ARRAYS = 1 << 24
MAX_FILE_BYTES = 1 << 52
MAX_INT_HEX_DIGITS = 1 << 24
#: A compressed chunk's raw size is at most this many times its stored size: a zstd
#: block yields at most 128 KiB from at least 4 bytes, so no valid frame expands
#: further, and a load allocates at most this much per byte its files hold.
MAX_CODEC_RATIO = 1 << 15

_FILE_NAME_RE = re.compile(r"^data/[A-Za-z0-9_][A-Za-z0-9_.\-]{0,199}$")
#: a base checkpoint: one path component, a sibling of the checkpoint (format v2)
_BASE_NAME_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]{0,199}$")
_LEAF_VALUE_KINDS = ("none", "bool", "int", "float", "str")
_ARRAY_KINDS = ("array", "bytes", "pickle")
_CONTAINERS = ("dict", "list", "tuple", "namedtuple", "dataclass", "pytree")
_KEYED = ("dict", "namedtuple", "dataclass", "pytree")


@dataclasses.dataclass(frozen=True, slots=True)
class ArrayEntry:
    """An array's dtype, global shape and the chunks that tile it."""

    dtype: str
    shape: tuple[int, ...]
    #: a tuple when built by a writer or decoded from a small manifest; else a compact ChunkList
    chunks: Sequence[ChunkEntry]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * itemsize_of(self.dtype)


@dataclasses.dataclass(frozen=True, slots=True)
class FileEntry:
    """A data file of the checkpoint and its exact size."""

    name: str
    size: int


@dataclasses.dataclass(slots=True)
class Manifest:
    """Everything about a checkpoint except the tensor bytes."""

    tree: Node
    arrays: list[ArrayEntry]
    files: list[FileEntry]
    meta: dict[str, Any] = dataclasses.field(default_factory=dict)
    #: the version it was read as; a writer uses :func:`manifest_version` instead
    version: int = 1
    #: base checkpoints (sibling directory names) that ``ref`` chunks point into, in
    #: the manifest's order; empty: derived from the chunks' refs when encoding
    bases: list[str] = dataclasses.field(default_factory=list)


# ----------------------------------------------------------------------------- encode


def _leaf_kind(node: Node) -> str | None:
    """The kind of an array leaf whose only attribute is its kind, else None."""
    a = node.attrs
    if node.kind != "array" or a is None or len(a) != 1 or type(a.get("kind")) is not str:
        return None
    return a["kind"]  # type: ignore[no-any-return]


def _encode_kids(out: dict[str, Any], kids: list[Node], compact: bool) -> None:
    """``out["c"]``; ``compact`` (format v3): array leaves of the container's most
    common kind ``out["ak"]`` as their bare array index."""
    if compact:
        kinds: dict[str, int] = {}
        for c in kids:
            lk = _leaf_kind(c)
            if lk is not None:
                kinds[lk] = kinds.get(lk, 0) + 1
        if kinds:
            ak = out["ak"] = max(kinds, key=kinds.__getitem__)
            out["c"] = [c.array if _leaf_kind(c) == ak else _encode_node(c, True)
                        for c in kids]
            return
    out["c"] = [_encode_node(c, compact) for c in kids]


def _float_text(x: float) -> str:
    """``float.hex()``, and ``-nan`` for a NaN whose sign is set (``hex()`` gives "nan"):
    ``float.fromhex`` (every reader's) parses it with its sign. A NaN's payload is not
    kept."""
    if x != x and math.copysign(1.0, x) < 0:
        return "-nan"
    return x.hex()


def _encode_node(node: Node, compact: bool = False) -> dict[str, Any]:
    out: dict[str, Any] = {"t": node.kind}
    k = node.kind
    if k in _CONTAINERS:
        if k in _KEYED:
            out["k"] = list(node.keys or [])
        _encode_kids(out, node.children or [], compact)
        if node.type_name:
            out["n"] = node.type_name
    elif k == "stateful":
        out["n"] = node.type_name or ""
        _encode_kids(out, node.children or [], compact)
    elif k == "none":
        pass
    elif k == "bool":
        out["v"] = bool(node.value)
    elif k == "int":
        out["v"] = format(int(node.value), "x")
    elif k == "float":
        out["v"] = _float_text(float(node.value))
    elif k == "str":
        out["v"] = str(node.value)
    elif k in _ARRAY_KINDS or k == "alias":
        out["a"] = node.array
        if node.attrs:
            out["x"] = node.attrs
    else:  # pragma: no cover - programming error
        raise AssertionError(f"unknown node kind {k}")
    return out


def encode_tree(node: Node) -> dict[str, Any]:
    """The manifest (JSON) form of a tree, as plain data."""
    return _encode_node(node)


def _encode_chunk(c: ChunkEntry, bases: dict[str, int]) -> list[Any]:
    """A chunk's JSON: 6 or 7 fields as in v1, or 8 when it has v2 fields."""
    out: list[Any] = [c.file, c.offset, c.nbytes, c.checksum, list(c.start), list(c.shape)]
    blocks = [c.block_rows, list(c.block_checksums)] if c.block_rows else None
    if c.codec is None and c.digest is None and c.ref is None:
        if blocks is not None:
            out.append(blocks)
        return out
    out += [blocks, _chunk_ext(c, bases)]
    return out


def _chunk_ext(c: ChunkEntry, bases: dict[str, int]) -> dict[str, Any]:
    """A chunk's v2 extension object (its codec, hash and reference)."""
    ext: dict[str, Any] = {}
    if c.codec is not None:
        if c.codec not in CODECS:
            raise FormatVersionError(f"codec {c.codec!r} is not one of {CODECS}")
        if c.block_rows:
            raise AssertionError("a compressed chunk has no block checksums")
        ext["codec"] = c.codec
        if c.shuffle:
            ext["shuffle"] = True
    elif c.shuffle:
        raise AssertionError("byte shuffling is part of a codec's record")
    if c.digest is not None:
        if len(c.digest) != 16:
            raise AssertionError("a chunk's hash is 16 bytes (XXH3-128)")
        ext["hash"] = c.digest.hex()
    if c.ref is not None:
        if c.digest is None or c.ref.file != c.file:
            raise AssertionError("a reference carries its chunk's hash and base file index")
        ext["ref"] = bases[c.ref.base]
    return ext


def _chunk_is_v2(c: ChunkEntry) -> bool:
    return c.codec is not None or c.digest is not None or c.ref is not None


def _bases_of(m: Manifest) -> list[str]:
    """The manifest's ``bases``: ``m.bases`` if set, else in order of first reference;
    either way exactly the bases some chunk refers to."""
    used: dict[str, None] = {}
    for a in m.arrays:
        for c in a.chunks:
            if c.ref is not None:
                used.setdefault(c.ref.base, None)
    bases = list(m.bases) if m.bases else list(used)
    for b in bases:
        validate_base_name(b)
    if len(set(bases)) != len(bases) or set(bases) != set(used):
        raise AssertionError(f"bases {bases} are not exactly the ones referenced: {list(used)}")
    return bases


def manifest_version(m: Manifest) -> int:
    """The format version a writer records for ``m``: 3 if it has at least
    :data:`ARRAY_TABLE_MIN` arrays (written as a table), else 2 if a chunk has a
    codec, a hash or a reference (or the manifest names bases), else 1."""
    if len(m.arrays) >= ARRAY_TABLE_MIN:
        return 3
    if m.bases or any(_chunk_is_v2(c) for a in m.arrays for c in a.chunks):
        return 2
    return 1


def encode_manifest(m: Manifest) -> bytes:
    """Serialize a manifest to canonical JSON bytes (UTF-8, ASCII-escaped).

    Version 1 when no chunk uses a v2 feature (the bytes are exactly those of
    a v1 writer), else version 2 (see :func:`manifest_version`).

    Raises:
        FormatVersionError: a chunk names a codec this statestream does not know.
    """
    version = manifest_version(m)
    bases = _bases_of(m) if version >= 2 else []
    index = {b: i for i, b in enumerate(bases)}
    head: dict[str, Any] = {
        "format": FORMAT_NAME,
        "version": version,
        "checksum": CHECKSUM_ALGORITHM,
        "meta": m.meta,
        "files": [[f.name, f.size] for f in m.files],
    }
    if bases:
        head["bases"] = bases
    if version == 3:
        text = (_dumps(head)[:-1] + ',"arrays":' + _array_table(m.arrays, index) + ',"tree":'
                + _dumps(_encode_node(m.tree, True)) + "}")
        return text.encode()
    # The arrays hold nothing but integers and dtype names: written out directly,
    # 3-4x faster than building lists for json (a 20,000-array save spent 0.2 s
    # here), to exactly the bytes json.dumps gives (tests/format/test_manifest_text.py).
    arrays = ",".join([
        f'{{"dtype":{_dtype_json(a.dtype)},"shape":[{_ints(a.shape)}],"chunks":['
        f'{",".join([_chunk_json(c, index) for c in a.chunks])}]}}'
        for a in m.arrays
    ])
    text = (_dumps(head)[:-1] + ',"arrays":[' + arrays + '],"tree":'
            + _dumps(_encode_node(m.tree)) + "}")
    return text.encode()


def _array_table(arrays: Sequence[ArrayEntry], bases: dict[str, int]) -> str:
    """The arrays as one table of integer columns (format v3, docs/format.md):
    per array its dtype (an index into ``dtypes``), ndim, dims and chunk count; per
    chunk, in array order, file, offset, nbytes and CRC-32C, then its start and shape;
    the few chunks with block checksums or v2 fields listed by chunk number."""
    names: dict[str, int] = {}
    dtype: list[int] = []
    ndim: list[int] = []
    dims: list[int] = []
    nchunks: list[int] = []
    fields: list[int] = []
    boxes: list[int] = []
    blocks: list[list[Any]] = []
    ext: list[list[Any]] = []
    for a in arrays:
        k = names.get(a.dtype)
        if k is None:
            k = names[a.dtype] = len(names)
        dtype.append(k)
        ndim.append(len(a.shape))
        dims += a.shape
        nchunks.append(len(a.chunks))
        for c in a.chunks:
            if c.block_rows:
                blocks.append([len(fields) // 4, c.block_rows, list(c.block_checksums)])
            if _chunk_is_v2(c) or c.shuffle:  # (_chunk_ext refuses a shuffle without codec)
                ext.append([len(fields) // 4, _chunk_ext(c, bases)])
            fields += (c.file, c.offset, c.nbytes, c.checksum)
            boxes += c.start
            boxes += c.shape
    table: dict[str, Any] = {"dtypes": list(names), "dtype": dtype, "ndim": ndim,
                             "shape": dims, "nchunks": nchunks, "chunks": fields,
                             "boxes": boxes}
    if blocks:
        table["blocks"] = blocks
    if ext:
        table["ext"] = ext
    # (default=int: a writer's NumPy integers are written as the integers they are)
    return json.dumps(table, ensure_ascii=True, separators=(",", ":"), allow_nan=False,
                      default=int)


def _dumps(doc: Any) -> str:
    return json.dumps(doc, ensure_ascii=True, separators=(",", ":"), allow_nan=False)


def _ints(values: Sequence[int]) -> str:
    return ",".join([str(int(v)) for v in values])


_DTYPE_JSON: dict[str, str] = {}


def _dtype_json(name: str) -> str:
    text = _DTYPE_JSON.get(name)
    if text is None:
        text = _DTYPE_JSON[name] = _dumps(str(name))
    return text


def _chunk_json(c: ChunkEntry, bases: dict[str, int]) -> str:
    """:func:`_encode_chunk` as JSON text (its v1 forms written directly)."""
    if c.codec is not None or c.digest is not None or c.ref is not None or c.shuffle:
        return _dumps(_encode_chunk(c, bases))
    head = (f"[{int(c.file)},{int(c.offset)},{int(c.nbytes)},{int(c.checksum)},"
            f"[{_ints(c.start)}],[{_ints(c.shape)}]")
    if c.block_rows:
        return f"{head},[{int(c.block_rows)},[{_ints(c.block_checksums)}]]]"
    return head + "]"


_VERSION_PREFIX = re.compile(rb'\{"format":"statestream","version":([0-9]{1,3}),')


def encode_commit(manifest_bytes: bytes, version: int | None = None) -> bytes:
    """The commit marker: names the manifest's exact size and checksum.

    ``version``: the manifest's format version; by default the one that
    :func:`encode_manifest` wrote at the head of ``manifest_bytes`` (1 for
    bytes it did not write).
    """
    if version is None:
        head = _VERSION_PREFIX.match(manifest_bytes[:64])
        version = int(head.group(1)) if head else 1
    doc = {
        "format": FORMAT_NAME,
        "version": version,
        "manifest_bytes": len(manifest_bytes),
        "manifest_crc32c": checksum(manifest_bytes),
    }
    return json.dumps(doc, separators=(",", ":")).encode()


# The decoder lives in _decode.py / _decode_arrays.py / _decode_tree.py; re-exported
# so every name stays importable from here. Imported last: those modules import the schema above.
from statestream.format._decode import decode_commit, decode_manifest  # noqa: E402
from statestream.format._decode_tree import (  # noqa: E402
    check_max_arrays,
    decode_tree,
    over_max_arrays,
    validate_base_name,
    validate_file_name,
)
