"""Manifest schema (format v1): encode, decode and enforce every limit.

See ``docs/format.md`` for the document this code enforces.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from typing import Any

import numpy as np

from statestream.errors import (
    CheckpointCorruptError,
    FormatVersionError,
    UnsafeCheckpointError,
)
from statestream.format._checksum import CHECKSUM_ALGORITHM, checksum
from statestream.format._dtypes import DTYPE_NAMES, itemsize_of
from statestream.tree import MAX_TREE_DEPTH, Key, Node

__all__ = [
    "COMMIT_NAME",
    "DATA_DIR",
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "MANIFEST_NAME",
    "MAX_ARRAY_BYTES",
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
    "decode_commit",
    "decode_manifest",
    "decode_tree",
    "encode_commit",
    "encode_manifest",
    "encode_tree",
    "validate_file_name",
]

FORMAT_NAME = "statestream"
FORMAT_VERSION = 1
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
MAX_FILE_BYTES = 1 << 52
MAX_INT_HEX_DIGITS = 1 << 24

_FILE_NAME_RE = re.compile(r"^data/[A-Za-z0-9_][A-Za-z0-9_.\-]{0,199}$")
_LEAF_VALUE_KINDS = ("none", "bool", "int", "float", "str")
_ARRAY_KINDS = ("array", "bytes", "pickle")
_CONTAINERS = ("dict", "list", "tuple", "namedtuple", "dataclass", "pytree")
_KEYED = ("dict", "namedtuple", "dataclass", "pytree")


@dataclasses.dataclass(frozen=True, slots=True)
class ChunkRef:
    """Where a chunk's bytes live in *another* checkpoint (incremental saves).

    Room in the types only: format v1 cannot record it, and
    :func:`encode_manifest` refuses a chunk that carries one.
    """

    checkpoint: str
    file: str
    offset: int


@dataclasses.dataclass(slots=True)  # not frozen: built 1000s of times per load
class ChunkEntry:
    """A box of an array stored contiguously (C order) in one data file.

    ``nbytes`` is the number of bytes *stored* in the file; the raw size is
    ``prod(shape) * itemsize``. They are equal unless ``codec`` names an
    encoding (compression). ``ref`` points at the bytes in another
    checkpoint instead of this one's files. Both are ``None`` in format v1
    (the JSON of a v1 chunk has no field for them).
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
    ref: ChunkRef | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class ArrayEntry:
    """An array's dtype, global shape and the chunks that tile it."""

    dtype: str
    shape: tuple[int, ...]
    chunks: tuple[ChunkEntry, ...]

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
    version: int = FORMAT_VERSION


# ----------------------------------------------------------------------------- encode


def _encode_node(node: Node) -> dict[str, Any]:
    out: dict[str, Any] = {"t": node.kind}
    k = node.kind
    if k in _CONTAINERS:
        if k in _KEYED:
            out["k"] = list(node.keys or [])
        out["c"] = [_encode_node(c) for c in node.children or []]
        if node.type_name:
            out["n"] = node.type_name
    elif k == "stateful":
        out["n"] = node.type_name or ""
        out["c"] = [_encode_node(c) for c in node.children or []]
    elif k == "none":
        pass
    elif k == "bool":
        out["v"] = bool(node.value)
    elif k == "int":
        out["v"] = format(int(node.value), "x")
    elif k == "float":
        out["v"] = float(node.value).hex()
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


def decode_tree(doc: Any, n_arrays: int) -> Node:
    """Parse and validate the JSON form of a tree whose leaves index ``n_arrays`` arrays."""
    try:
        return _decode_node(doc, 0, n_arrays, set())
    except _Bad as exc:
        raise CheckpointCorruptError(f"malformed tree: {exc}") from None


def _v1_chunk(c: ChunkEntry) -> list[Any]:
    if c.codec is not None or c.ref is not None:
        raise FormatVersionError(
            f"a chunk at offset {c.offset} of data file {c.file} carries a codec or a reference "
            f"to another checkpoint, which format version {FORMAT_VERSION} cannot record"
        )
    return [c.file, c.offset, c.nbytes, c.checksum, list(c.start), list(c.shape)] + (
        [[c.block_rows, list(c.block_checksums)]] if c.block_rows else [])


