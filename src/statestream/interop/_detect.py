"""Which format a path holds, decided by content (extensions only break ties)."""

from __future__ import annotations

import dataclasses
import os

from statestream.errors import CheckpointError
from statestream.format import COMMIT_NAME, MANIFEST_NAME, Manifest
from statestream.interop._files import FileSetReader
from statestream.interop._safetensors import (
    find_index,
    looks_like_safetensors,
    open_safetensors,
    open_sharded,
)

__all__ = ["ForeignCheckpoint", "detect_format", "open_foreign"]

_ZIP_MAGIC = b"PK\x03\x04"


@dataclasses.dataclass
class ForeignCheckpoint:
    """A checkpoint in another library's format, read through the load pipeline.

    ``checksums`` is False: these formats carry none, so reads check sizes
    and bounds only.
    """

    format: str
    reader: FileSetReader
    manifest: Manifest
    checksums: bool = False


def _head(path: str, n: int = 16) -> tuple[bytes, int]:
    with open(path, "rb") as f:
        return f.read(n), os.fstat(f.fileno()).st_size


def detect_format(path: str | os.PathLike[str]) -> str | None:
    """``"safetensors"``, ``"safetensors-sharded"``, or None (statestream's own, or unknown).

    Files are recognised by their first bytes: a safetensors file starts
    with an 8-byte little-endian header length followed by ``{``. A
    directory is sharded safetensors when it holds a
    ``*.safetensors.index.json`` and no statestream manifest.
    """
    p = os.fspath(path)
    if "://" in p:
        return None
    if os.path.isdir(p):
        if os.path.exists(os.path.join(p, MANIFEST_NAME)) or os.path.exists(
                os.path.join(p, COMMIT_NAME)):
            return None
        if find_index(p) is not None:
            return "safetensors-sharded"
        return None
    if os.path.isfile(p):
        head, size = _head(p)
        if looks_like_safetensors(head, size):
            return "safetensors"
        if p.endswith(".safetensors"):
            return "safetensors"  # a damaged one: its parser says what is wrong
    return None


def open_foreign(path: str | os.PathLike[str]) -> ForeignCheckpoint | None:
    """Open a foreign checkpoint for reading, or None when ``path`` is not one."""
    fmt = detect_format(path)
    p = os.fspath(path)
    if fmt == "safetensors":
        reader, m = open_safetensors(p)
    elif fmt == "safetensors-sharded":
        index = find_index(p)
        if index is None:  # pragma: no cover - detect_format found it
            raise CheckpointError(f"{p}: the safetensors index disappeared")
        reader, m = open_sharded(index)
    else:
        return None
    reader.format = fmt
    return ForeignCheckpoint(fmt, reader, m)
