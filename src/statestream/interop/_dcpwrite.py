"""Write a PyTorch DCP directory that ``torch.distributed.checkpoint.load`` reads.

One data file ``__0_0.distcp``: each tensor is a small torch.save archive
(what DCP's FileSystemReader hands to ``torch.load``) streamed slab by slab;
each non-tensor value a torch.save of the plain value. ``.metadata`` is
DCP's own ``Metadata`` with ``planner_data`` giving every key's path, written
last, so a directory without it is not a checkpoint. torch is imported here
only, when this writer runs.
"""

from __future__ import annotations

import os
import pickle
import shutil
import warnings
from collections.abc import Sequence
from typing import Any

from statestream.errors import UnsupportedTypeError
from statestream.interop._deps import require
from statestream.interop._publish import claim, publish, staging_path, writing
from statestream.interop._torchwrite import (
    _Tensor,
    check_torch_dtypes,
    pickle_state,
    python_state,
    small_bytes,
    with_big_bytes,
    write_zip,
)
from statestream.interop._writers import (
    ArraySpec,
    Slabs,
)
from statestream.tree import Key, KeyPath, Node, format_keypath

__all__ = ["write_dcp"]

DATA_NAME = "__0_0.distcp"


_MAPPINGS = ("dict", "namedtuple", "dataclass", "pytree")


def _walked(node: Node) -> bool:
    """Whether DCP's flattening walks into ``node`` (``_traverse``'s ``_is_terminal``):
    a mapping always; a list only when it holds a tensor, a mapping or such a list,
    so a list of plain values (an optimizer's ``params``) is one item, as ``dcp.save``
    and ``dcp.load`` flatten it."""
    if node.kind == "stateful" or node.kind in _MAPPINGS:
        return True
    if node.kind != "list":
        return False
    return any(c.kind == "array" or _walked(c) for c in node.children or [])


def _items(node: Node, p: KeyPath, out: list[tuple[KeyPath, Node]],
           empty: list[KeyPath], at: KeyPath = ()) -> None:
    """DCP's flattening: mappings and lists holding tensors or mappings are walked,
    anything else is one item. ``p``: the planner path (mapping keys as str); ``at``:
    the key path; ``empty``: the empty mappings, which hold no item (left out)."""
    if node.kind == "stateful":
        _items((node.children or [])[0], p, out, empty, at)
        return
    kids = node.children or []
    if node.kind == "list" and _walked(node):
        for i, c in enumerate(kids):
            n = len(out)
            _items(c, p + (i,), out, empty, at + (i,))
            if len(out) == n:  # dcp.load of what dcp.save writes then fails too
                raise UnsupportedTypeError(
                    f"key path '{format_keypath(at + (i,))}' is an empty dict (or holds "
                    "only empty dicts) inside a list holding tensors: DCP stores no item "
                    "for it, so the list cannot be read back (dcp.load into a matching "
                    "state dict fails with 'Missing key'); remove it or store the list "
                    "as a dict to convert")
    elif node.kind in _MAPPINGS:  # DCP's planner paths hold mapping keys as str
        if not kids:
            empty.append(at)
        seen: dict[str, Key] = {}
        for k, c in zip(node.keys or [], kids):
            if str(k) in seen:  # their items would nest in (or merge with) each other
                raise UnsupportedTypeError(
                    f"the mapping at key path '{format_keypath(at)}' has the keys "
                    f"{seen[str(k)]!r} and {k!r}, which DCP stores alike (its dict keys "
                    "are str): what they hold would nest in or merge with each other "
                    "when read; rename one to convert")
            seen[str(k)] = k
            _items(c, p + (str(k),), out, empty, at + (k,))
    else:
        out.append((p, node))


def _warn_empty(empty: list[KeyPath], dst: str) -> None:
    """An empty dict holds no DCP item: say which are left out (dcp.save drops them too)."""
    if not empty:
        return
    names = ", ".join(f"'{format_keypath(p)}'" for p in empty[:8])
    more = f" and {len(empty) - 8} more" if len(empty) > 8 else ""
    warnings.warn(
        f"converting to DCP leaves out empty dicts, which DCP cannot store (dcp.save "
        f"drops them too): key path(s) {names}{more} are not in {dst}. dcp.load into a "
        "state dict that has them leaves them as they are; read without one (ss.load, "
        "convert back) they are missing (docs/interop.md)", UserWarning, stacklevel=4)