def encode_manifest(m: Manifest) -> bytes:
    """Serialize a manifest to canonical JSON bytes (UTF-8, ASCII-escaped).

    Raises:
        FormatVersionError: a chunk needs a field format v1 does not have
            (``codec``, ``ref``).
    """
    doc = {
        "format": FORMAT_NAME,
        "version": m.version,
        "checksum": CHECKSUM_ALGORITHM,
        "meta": m.meta,
        "files": [[f.name, f.size] for f in m.files],
        "arrays": [
            {
                "dtype": a.dtype,
                "shape": list(a.shape),
                "chunks": [_v1_chunk(c) for c in a.chunks],
            }
            for a in m.arrays
        ],
        "tree": _encode_node(m.tree),
    }
    return json.dumps(doc, ensure_ascii=True, separators=(",", ":"), allow_nan=False).encode()


def encode_commit(manifest_bytes: bytes) -> bytes:
    """The commit marker: names the manifest's exact size and checksum."""
    doc = {
        "format": FORMAT_NAME,
        "version": FORMAT_VERSION,
        "manifest_bytes": len(manifest_bytes),
        "manifest_crc32c": checksum(manifest_bytes),
    }
    return json.dumps(doc, separators=(",", ":")).encode()


# ----------------------------------------------------------------------------- decode


class _Bad(Exception):
    pass


def _int(v: Any, what: str, lo: int = 0, hi: int = 1 << 62) -> int:
    if type(v) is not int or not lo <= v <= hi:
        raise _Bad(f"{what} must be an integer in [{lo}, {hi}], got {v!r:.80}")
    return v


def _list(v: Any, what: str) -> list[Any]:
    if type(v) is not list:
        raise _Bad(f"{what} must be a list")
    return v


def _str(v: Any, what: str) -> str:
    if type(v) is not str:
        raise _Bad(f"{what} must be a string")
    return v


def validate_file_name(name: str) -> str:
    """Accept only ``data/<plain name>``: no separators, no ``..``, no absolute paths."""
    if type(name) is not str or not _FILE_NAME_RE.fullmatch(name) or ".." in name:
        raise UnsafeCheckpointError(
            f"manifest names data file {name!r:.120}, which is not a plain file inside the "
            "checkpoint's data/ directory; refusing to read it (the checkpoint is corrupt or "
            "hostile)"
        )
    return name


def _decode_node(d: Any, depth: int, n_arrays: int, used: set[int]) -> Node:
    if depth > MAX_TREE_DEPTH + 2:
        raise _Bad(f"tree is nested deeper than {MAX_TREE_DEPTH}")
    if type(d) is not dict:
        raise _Bad("tree node must be an object")
    k = d.get("t")
    if k in _CONTAINERS:
        children = [
            _decode_node(c, depth + 1, n_arrays, used) for c in _list(d.get("c"), "children")
        ]
        keys: list[Key] | None = None
        if k in _KEYED:
            keys = []
            for key in _list(d.get("k"), "keys"):
                if type(key) is not str and type(key) is not int:
                    raise _Bad(f"key {key!r:.80} must be a string or integer")
                if k != "dict" and type(key) is not str:
                    raise _Bad(f"field name {key!r:.80} must be a string")
                keys.append(key)
            if len(keys) != len(children):
                raise _Bad("keys and children differ in length")
        tn = d.get("n")
        if tn is not None:
            _str(tn, "type name")
        return Node(k, keys=keys, children=children, type_name=tn)
    if k == "stateful":
        children = [
            _decode_node(c, depth + 1, n_arrays, used) for c in _list(d.get("c"), "children")
        ]
        if len(children) != 1:
            raise _Bad("stateful node must have exactly one child")
        return Node(k, children=children, type_name=_str(d.get("n", ""), "type name"))
    if k == "none":
        return Node(k)
    if k == "bool":
        if type(d.get("v")) is not bool:
            raise _Bad("bool value must be true or false")
        return Node(k, value=d["v"])
    if k == "int":
        s = _str(d.get("v"), "int value")
        if not re.fullmatch(r"-?[0-9a-f]+", s) or len(s) > MAX_INT_HEX_DIGITS:
            raise _Bad(f"int value {s!r:.80} is not lowercase hex")
        return Node(k, value=int(s, 16))
    if k == "float":
        s = _str(d.get("v"), "float value")
        try:
            value = float.fromhex(s)
        except (ValueError, OverflowError) as exc:
            raise _Bad(f"float value {s!r:.80} is not a hex float") from exc
        return Node(k, value=value)
    if k == "str":
        return Node(k, value=_str(d.get("v"), "str value"))
    if k in _ARRAY_KINDS:
        idx = _int(d.get("a"), "array index", 0, max(n_arrays - 1, 0))
        if n_arrays == 0:
            raise _Bad("array index refers to an empty array table")
        if idx in used:
            raise _Bad(f"array {idx} is referenced twice")
        used.add(idx)
        attrs = d.get("x")
        if attrs is not None and type(attrs) is not dict:
            raise _Bad("leaf attributes must be an object")
        return Node(k, array=idx, attrs=attrs)
    if k == "alias":  # another leaf holding the same array (tied weights)
        if n_arrays == 0:
            raise _Bad("alias refers to an empty array table")
        idx = _int(d.get("a"), "alias's array index", 0, n_arrays - 1)
        attrs = d.get("x")
        if attrs is not None and type(attrs) is not dict:
            raise _Bad("leaf attributes must be an object")
        return Node(k, array=idx, attrs=attrs)
    raise _Bad(f"unknown tree node type {k!r:.40}")


