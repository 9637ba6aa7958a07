"""Write an Orbax checkpoint with orbax-checkpoint's ``StandardCheckpointer``.

orbax-checkpoint takes the whole tree at once, so this writer assembles
every array in memory first (docs/interop.md says so); it is the one writer
that does not stream.
"""

from __future__ import annotations

import os
import shutil
import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np

from statestream.errors import UnsupportedTypeError
from statestream.format import dtype_from_name
from statestream.interop._deps import require
from statestream.interop._writers import ArraySpec, Slabs, _claim, _publish, _staging_path
from statestream.tree import KeyPath, Node, format_keypath

__all__ = ["write_orbax"]


def _unholdable(node: Node, specs: Sequence[ArraySpec], p: KeyPath, out: list[str]) -> None:
    """Key paths of leaves StandardCheckpointer refuses (strings, None, bytes, pickles,
    arrays of zero size)."""
    if node.kind in ("none", "str", "bytes", "pickle"):
        out.append(f"'{format_keypath(p)}' ({node.kind})")
    if node.kind == "array" and 0 in specs[node.array or 0][1]:
        out.append(f"'{format_keypath(p)}' (an empty array, shape {specs[node.array or 0][1]})")
    kids = node.children or []
    if node.kind == "stateful":
        for c in kids:
            _unholdable(c, specs, p, out)
        return
    keys = list(node.keys) if node.keys is not None else list(range(len(kids)))
    for key, c in zip(keys, kids):
        _unholdable(c, specs, p + (key,), out)


def _tree(node: Node, specs: Sequence[ArraySpec], slabs: Slabs, p: KeyPath) -> Any:
    k = node.kind
    if k in ("none", "bool", "int", "float", "str"):
        return node.value
    if k == "array":
        dtype, shape = specs[node.array or 0]
        out = np.empty(shape, dtype_from_name(dtype))
        for row, buf in slabs(node.array or 0):
            if shape:
                out[row:row + buf.shape[0]] = buf
            else:
                out[...] = buf
        return out
    if k in ("bytes", "pickle"):
        raise UnsupportedTypeError(
            f"key path '{format_keypath(p)}' holds {k}, which an Orbax checkpoint cannot hold")
    kids = node.children or []
    if k == "stateful":
        return _tree(kids[0], specs, slabs, p)
    if k in ("list", "tuple"):
        vals = [_tree(c, specs, slabs, p + (i,)) for i, c in enumerate(kids)]
        return vals if k == "list" else tuple(vals)
    return {key: _tree(c, specs, slabs, p + (key,)) for key, c in zip(node.keys or [], kids)}


def write_orbax(dst: str, root: Node, specs: Sequence[ArraySpec], slabs: Slabs, *,
                overwrite: bool) -> None:
    """What ``orbax.checkpoint.StandardCheckpointer().restore(dst)`` reads."""
    ocp = require("orbax.checkpoint", "orbax", "writing Orbax checkpoints")
    bad: list[str] = []
    _unholdable(root, specs, (), bad)
    if bad:
        raise UnsupportedTypeError(
            "an Orbax StandardCheckpointer checkpoint holds non-empty arrays and numbers only, "
            "not the "
            f"values at key paths {', '.join(bad[:20])}{' and more' if len(bad) > 20 else ''}; "
            "leave them out with items=")
    _claim(dst, overwrite, directory=True)
    tree = _tree(root, specs, slabs, ())
    staging = _staging_path(dst)
    try:
        out = os.path.join(staging, "out")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ck = ocp.StandardCheckpointer()
            ck.save(out, tree)
            ck.wait_until_finished()
            ck.close()
        _publish(out, dst)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
