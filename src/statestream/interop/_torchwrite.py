"""Write a torch.save zip file, streaming each tensor's bytes into its zip entry.

The pickle (``data.pkl``) names only what ``torch.load(weights_only=True)``
admits; tensors are written slab by slab into stored (uncompressed),
64-byte-aligned ``data/<n>`` entries, as torch.save lays them out. torch is
imported here only, when this writer runs.
"""

from __future__ import annotations

import collections
import io
import math
import os
import pickle
import shutil
import struct
import zipfile
from collections.abc import Sequence
from typing import Any

from statestream.errors import PickleNotAllowedError, UnsupportedTypeError
from statestream.format import itemsize_of
from statestream.interop._deps import require
from statestream.interop._torchfile import STORAGE_DTYPES
from statestream.interop._writers import ArraySpec, Slabs, _claim, _publish, _staging_path
from statestream.tree import KeyPath, Node, format_keypath

__all__ = ["pickle_state", "python_state", "small_bytes", "write_torch", "write_zip"]

_PREFIX = "archive"
_ALIGN = 64


class _Storage:
    def __init__(self, index: int) -> None:
        self.index = index


class _Tensor:
    def __init__(self, index: int, spec: ArraySpec) -> None:
        self.index, self.spec = index, spec


def python_state(node: Node, specs: Sequence[ArraySpec], small: dict[int, bytes],
                 p: KeyPath, seen: dict[int, _Tensor] | None = None) -> Any:
    """The Python object torch.load will return, tensors as placeholders.

    An alias (tied weights) is the same placeholder object as its array, so the
    pickle refers to it again, as torch.save does for a tensor named twice:
    stored once, and ``torch.load`` returns one tensor under both names."""
    seen = {} if seen is None else seen
    k = node.kind
    if k in ("none", "bool", "int", "float", "str"):
        return node.value
    if k in ("array", "alias"):
        i = node.array or 0
        if i not in seen:
            seen[i] = _Tensor(i, specs[i])
        return seen[i]
    if k == "bytes":
        return small[node.array or 0]
    if k == "pickle":
        raise PickleNotAllowedError(
            f"key path '{format_keypath(p)}' holds a pickled object; torch.load("
            "weights_only=True) could not read it back, so it is not converted")
    kids = node.children or []
    if k == "stateful":
        return python_state(kids[0], specs, small, p, seen)
    if k in ("list", "tuple"):
        vals = [python_state(c, specs, small, p + (i,), seen) for i, c in enumerate(kids)]
        return vals if k == "list" else tuple(vals)
    keys = node.keys or []
    return {key: python_state(c, specs, small, p + (key,), seen) for key, c in zip(keys, kids)}


def pickle_state(obj: Any) -> tuple[bytes, list[_Tensor]]:
    """Pickle as torch.save does: legacy storage classes and ``_rebuild_tensor_v2`` for the
    classic dtypes, ``UntypedStorage`` and ``_rebuild_tensor_v3`` for the newer ones."""
    torch = require("torch", "torch", "writing torch.save files")

    legacy = {d: name for name, d in STORAGE_DTYPES.items()}
    tensors: list[_Tensor] = []

    class Pickler(pickle.Pickler):
        def persistent_id(self, o: Any) -> Any:
            if not isinstance(o, _Storage):
                return None
            dtype, shape = tensors[o.index].spec
            if dtype in legacy:
                return ("storage", getattr(torch, legacy[dtype]), str(o.index), "cpu",
                        math.prod(shape))
            return ("storage", torch.storage.UntypedStorage, str(o.index), "cpu",
                    math.prod(shape) * itemsize_of(dtype))

        def reducer_override(self, o: Any) -> Any:
            if not isinstance(o, _Tensor):
                return NotImplemented
            tensors.append(o)
            dtype, shape = o.spec
            stride, acc = [], 1
            for n in reversed(shape):
                stride.append(acc)
                acc *= n
            args: tuple[Any, ...] = (_Storage(len(tensors) - 1), 0, torch.Size(shape),
                                     tuple(reversed(stride)), False, collections.OrderedDict())
            if dtype in legacy:
                return torch._utils._rebuild_tensor_v2, args
            tdt = getattr(torch, dtype, None)
            if not isinstance(tdt, torch.dtype):
                raise UnsupportedTypeError(f"torch has no dtype {dtype}")
            return torch._utils._rebuild_tensor_v3, args + (tdt,)

    buf = io.BytesIO()
    Pickler(buf, protocol=2).dump(obj)
    return buf.getvalue(), tensors


