"""Manifest schema (format v1), limits and encoder; the decoder is in ``_decode.py``
and ``_decode_tree.py`` (re-exported here).

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
from statestream.format._chunks import ChunkEntry, ChunkRef
from statestream.format._dtypes import itemsize_of
from statestream.tree import Node

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


# The decoder lives in _decode.py / _decode_tree.py; re-exported so every name stays
# importable from here. Imported last: those modules import the schema above.
from statestream.format._decode import decode_commit, decode_manifest  # noqa: E402
from statestream.format._decode_tree import decode_tree, validate_file_name  # noqa: E402