def _has_array(node: Node) -> bool:
    """Whether ``node`` holds a tensor. ``bytes`` leaves (whose data is an array of the
    checkpoint, too) are plain values: they go into the item's pickle."""
    return node.kind in ("array", "alias") or any(_has_array(c) for c in node.children or [])


def write_dcp(dst: str, root: Node, specs: Sequence[ArraySpec], slabs: Slabs, *,
              overwrite: bool) -> None:
    """A single-rank DCP checkpoint directory at ``dst``."""
    torch = require("torch", "torch", "writing DCP checkpoints")
    md = require("torch.distributed.checkpoint.metadata", "torch", "writing DCP checkpoints")
    storage_info = require("torch.distributed.checkpoint.filesystem", "torch",
                           "writing DCP checkpoints")._StorageInfo

    check_torch_dtypes(root, specs, "DCP")
    items: list[tuple[KeyPath, Node]] = []
    empty: list[KeyPath] = []
    _items(root, (), items, empty)
    fqns: dict[str, KeyPath] = {}
    for p, node in items:
        fqn = ".".join(str(k) for k in p)
        if fqn in fqns:
            raise UnsupportedTypeError(
                f"key paths '{format_keypath(fqns[fqn])}' and '{format_keypath(p)}' both "
                f"become the DCP key {fqn!r}; rename one to convert")
        if node.kind != "array" and _has_array(node):
            raise UnsupportedTypeError(
                f"key path '{format_keypath(p)}' is a {node.kind} holding arrays, which DCP "
                "stores only inside dicts and lists")
        fqns[fqn] = p
    _warn_empty(empty, dst)
    small = small_bytes(root, specs, slabs)
    claim(dst, overwrite, directory=True)
    staging = staging_path(dst)
    try:
        sdm: dict[str, Any] = {}
        storage: dict[Any, Any] = {}
        data_path = os.path.join(staging, DATA_NAME)
        with writing(data_path), open(data_path, "wb") as f:
            for fqn, (p, node) in zip(fqns, items):
                start = f.tell()
                if node.kind == "array":
                    dtype, shape = specs[node.array or 0]
                    data, tensors = pickle_state(_Tensor(node.array or 0, (dtype, shape)))
                    write_zip(f, data, tensors, slabs)
                    zeros = torch.Size([0] * len(shape))
                    sdm[fqn] = md.TensorStorageMetadata(
                        properties=md.TensorProperties(dtype=getattr(torch, dtype)),
                        size=torch.Size(shape),
                        chunks=[md.ChunkStorageMetadata(offsets=zeros, sizes=torch.Size(shape))])
                    index = md.MetadataIndex(fqn, zeros, 0)
                else:  # what torch.save writes, its large bytes values streamed
                    data, tensors = pickle_state(python_state(node, specs, small, p))
                    write_zip(f, with_big_bytes(data, node, specs, slabs, small), tensors,
                              slabs)
                    sdm[fqn] = md.BytesStorageMetadata()
                    index = md.MetadataIndex(fqn)
                storage[index] = storage_info(DATA_NAME, start, f.tell() - start)
            f.flush()
            os.fsync(f.fileno())
        planner = {fqn: tuple(p) for fqn, p in fqns.items()}  # ints: list indices
        meta = md.Metadata(state_dict_metadata=sdm, planner_data=planner,
                           storage_data=storage, storage_meta=md.StorageMeta())
        meta_path = os.path.join(staging, ".metadata")
        with writing(meta_path), open(meta_path, "wb") as f:
            pickle.dump(meta, f)
            f.flush()
            os.fsync(f.fileno())
        publish(staging, dst)
        staging = ""
    finally:
        if staging:
            shutil.rmtree(staging, ignore_errors=True)

