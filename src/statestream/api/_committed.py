"""Did a multi-process save commit? Asked by survivors when the last agreement fails.

After rank 0 commits, every rank still agrees once more; if rank 0 (or any
rank) dies right then, the others' collective fails although the checkpoint
is complete. They read what is committed at the path and compare it with what
this save's ranks told each other (every rank holds all of it after the last
all-gather before the commit): the same tree, plain values and arrays, the
same data files with the same sizes, every chunk at the same place with the
same checksum, and the same user metadata. Only then is the save reported as done. An older
checkpoint left at the path (``overwrite=True``, commit never reached) differs
in some of that unless it holds exactly this state, byte for byte.
"""

from __future__ import annotations

import json
import os
from typing import Any

from statestream.api._load import open_checkpoint
from statestream.format import Manifest, encode_tree
from statestream.tree import Key, format_keypath

__all__ = ["committed_as_saved"]

#: A node's place: (key type, key) steps; ("stateful",) for a stateful wrapper.
_Place = tuple[tuple[Any, ...], ...]


def committed_as_saved(path: str | os.PathLike[str], gathered: list[Any],
                       tables: list[Any], user_meta: Any = None) -> bool:
    """Whether ``path`` holds a committed checkpoint that is exactly this save's.

    Args:
        path: where the save commits.
        gathered: every rank's ``{"arrays": [[key, dtype, shape, boxes]...],
            "tree": keyed encoded tree}``, in rank order (the plan's all-gather).
        tables: every rank's ``{"files": [[name, size]...], "arrays": {key:
            [[file, offset, nbytes, crc, start, shape, blocks]...]}}``, in rank
            order (the all-gather just before the commit).
        user_meta: the save's user metadata (``meta["user"]`` of the manifest).
    """
    try:
        reader, m = open_checkpoint(path)
    except Exception:  # not committed (or unreadable): not known to be this save
        return False
    reader.close()
    if _canonical(m.meta.get("user")) != _canonical(user_meta):
        return False
    return _matches(m, gathered, tables)


def _canonical(doc: Any) -> str:
    return json.dumps(doc, sort_keys=True, default=repr)


def _matches(m: Manifest, gathered: list[Any], tables: list[Any]) -> bool:
    have: dict[_Place, Any] = {}
    arrays: dict[str, int] = {}
    _entries(encode_tree(m.tree), (), (), have, arrays)
    want: dict[_Place, Any] = {}
    for g in gathered:  # rank order: the lowest rank's plain value is the one kept
        _entries(g["tree"], (), (), want, {})
    if have != want:
        return False
    if {(f.name, f.size) for f in m.files} != {(n, s) for t in tables for n, s in t["files"]}:
        return False
    described: dict[str, tuple[str, tuple[int, ...]]] = {}
    for g in gathered:
        for key, dtype, shape, _ in g["arrays"]:
            described.setdefault(key, (dtype, tuple(shape)))
    rows: dict[str, set[tuple[Any, ...]]] = {}
    for t in tables:
        for key, rs in t["arrays"].items():
            rows.setdefault(key, set()).update(
                (n, off, nb, crc, tuple(st), tuple(sh), tuple(bl))
                for n, off, nb, crc, st, sh, bl in rs)
    if set(arrays) != set(described):
        return False
    for key, index in arrays.items():
        a = m.arrays[index]
        if (a.dtype, a.shape) != described[key]:
            return False
        got = {(m.files[c.file].name, c.offset, c.nbytes, c.checksum, c.start, c.shape,
                c.block_checksums) for c in a.chunks}
        if got != rows.get(key, set()):
            return False
    return True


def _entries(doc: Any, place: _Place, keys: tuple[Key, ...], out: dict[_Place, Any],
             arrays: dict[str, int]) -> None:
    """Every node of an encoded tree by its place (first one seen wins, as merging does)."""
    t = doc["t"]
    if "a" in doc:  # an array leaf: named by its key path, wherever its data lives
        kp = format_keypath(keys)
        out.setdefault(place, ("array", t, kp, json.dumps(doc.get("x"), sort_keys=True)))
        if isinstance(doc["a"], int):
            arrays[kp] = doc["a"]
        return
    if "c" not in doc:
        out.setdefault(place, ("value", t, doc.get("v")))
        return
    out.setdefault(place, ("container", t, doc.get("n")))
    if t == "stateful":
        for c in doc["c"]:
            _entries(c, place + (("stateful",),), keys, out, arrays)
        return
    ks = doc["k"] if "k" in doc else range(len(doc["c"]))
    for k, c in zip(ks, doc["c"]):
        _entries(c, place + ((type(k).__name__, k),), keys + (k,), out, arrays)
