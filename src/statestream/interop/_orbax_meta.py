"""Checks and metadata of an Orbax checkpoint's item directory read before orbax reads
anything (interop/_orbax.py): no links or devices under it, no array name leaving it, and
which arrays are typed PRNG keys; and which entries of a directory are orbax's own (what
a conversion may replace, interop/_publish.py)."""

from __future__ import annotations

import json
import os
import stat
from typing import NamedTuple

from statestream.errors import CheckpointCorruptError, UnsafeCheckpointError
from statestream.interop._files import read_capped

__all__ = ["Layout", "item_files", "key_impls", "orbax_strays", "outside", "refuse_links",
           "refuse_outside_names"]

#: The largest ``_METADATA`` read to check its names (orbax's own is a few hundred bytes
#: per array).
_MAX_METADATA = 256 << 20


#: The files orbax writes in a checkpoint's directory and in each item's (beside them: the
#: directories below and, without OCDBT, one tensorstore array directory per array).
_OWN_FILES = frozenset({"_CHECKPOINT_METADATA", "_METADATA", "_ROOT_METADATA", "_sharding",
                        "manifest.ocdbt", "commit_success.txt"})
#: ... and the directories: OCDBT's data, per-process array metadata, the descriptor
_OWN_DIRS = frozenset({"d", "array_metadatas", "descriptor"})
#: what a JsonSave item's directory holds
_JSON_ITEM = frozenset({"metadata", "commit_success.txt"})


def orbax_strays(directory: str, *, items: bool = True) -> list[str]:
    """The entries of an Orbax checkpoint's ``directory`` that orbax did not write there:
    not one of its own files or directories, a tensorstore array's directory (``.zarray``
    or ``zarr.json`` in it: an array without OCDBT), nor (``items``: a CheckpointManager
    step) an item's directory, itself holding only orbax's entries. Only names and the
    entries of subdirectories are looked at, never a file's contents; a link is a stray.
    """
    out = []
    for e in _entries(directory):
        if e.is_file(follow_symlinks=False) and e.name in _OWN_FILES:
            continue
        if e.is_dir(follow_symlinks=False) and (
                e.name in _OWN_DIRS or e.name.startswith("ocdbt.process_")
                or _is_array_dir(e.path) or (items and _is_item(e.path))):
            continue
        out.append(e.name)
    return sorted(out)


def _entries(directory: str) -> list[os.DirEntry[str]]:
    try:
        with os.scandir(directory) as it:
            return list(it)
    except OSError:
        return []


def _is_array_dir(path: str) -> bool:
    return any(os.path.isfile(os.path.join(path, n)) and not os.path.islink(os.path.join(path, n))
               for n in (".zarray", "zarr.json"))


def _is_item(path: str) -> bool:
    """A step's item: a PyTree item holding only orbax's entries, or a JsonSave item."""
    entries = _entries(path)
    files = {e.name for e in entries if e.is_file(follow_symlinks=False)}
    if len(files) == len(entries) and "metadata" in files and files <= _JSON_ITEM:
        return True
    return bool(files & {"_METADATA", "_CHECKPOINT_METADATA"}) and not orbax_strays(
        path, items=False)


def refuse_links(item: str) -> tuple[int, int]:
    """Tensorstore opens the item's files by path and follows links: refuse a symbolic
    link, FIFO, socket or device anywhere under the item, as statestream's own files are
    refused (docs/security.md), so no read leaves the checkpoint's directory or blocks.

    Returns:
        The bytes of the item's files, all together, as stored (a sparse file's holes,
        free to ship, do not count), and the bytes of their holes.
    """
    stored = holes = 0
    stack = [item]
    while stack:
        d = stack.pop()
        try:
            entries = list(os.scandir(d))
        except OSError as exc:
            raise CheckpointCorruptError(f"{d}: cannot list this Orbax directory ({exc})") from exc
        for e in entries:
            st = e.stat(follow_symlinks=False)
            if stat.S_ISDIR(st.st_mode):
                stack.append(e.path)
            elif not stat.S_ISREG(st.st_mode):
                raise UnsafeCheckpointError(
                    f"{e.path} is not a regular file or directory (a symbolic link, FIFO or "
                    "device); refused in an Orbax checkpoint")
            else:  # a sparse file's holes are not stored (st_blocks: 512-byte units)
                blocks = getattr(st, "st_blocks", None)
                held = st.st_size if blocks is None else min(st.st_size, blocks * 512)
                stored += held
                holes += st.st_size - held
    return stored, holes