def _aligned_info(z: zipfile.ZipFile, name: str, size: int) -> zipfile.ZipInfo:
    info = zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0))
    info.compress_type = zipfile.ZIP_STORED
    info.file_size = size
    assert z.fp is not None
    zip64 = 20 if size * 1.05 > zipfile.ZIP64_LIMIT else 0
    at = z.fp.tell() + getattr(z.fp, "base", 0) + 30 + len(name.encode()) + zip64 + 4
    pad = -at % _ALIGN
    info.extra = struct.pack("<HH", 0xCAFE, pad) + b"Z" * pad
    return info


def write_torch(dst: str, root: Node, specs: Sequence[ArraySpec], slabs: Slabs, *,
                overwrite: bool) -> None:
    """A zip-format torch.save file that ``torch.load(weights_only=True)`` reads."""
    small = small_bytes(root, specs, slabs)
    data, tensors = pickle_state(python_state(root, specs, small, ()))
    _claim(dst, overwrite, directory=False)
    staging = _staging_path(dst)
    try:
        out = os.path.join(staging, "out.pt")
        with open(out, "wb") as f:
            write_zip(f, data, tensors, slabs)
            f.flush()
            os.fsync(f.fileno())
        _publish(out, dst)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


class _Window(io.RawIOBase):
    """A writable file seen from ``base``: a zip written here has offsets relative to it."""

    def __init__(self, f: Any) -> None:
        self.f: Any = f
        self.base: int = int(f.tell())

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return int(self.f.tell()) - self.base

    def seek(self, pos: int, whence: int = 0) -> int:
        if whence == 0:
            pos += self.base
        return int(self.f.seek(pos, whence)) - self.base

    def write(self, b: Any) -> int:
        return int(self.f.write(b))

    def flush(self) -> None:
        self.f.flush()


def write_zip(f: Any, data: bytes, tensors: list[_Tensor], slabs: Slabs) -> None:
    """A torch.save archive at ``f``'s position (offsets relative to it), tensors streamed."""
    import numpy as np

    with zipfile.ZipFile(_Window(f), "w", zipfile.ZIP_STORED) as z:
        z.writestr(f"{_PREFIX}/data.pkl", data)
        z.writestr(f"{_PREFIX}/byteorder", "little")
        for k, t in enumerate(tensors):
            size = math.prod(t.spec[1]) * itemsize_of(t.spec[0])
            with z.open(_aligned_info(z, f"{_PREFIX}/data/{k}", size), "w",
                        force_zip64=size * 1.05 > zipfile.ZIP64_LIMIT) as w:
                for _, buf in slabs(t.index):
                    w.write(memoryview(buf.reshape(-1).view(np.uint8).data))
                    del buf
        z.writestr(f"{_PREFIX}/version", "3\n")
    f.seek(0, 2)


def small_bytes(root: Node, specs: Sequence[ArraySpec], slabs: Slabs) -> dict[int, bytes]:
    """The contents of the tree's ``bytes`` leaves (they become Python bytes values)."""
    import numpy as np

    return {i: b"".join(bytes(b.reshape(-1).view(np.uint8)) for _, b in slabs(i))
            for i, (dtype, _) in enumerate(specs) if dtype == "uint8" and _is_bytes(root, i)}


def _is_bytes(node: Node, index: int) -> bool:
    if node.array == index:
        return node.kind == "bytes"
    return any(_is_bytes(c, index) for c in node.children or [])
