"""Orbax checkpoints, read through orbax-checkpoint (the optional extra ``statestream[orbax]``).

Orbax stores arrays through tensorstore (OCDBT or not), whose layout is
orbax's own business: the checkpoint is restored by orbax itself, as NumPy,
and served from memory. Unlike the other formats this holds the whole state
in memory while it is read or converted.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import numpy as np

from statestream.errors import CheckpointCorruptError, CheckpointError, UnsupportedTypeError
from statestream.format import ArrayEntry, FileEntry, Manifest, dtype_name
from statestream.interop._chunks import row_chunks
from statestream.interop._deps import require
from statestream.interop._files import FileSetReader
from statestream.tree import Key, KeyPath, Node, format_keypath

__all__ = ["looks_like_orbax", "open_orbax"]

_MARKERS = ("_CHECKPOINT_METADATA", "_METADATA")


def looks_like_orbax(directory: str) -> bool:
    """A directory with orbax's ``_CHECKPOINT_METADATA`` or ``_METADATA`` file."""
    return any(os.path.isfile(os.path.join(directory, m)) for m in _MARKERS)


def _item_dir(directory: str) -> str:
    """The PyTree item directory to restore: ``directory`` itself, or for a
    CheckpointManager step (``_CHECKPOINT_METADATA`` and one subdirectory per item)
    its one item's directory (``default``, or the single item's name).

    Raises:
        CheckpointError: a step with several items (naming them: pass one).
    """
    if os.path.isfile(os.path.join(directory, "_METADATA")):
        return directory
    try:
        subs = sorted(e.name for e in os.scandir(directory) if e.is_dir(follow_symlinks=False))
    except OSError:
        return directory  # orbax's own restore reports what is wrong
    items = [n for n in subs if looks_like_orbax(os.path.join(directory, n))]
    if len(items) == 1 and len(subs) == 1:
        return os.path.join(directory, items[0])
    if len(subs) > 1:
        raise CheckpointError(
            f"{directory} is an Orbax CheckpointManager step with items {', '.join(subs)}; "
            f"pass one item's directory (e.g. {os.path.join(directory, subs[0])})")
    return directory


def open_orbax(directory: str) -> tuple[FileSetReader, Manifest]:
    """Restore an Orbax checkpoint with orbax-checkpoint and describe it as a manifest
    (a CheckpointManager step with one item reads that item)."""
    ocp = require("orbax.checkpoint", "orbax", "reading Orbax checkpoints")
    item = _item_dir(directory)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            state = ocp.PyTreeCheckpointer().restore(os.path.abspath(item))
    except (MemoryError, PermissionError, KeyboardInterrupt):
        raise
    except Exception as exc:  # orbax and tensorstore raise many types for one damage
        raise CheckpointCorruptError(
            f"{item}: orbax could not restore this Orbax checkpoint "
            f"({type(exc).__name__}: {str(exc)[:500]})") from exc
    arrays: list[ArrayEntry] = []
    memory: dict[str, memoryview] = {}
    files: list[FileEntry] = []
    root = _node(state, (), arrays, memory, files)
    return FileSetReader(directory, {}, memory=memory), Manifest(root, arrays, files)


def _node(x: Any, p: KeyPath, arrays: list[ArrayEntry], memory: dict[str, memoryview],
          files: list[FileEntry]) -> Node:
    if x is None:
        return Node("none")
    for t, kind in ((bool, "bool"), (int, "int"), (float, "float"), (str, "str")):
        if type(x) is t:
            return Node(kind, value=x)
    if isinstance(x, dict):
        keys: list[Key] = [k for k in x if type(k) in (str, int)]
        if len(keys) != len(x):
            raise UnsupportedTypeError(f"a key at key path '{format_keypath(p)}' is not str/int")
        return Node("dict", keys=keys,
                    children=[_node(x[k], p + (k,), arrays, memory, files) for k in keys])
    if isinstance(x, (list, tuple)):
        kids = [_node(v, p + (i,), arrays, memory, files) for i, v in enumerate(x)]
        return Node("list" if isinstance(x, list) else "tuple", children=kids)
    if not hasattr(x, "dtype") or not hasattr(x, "shape"):
        raise UnsupportedTypeError(
            f"key path '{format_keypath(p)}' holds a {type(x).__name__} restored by orbax, "
            "which statestream cannot represent")
    a = np.require(np.asarray(x), requirements="C")  # ascontiguousarray makes 0-d 1-d
    name = dtype_name(a.dtype)
    if name is None:
        raise UnsupportedTypeError(f"key path '{format_keypath(p)}' has dtype {a.dtype}, "
                                   "which statestream cannot hold")
    fname = f"<array {len(files)}>"
    memory[fname] = memoryview(a.reshape(-1).view(np.uint8).data)
    files.append(FileEntry(fname, a.nbytes))
    arrays.append(ArrayEntry(name, tuple(a.shape), row_chunks(len(files) - 1, 0, name,
                                                              tuple(a.shape))))
    return Node("array", array=len(arrays) - 1)