def _check_no_overlap(starts: np.ndarray, ends: np.ndarray) -> bool:
    """True if no two boxes (half-open [start, end)) intersect."""
    n = len(starts)
    if n < 2:
        return True
    order = np.argsort(starts[:, 0], kind="stable")
    s, e = starts[order], ends[order]
    # Sweep along axis 0; compare each box only with boxes that start before it ends.
    block = max(1, min(1024, 4_000_000 // n))
    for i in range(0, n, block):
        si, ei = s[i : i + block], e[i : i + block]
        # candidates: boxes j with start0 < max end0 in block
        jmax = int(np.searchsorted(s[:, 0], ei[:, 0].max(), side="left"))
        sj, ej = s[:jmax], e[:jmax]
        inter = np.all(
            (si[:, None, :] < ej[None, :, :]) & (sj[None, :, :] < ei[:, None, :]), axis=2
        )
        idx_i = np.arange(i, i + len(si))[:, None]
        idx_j = np.arange(jmax)[None, :]
        if np.any(inter & (idx_i != idx_j)):
            return False
    return True


def _decode_array(d: Any, i: int, files: list[FileEntry]) -> ArrayEntry:
    if type(d) is not dict:
        raise _Bad(f"array {i} must be an object")
    dtype = _str(d.get("dtype"), f"array {i} dtype")
    if dtype not in DTYPE_NAMES:
        raise _Bad(f"array {i} has unknown dtype {dtype!r:.40}")
    shape_l = _list(d.get("shape"), f"array {i} shape")
    if len(shape_l) > MAX_NDIM:
        raise _Bad(f"array {i} has {len(shape_l)} dimensions (limit {MAX_NDIM})")
    shape = tuple(_int(s, f"array {i} dimension", 0, MAX_DIM) for s in shape_l)
    itemsize = itemsize_of(dtype)
    total = math.prod(shape)
    if total * itemsize > MAX_ARRAY_BYTES:
        raise _Bad(f"array {i} is {total * itemsize} bytes (limit {MAX_ARRAY_BYTES})")
    chunks: list[ChunkEntry] = []
    covered = 0
    nd = len(shape)
    n_files = len(files)
    chunk_list = _list(d.get("chunks"), f"array {i} chunks")
    for j, c in enumerate(chunk_list):
        if type(c) is not list or len(c) not in (6, 7):
            raise _Bad(f"array {i} chunk {j} must be a list of 6 or 7 fields")
        f, off, nb, crc, start_l, shape_l2 = c[:6]
        if type(f) is not int or not 0 <= f < n_files:
            raise _Bad(f"array {i} chunk {j} refers to file {f!r:.40}, not one of {n_files}")
        if type(off) is not int or not 0 <= off <= MAX_FILE_BYTES:
            raise _Bad(f"array {i} chunk {j} has a bad offset {off!r:.40}")
        if type(nb) is not int or not 0 <= nb <= MAX_ARRAY_BYTES:
            raise _Bad(f"array {i} chunk {j} has a bad length {nb!r:.40}")
        if type(crc) is not int or not 0 <= crc <= 0xFFFFFFFF:
            raise _Bad(f"array {i} chunk {j} has a bad checksum {crc!r:.40}")
        if (
            type(start_l) is not list
            or type(shape_l2) is not list
            or len(start_l) != nd
            or len(shape_l2) != nd
        ):
            raise _Bad(f"array {i} chunk {j} must give start and shape with {nd} dimensions")
        for a in range(nd):
            x, n = start_l[a], shape_l2[a]
            if type(x) is not int or type(n) is not int or x < 0 or n < 0:
                raise _Bad(f"array {i} chunk {j} has a bad start/shape on axis {a}")
            if x + n > shape[a]:
                raise _Bad(f"array {i} chunk {j} lies outside the array's shape {shape}")
        cshape = tuple(shape_l2)
        vol = math.prod(cshape)
        if nb != vol * itemsize:
            raise _Bad(
                f"array {i} chunk {j} is {nb} bytes but its shape {cshape} x {itemsize} bytes "
                f"per element needs {vol * itemsize}"
            )
        fe = files[f]
        if off + nb > fe.size:
            raise _Bad(
                f"array {i} chunk {j} spans bytes [{off}, {off + nb}) of {fe.name}, "
                f"which the manifest says has only {fe.size} bytes"
            )
        covered += vol
        block_rows, block_sums = 0, ()
        if len(c) == 7:
            blk = c[6]
            if (
                type(blk) is not list or len(blk) != 2 or type(blk[0]) is not int
                or blk[0] < 1 or nd == 0 or type(blk[1]) is not list
                or len(blk[1]) != -(-cshape[0] // blk[0])
                or not all(type(x) is int and 0 <= x <= 0xFFFFFFFF for x in blk[1])
            ):
                raise _Bad(f"array {i} chunk {j} has a malformed block checksum table")
            block_rows, block_sums = blk[0], tuple(blk[1])
        chunks.append(ChunkEntry(f, off, nb, crc, tuple(start_l), cshape, block_rows,
                                 block_sums))
    if covered != total:
        raise _Bad(f"array {i}'s chunks cover {covered} of its {total} elements")
    live = [c for c in chunks if math.prod(c.shape) > 0]
    if len(live) > 1:
        starts = np.array([c.start for c in live], dtype=np.int64).reshape(len(live), nd)
        ends = starts + np.array([c.shape for c in live], dtype=np.int64).reshape(len(live), nd)
        if nd == 0 or not _check_no_overlap(starts, ends):
            raise _Bad(f"array {i} has overlapping chunks")
    return ArrayEntry(dtype, shape, tuple(chunks))


def decode_manifest(data: bytes, where: str) -> Manifest:
    """Parse and fully validate manifest bytes read from ``where``.

    Raises:
        FormatVersionError: the manifest is from an unknown format version.
        UnsafeCheckpointError: a file name escapes the checkpoint.
        CheckpointCorruptError: anything else is malformed or out of limits.
    """
    if len(data) > MAX_MANIFEST_BYTES:
        raise CheckpointCorruptError(
            f"manifest {where} is {len(data)} bytes, over the {MAX_MANIFEST_BYTES}-byte limit"
        )
    try:
        doc = json.loads(data)
    except (ValueError, RecursionError) as exc:
        raise CheckpointCorruptError(f"manifest {where} is not valid JSON: {exc}") from exc
    if type(doc) is not dict or doc.get("format") != FORMAT_NAME:
        raise CheckpointCorruptError(f"{where} is not a statestream manifest")
    version = doc.get("version")
    if type(version) is not int:
        raise CheckpointCorruptError(f"manifest {where} has no integer format version")
    if version != FORMAT_VERSION:
        raise FormatVersionError(
            f"checkpoint manifest {where} uses format version {version}, but this statestream "
            f"reads version {FORMAT_VERSION}; "
            + ("upgrade statestream" if version > FORMAT_VERSION else "it is not supported")
        )
    if doc.get("checksum") != CHECKSUM_ALGORITHM:
        raise CheckpointCorruptError(
            f"manifest {where} uses checksum {doc.get('checksum')!r:.40}; only "
            f"{CHECKSUM_ALGORITHM} is defined for format v1"
        )
    try:
        files_l = _list(doc.get("files"), "files")
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
        arrays_l = _list(doc.get("arrays"), "arrays")
        arrays = [_decode_array(a, i, files) for i, a in enumerate(arrays_l)]
        used: set[int] = set()
        tree = _decode_node(doc.get("tree"), 0, len(arrays), used)
        meta = doc.get("meta", {})
        if type(meta) is not dict:
            raise _Bad("meta must be an object")
    except _Bad as exc:
        raise CheckpointCorruptError(f"manifest {where} is malformed: {exc}") from None
    except RecursionError:
        raise CheckpointCorruptError(f"manifest {where} is nested too deeply") from None
    _check_leaf_arrays(tree, arrays, where)
    return Manifest(tree=tree, arrays=arrays, files=files, meta=meta, version=version)


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
    if type(version) is int and version != FORMAT_VERSION:
        raise FormatVersionError(
            f"checkpoint {where} uses format version {version}; this statestream reads "
            f"version {FORMAT_VERSION}"
        )
    try:
        size = _int(doc.get("manifest_bytes"), "manifest_bytes", 0, MAX_MANIFEST_BYTES)
        crc = _int(doc.get("manifest_crc32c"), "manifest_crc32c", 0, 0xFFFFFFFF)
    except _Bad as exc:
        raise CheckpointCorruptError(f"commit marker {where} is malformed: {exc}") from None
    return size, crc