def item_files(item: str, base: str) -> list[tuple[str, int]]:
    """Every regular file under ``item`` and its size, named relative to ``base``, sorted:
    the files an Orbax checkpoint's arrays are read from (tensorstore's layout, orbax's own
    business), as ``metadata`` lists them. Anything else is left out (:func:`refuse_links`
    refused it when the checkpoint was opened)."""
    out = []
    stack = [item]
    while stack:
        d = stack.pop()
        try:
            with os.scandir(d) as it:
                entries = list(it)
        except OSError:
            continue
        for e in entries:
            try:
                st = e.stat(follow_symlinks=False)
            except OSError:
                continue
            if stat.S_ISDIR(st.st_mode):
                stack.append(e.path)
            elif stat.S_ISREG(st.st_mode):
                out.append((os.path.relpath(e.path, base), st.st_size))
    return sorted(out)


def outside(name: str) -> bool:
    """Whether ``name``, joined to the item's directory, could leave it (an absolute
    path, a ``..`` component, a NUL byte)."""
    return name.startswith("/") or "\0" in name or ".." in name.split("/")


class Layout(NamedTuple):
    """How orbax reads the item's arrays, from ``_METADATA`` (:func:`refuse_outside_names`)."""

    #: in one OCDBT database, not a directory each
    use_ocdbt: bool
    #: a missing chunk reads as the fill value (orbax wrote no chunk equal to it), not an
    #: error
    fills: bool


def refuse_outside_names(item: str) -> Layout:
    """Without OCDBT each array is a directory named after its key path (joined with
    "."), which orbax and tensorstore join to the item's path: a key path of
    ``/elsewhere`` made orbax's own metadata() read ``/elsewhere``'s zarr metadata.
    The names are checked in ``_METADATA`` before orbax reads anything; a file that
    does not parse is left to orbax (a CheckpointCorruptError).

    Returns:
        The layout, decided as orbax decides it: OCDBT by ``_METADATA``'s ``use_ocdbt``
        when it gives one, else by whether ``manifest.ocdbt`` exists (an empty
        ``manifest.ocdbt`` beside ``"use_ocdbt": false`` skipped this check while orbax
        read each array by its name, a number from ``/elsewhere`` included); missing
        chunks filled unless ``store_array_data_equal_to_fill_value`` is true.
    """
    present = os.path.isfile(os.path.join(item, "manifest.ocdbt"))
    path = os.path.join(item, "_METADATA")
    try:
        meta = json.loads(read_capped(path, _MAX_METADATA))
    except RecursionError as exc:  # orbax's own parse of it would raise this too
        raise CheckpointCorruptError(f"{path}: JSON nested too deeply to read") from exc
    except CheckpointCorruptError:  # too large: orbax would read its names unchecked
        raise
    except (OSError, ValueError):  # orbax cannot read it either
        return Layout(present, False)
    if not isinstance(meta, dict):
        return Layout(present, False)
    flag = meta.get("use_ocdbt")
    layout = Layout(present if flag is None else bool(flag),
                    not meta.get("store_array_data_equal_to_fill_value", False))
    if layout.use_ocdbt:
        return layout
    try:
        entries = meta["tree_metadata"].values()
        names = [".".join(str(k["key"]) for k in e["key_metadata"]) for e in entries]
    except (ValueError, KeyError, TypeError, AttributeError):
        return layout
    bad = [n for n in names if outside(n)]
    if bad:
        raise UnsafeCheckpointError(
            f"{item}: the array names {', '.join(repr(n) for n in bad[:5])} in _METADATA are "
            "not names inside the checkpoint (each array is a directory of that name)")
    return layout


def key_impls(item: str) -> dict[str, str]:
    """Orbax's name of each typed-PRNG-key array -> its key implementation, from the
    ``ext_metadata`` of ``array_metadatas/process_*`` (orbax stores a key's data as a
    plain uint32 array and records the impl there). Best effort: a file that does not
    parse is ignored (the arrays then load as their key data)."""
    out: dict[str, str] = {}
    folder = os.path.join(item, "array_metadatas")
    try:
        names = [n for n in os.listdir(folder) if n.startswith("process_")]
    except OSError:
        return out
    for name in names:
        try:
            doc = json.loads(read_capped(os.path.join(folder, name), _MAX_METADATA))
            for entry in doc["array_metadatas"]:
                meta = entry["array_metadata"]
                impl = (meta.get("ext_metadata") or {}).get("random_key_impl")
                if type(impl) is str and type(meta["param_name"]) is str and impl.isidentifier():
                    out[meta["param_name"]] = impl
        except (CheckpointCorruptError, OSError, ValueError, KeyError, TypeError,
                AttributeError, RecursionError):
            continue
    return out
