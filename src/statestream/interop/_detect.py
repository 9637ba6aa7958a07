"""Which format a path holds, decided by content (extensions only break ties)."""

from __future__ import annotations

import dataclasses
import os

from statestream.errors import CheckpointCorruptError, CheckpointError, UnsupportedTypeError
from statestream.format import COMMIT_NAME, MANIFEST_NAME, Manifest
from statestream.interop._dcp import looks_like_dcp, open_dcp
from statestream.interop._files import FileSetReader, hub_blob
from statestream.interop._orbax import looks_like_orbax, open_orbax
from statestream.interop._safetensors import (
    find_index,
    find_single,
    looks_like_safetensors,
    open_safetensors,
    open_sharded,
)
from statestream.interop._torchfile import looks_like_torch_zip, open_torch_file
from statestream.tree import MAX_TREE_DEPTH, Key, Node, format_keypath

__all__ = ["ForeignCheckpoint", "detect_format", "open_foreign"]

_ZIP_MAGIC = b"PK\x03\x04"
_TORCH_EXTENSIONS = (".pt", ".pth", ".bin")


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
    """The foreign format at ``path``, or None (statestream's own, or unknown).

    One of ``"safetensors"``, ``"safetensors-sharded"``, ``"torch"``, ``"dcp"``,
    ``"orbax"``. Files
    are recognised by their first bytes: a safetensors file starts with an
    8-byte little-endian header length followed by ``{``; a torch.save file
    is a zip archive with a ``<name>/data.pkl`` entry. A directory is sharded
    safetensors when it holds a ``*.safetensors.index.json``, and DCP when it
    holds ``.metadata`` and ``*.distcp`` files (or a ``.metadata`` alone that starts as
    DCP's does: its data files are missing), Orbax when it holds
    ``_CHECKPOINT_METADATA`` or ``_METADATA`` (and no statestream manifest),
    and safetensors when it holds none of these and exactly one ``*.safetensors``
    file (a Hugging Face model directory, read as that file).
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
        if looks_like_dcp(p):
            return "dcp"
        if looks_like_orbax(p):
            return "orbax"
        if find_single(p) is not None:
            return "safetensors"  # a Hugging Face model directory holding one file
        return None
    if os.path.isfile(p):
        head, size = _head(p)
        if looks_like_safetensors(head, size):
            return "safetensors"
        if head.startswith(_ZIP_MAGIC) and looks_like_torch_zip(p):
            return "torch"
        if p.endswith(".safetensors"):
            return "safetensors"  # a damaged one: its parser says what is wrong
        if p.endswith(_TORCH_EXTENSIONS):
            if head.startswith(_ZIP_MAGIC):  # a zip that is not a whole torch.save archive
                raise CheckpointCorruptError(
                    f"{p} is a zip archive but not a readable torch.save file (truncated or "
                    "damaged?)")
            # not damage: a format statestream does not read (or no checkpoint at all, such
            # as a statestream data file), so verify raises it rather than report it
            raise UnsupportedTypeError(
                f"{p} is neither a zip-format torch.save file nor safetensors (a legacy "
                "torch.save file, or not a checkpoint); statestream does not read it: "
                "load it with torch and save it again")
    return None


def open_foreign(path: str | os.PathLike[str], *, allow_pickle: bool = False
                 ) -> ForeignCheckpoint | None:
    """Open a foreign checkpoint for reading, or None when ``path`` is not one.

    ``allow_pickle`` lets a torch.save file's pickle name other globals.
    """
    fmt = detect_format(path)
    p = os.fspath(path)
    if fmt == "safetensors":
        one = find_single(p) if os.path.isdir(p) else None  # a model directory's file
        reader, m = open_safetensors(p) if one is None else open_safetensors(one, hub_blob(one))
    elif fmt == "safetensors-sharded":
        index = find_index(p)
        if index is None:  # pragma: no cover - detect_format found it
            raise CheckpointError(f"{p}: the safetensors index disappeared")
        reader, m = open_sharded(index)
    elif fmt == "dcp":
        reader, m = open_dcp(p, allow_pickle=allow_pickle)
    elif fmt == "orbax":
        reader, m = open_orbax(p)
    elif fmt == "torch":
        reader, m = open_torch_file(p, allow_pickle=allow_pickle)
    else:
        return None
    _check_depth(m.tree, p)
    reader.format = fmt
    return ForeignCheckpoint(fmt, reader, m)


def _check_depth(root: Node, where: str) -> None:
    """Refuse a tree nested deeper than a manifest's may be (its decoder's count: a
    node's depth, the root's 0, at most ``MAX_TREE_DEPTH`` + 2).

    Each format's parser bounds its own nesting, but a tree may be assembled from
    several (a DCP item's key path and the value pickled at it): deeper, a load or a
    conversion recursed past Python's limit, or wrote a checkpoint that statestream's
    decoder then refuses. Iterative; the key path is rebuilt only for the message.

    Raises:
        CheckpointCorruptError: naming ``where`` and the key path.
    """
    Link = tuple[object, Key] | None  # (parent's link, key), None at the root
    stack: list[tuple[Node, int, Link]] = [(root, 0, None)]
    while stack:
        n, depth, link = stack.pop()
        if depth > MAX_TREE_DEPTH + 2:
            keys: list[Key] = []
            while link is not None:
                link, k = link  # type: ignore[assignment]
                keys.append(k)
            raise CheckpointCorruptError(
                f"{where}: the state is nested deeper than {MAX_TREE_DEPTH} levels at key "
                f"path '{format_keypath(tuple(reversed(keys))):.300}', more than a statestream "
                "checkpoint may hold")
        kids = n.children
        if not kids:
            continue
        if n.kind == "stateful":  # (its state is at its own key path)
            stack.extend((c, depth + 1, link) for c in kids)
        else:
            keys_ = n.keys if n.keys is not None else range(len(kids))
            stack.extend((c, depth + 1, (link, k)) for k, c in zip(keys_, kids))
