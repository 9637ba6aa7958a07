"""Write an Orbax checkpoint with orbax-checkpoint.

orbax-checkpoint takes a tree and holds its arrays until they are written, so a tree
larger than a quarter of the memory budget goes to orbax in batches, each one partial
save of the same checkpoint (``orbax.checkpoint.experimental.v1.partial``; a dict's
entries may go in different batches, a list goes whole), and the PyTree item the
finalized checkpoint holds is published. A tree within it goes in one
``StandardCheckpointer`` save. Either way ``StandardCheckpointer().restore(dst)``
reads the result.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import shutil
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

from statestream._memory import fresh_bytes
from statestream.errors import CheckpointError, UnsupportedTypeError, storage_error
from statestream.format import dtype_from_name, itemsize_of
from statestream.interop._deps import require
from statestream.interop._loopnoise import quiet_late_loop_callbacks
from statestream.interop._publish import claim, publish, staging_path, writing
from statestream.interop._writers import (
    ArraySpec,
    Slabs,
)
from statestream.tree import CONTAINER_KINDS, KeyPath, Node, format_keypath

__all__ = ["write_orbax"]


#: dtypes tensorstore (and so Orbax) cannot store, though JAX has them
_NOT_IN_TENSORSTORE = frozenset({"uint4", "uint2"})


def _unholdable(node: Node, specs: Sequence[ArraySpec], p: KeyPath, out: list[str]) -> None:
    """Key paths of leaves StandardCheckpointer refuses (strings, None, bytes, pickles,
    arrays of zero size, dtypes tensorstore has not)."""
    if node.kind in ("none", "str", "bytes", "pickle"):
        out.append(f"'{format_keypath(p)}' ({node.kind})")
    if isinstance(node.value, int) and not -(1 << 63) <= node.value < 1 << 63:
        # NumPy makes it an object array, which tensorstore refuses (a bare ValueError)
        out.append(f"'{format_keypath(p)}' (an int beyond 64 bits)")
    if node.kind == "array" and 0 in specs[node.array or 0][1]:
        out.append(f"'{format_keypath(p)}' (an empty array, shape {specs[node.array or 0][1]})")
    if node.kind == "array" and specs[node.array or 0][0] in _NOT_IN_TENSORSTORE:
        out.append(f"'{format_keypath(p)}' (dtype {specs[node.array or 0][0]}, which "
                   "tensorstore cannot store)")
    kids = node.children or []
    if node.kind == "stateful":
        for c in kids:
            _unholdable(c, specs, p, out)
        return
    if node.keys is not None and len({type(k) for k in node.keys}) > 1:
        # jax sorts a dict's keys: int against str fails inside orbax (a bare ValueError)
        out.append(f"'{format_keypath(p)}' (a mapping with both int and str keys)")
    keys = list(node.keys) if node.keys is not None else list(range(len(kids)))
    for key, c in zip(keys, kids):
        _unholdable(c, specs, p + (key,), out)


def _name_clashes(node: Node, p: KeyPath, seen: dict[str, KeyPath], out: list[str]) -> None:
    """Leaves that orbax would store under one name: it names a leaf by its key path
    joined with ``.`` (``param_name_from_keypath``), so ``{"a": {"b": x}, "a.b": y}``
    writes both as ``a.b`` and restores ``x`` under both names, ``y`` lost."""
    kids = node.children or []
    if node.kind == "stateful":
        for c in kids:
            _name_clashes(c, p, seen, out)
        return
    if node.kind in CONTAINER_KINDS:
        keys = list(node.keys) if node.keys is not None else list(range(len(kids)))
        for key, c in zip(keys, kids):
            _name_clashes(c, p + (key,), seen, out)
        return
    name = ".".join(str(k) for k in p)
    if "\0" in name:  # statestream's reader refuses such a name (not one inside the checkpoint)
        out.append(f"'{format_keypath(p)}' (a key with a NUL character)")
    if name in seen:
        out.append(f"'{format_keypath(seen[name])}' and '{format_keypath(p)}' (orbax names "
                   f"both {name!r}: one would be lost)")
    seen.setdefault(name, p)


def _tree(node: Node, specs: Sequence[ArraySpec], slabs: Slabs, p: KeyPath) -> Any:
    k = node.kind
    if k in ("none", "bool", "int", "float", "str"):
        return node.value
    if k == "array":
        dtype, shape = specs[node.array or 0]
        dt = dtype_from_name(dtype)
        out = fresh_bytes(math.prod(shape) * dt.itemsize).view(dt).reshape(shape)
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


def _units(node: Node, p: KeyPath) -> list[tuple[KeyPath, Node]]:
    """The subtrees an Orbax partial save can add one at a time: a dict's entries
    (recursively); a list or tuple whole (a partial save names dict keys, not
    positions), and so the root when it is not a dict."""
    if node.kind == "stateful":
        return _units((node.children or [])[0], p)
    if node.kind == "dict" and node.children:
        out: list[tuple[KeyPath, Node]] = []
        for key, c in zip(node.keys or [], node.children):
            out += _units(c, p + (key,))
        return out
    return [(p, node)]


def _array_bytes(node: Node, specs: Sequence[ArraySpec]) -> int:
    if node.kind == "array":
        dtype, shape = specs[node.array or 0]
        return math.prod(shape) * itemsize_of(dtype)
    return sum(_array_bytes(c, specs) for c in node.children or [])


def _batches(units: list[tuple[KeyPath, Node]], specs: Sequence[ArraySpec],
             batch_bytes: int) -> list[list[tuple[KeyPath, Node]]]:
    """Units in tree order, in batches of at most ``batch_bytes`` of arrays (a larger
    unit alone)."""
    out: list[list[tuple[KeyPath, Node]]] = [[]]
    held = 0
    for u in units:
        n = _array_bytes(u[1], specs)
        if out[-1] and held + n > batch_bytes:
            out.append([])
            held = 0
        out[-1].append(u)
        held += n
    return out


def write_orbax(dst: str, root: Node, specs: Sequence[ArraySpec], slabs: Slabs, *,
                overwrite: bool, batch_bytes: int = 1 << 62) -> None:
    """What ``orbax.checkpoint.StandardCheckpointer().restore(dst)`` reads, given to
    orbax at most ``batch_bytes`` of arrays at a time (one array or list larger than
    that goes alone)."""
    ocp = require("orbax.checkpoint", "orbax", "writing Orbax checkpoints")
    quiet_late_loop_callbacks()  # a failed orbax save abandons operations too
    bad: list[str] = []
    top = root
    while top.kind == "stateful" and top.children:
        top = top.children[0]
    if top.kind in ("int", "float", "bool"):  # StandardSave refuses a single scalar
        bad.append("'<root>' (a number as the whole state)")
    if top.kind in CONTAINER_KINDS and not top.children:
        # orbax refuses it ("Found empty item", a bare ValueError) from its thread,
        # which then wrote into the staging directory after it was removed
        bad.append(f"'<root>' (an empty {top.kind} as the whole state)")
    _unholdable(root, specs, (), bad)
    _name_clashes(root, (), {}, bad)
    if bad:
        raise UnsupportedTypeError(
            "an Orbax StandardCheckpointer checkpoint holds non-empty arrays and numbers "
            "(in dicts with keys of one type, lists and tuples) only, not the "
            f"values at key paths {', '.join(bad[:20])}{' and more' if len(bad) > 20 else ''}; "
            "leave them out with items=")
    claim(dst, overwrite, directory=True)
    batches = _batches(_units(root, ()), specs, batch_bytes)
    staging = staging_path(dst)
    try:
        out = os.path.join(staging, "out")
        with writing(out), _os_errors_of_tensorstore(out), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if len(batches) == 1:  # one tree: the plain StandardCheckpointer save
                ck = ocp.StandardCheckpointer()
                ck.save(out, _tree(root, specs, slabs, ()))
                ck.wait_until_finished()
                ck.close()
                item = out
            else:
                partial = require("orbax.checkpoint.experimental.v1", "orbax",
                                  "writing Orbax checkpoints").partial
                for batch in batches:
                    tree: dict[Any, Any] = {}
                    for path, node in batch:
                        _put(tree, path, _tree(node, specs, slabs, path))
                    partial.save(out, tree)
                    del tree  # written: its arrays go before the next batch is read
                partial.finalize(out)
                item = _pytree_item(out)
        publish(item, dst)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


#: how tensorstore (under orbax) reports a failed system call: a ValueError
#: ("... No space left on device [os_error_code='28']")
_TS_OS_ERROR = re.compile(r"os_error_code='(\d+)'")


@contextlib.contextmanager
def _os_errors_of_tensorstore(path: str) -> Iterator[None]:
    """A file system failure inside orbax (tensorstore's ValueError carrying the errno)
    raised as the StorageError that the other writers raise, with that errno."""
    try:
        yield
    except ValueError as exc:
        code = _TS_OS_ERROR.search(str(exc))
        if code is None:
            raise
        raise storage_error(f"writing the Orbax checkpoint {path} failed: {exc}",
                            int(code.group(1))) from exc


def _put(tree: dict[Any, Any], path: KeyPath, value: Any) -> None:
    d = tree
    for k in path[:-1]:
        d = d.setdefault(k, {})
    d[path[-1]] = value


def _pytree_item(out: str) -> str:
    """The directory of the PyTree item a finalized partial save made in ``out``."""
    items = [e.path for e in os.scandir(out) if e.is_dir(follow_symlinks=False)
             and os.path.isfile(os.path.join(e.path, "_METADATA"))]
    if len(items) != 1:
        raise CheckpointError(f"{out}: orbax's partial save made {len(items)} PyTree items, "
                              "not one")
    return items[0]
