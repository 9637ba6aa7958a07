"""Write a torch.save zip file, streaming each tensor's bytes into its zip entry.

The pickle (``data.pkl``) names only what ``torch.load(weights_only=True)``
admits; tensors are written slab by slab into stored (uncompressed),
64-byte-aligned ``data/<n>`` entries, as torch.save lays them out, and a large
``bytes`` value is written into the pickle itself slab by slab
(:class:`StreamedPickle`). torch is imported here only, when this writer runs.
"""

from __future__ import annotations

import collections
import io
import math
import os
import pickle
import shutil
import struct
import uuid
import zipfile
from collections.abc import Sequence
from typing import Any

from statestream.errors import PickleNotAllowedError, UnsupportedTypeError
from statestream.format import itemsize_of
from statestream.interop._deps import require
from statestream.interop._publish import claim, publish, staging_path, writing
from statestream.interop._torchfile import STORAGE_DTYPES
from statestream.interop._writers import (
    ArraySpec,
    Slabs,
    array_paths,
)
from statestream.tree import KeyPath, Node, format_keypath

__all__ = ["StreamedPickle", "big_marker", "check_torch_dtypes", "pickle_state",
           "python_state", "small_bytes", "with_big_bytes", "write_torch", "write_zip"]

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
        i = node.array or 0
        return small[i] if i in small else big_marker(i)
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


def check_torch_dtypes(root: Node, specs: Sequence[ArraySpec], fmt: str) -> None:
    """Refuse arrays of dtypes torch has not (``float4_e2m1fn``, ``float8_e3m4``, ...)
    naming their key paths, before anything is written (the pickler named only the dtype)."""
    torch = require("torch", "torch", f"writing {fmt} checkpoints")
    legacy = set(STORAGE_DTYPES.values())
    bad = [f"'{format_keypath(p)}' ({specs[n.array or 0][0]})" for p, n in array_paths(root)
           if n.kind in ("array", "alias") and specs[n.array or 0][0] not in legacy
           and not isinstance(getattr(torch, specs[n.array or 0][0], None), torch.dtype)]
    if bad:
        raise UnsupportedTypeError(
            f"{fmt} cannot hold the dtype of the arrays at key paths {', '.join(bad[:20])}"
            f"{' and more' if len(bad) > 20 else ''}: torch has no such dtype")


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
    check_torch_dtypes(root, specs, "torch.save")
    small = small_bytes(root, specs, slabs)
    raw, tensors = pickle_state(python_state(root, specs, small, ()))
    data = with_big_bytes(raw, root, specs, slabs, small)
    claim(dst, overwrite, directory=False)
    staging = staging_path(dst)
    try:
        out = os.path.join(staging, "out.pt")
        with writing(out), open(out, "wb") as f:
            write_zip(f, data, tensors, slabs)
            f.flush()
            os.fsync(f.fileno())
        publish(out, dst)
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


def write_zip(f: Any, data: bytes | StreamedPickle, tensors: list[_Tensor],
              slabs: Slabs) -> None:
    """A torch.save archive at ``f``'s position (offsets relative to it), tensors streamed
    (and large ``bytes`` values of the pickle, :class:`StreamedPickle`)."""
    import numpy as np

    with zipfile.ZipFile(_Window(f), "w", zipfile.ZIP_STORED) as z:
        if isinstance(data, StreamedPickle):
            info = zipfile.ZipInfo(f"{_PREFIX}/data.pkl", date_time=(1980, 1, 1, 0, 0, 0))
            info.file_size = data.size
            with z.open(info, "w", force_zip64=data.size * 1.05 > zipfile.ZIP64_LIMIT) as w:
                data.write_to(w, slabs)
        else:
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
    """The contents of the tree's ``bytes`` leaves of at most ``INLINE_BYTES`` (they
    become Python bytes values in the pickle); larger ones are streamed into it
    (:func:`with_big_bytes`), and so are empty ones: protocol 2 pickles ``b""`` as
    ``bytes()``, which torch.load(weights_only=True) refuses."""
    import numpy as np

    return {i: b"".join(bytes(b.reshape(-1).view(np.uint8)) for _, b in slabs(i))
            for i in sorted(_bytes_leaves(root)) if 0 < math.prod(specs[i][1]) <= INLINE_BYTES}


#: A ``bytes`` leaf up to this size is pickled as a Python value; a larger one is
#: written into the pickle slab by slab (:class:`StreamedPickle`).
INLINE_BYTES = 1 << 20
_MARK = "\x00statestream-bytes-" + uuid.uuid4().hex + "-"
#: How protocol 2 pickles bytes (and torch.load(weights_only=True) allows):
#: ``_codecs.encode(text, "latin1")`` with the bytes as latin-1 text (UTF-8 in the pickle).
_ENCODE = b"c_codecs\nencode\n"
_LATIN1 = b"X" + struct.pack("<I", 6) + b"latin1" + b"\x86R"  # the argument, TUPLE2, REDUCE


def big_marker(index: int) -> str:
    """The string that stands for large ``bytes`` leaf ``index`` in a pickle until
    :func:`with_big_bytes` writes the leaf in its place."""
    return f"{_MARK}{index}\x00"


class StreamedPickle:
    """A pickle whose large ``bytes`` values are read from the source as it is written:
    ``pieces`` are the pickle's own bytes and, between them, the index of a leaf and the
    length of its latin-1 text in UTF-8 (each byte of 0x80 or more takes two)."""

    def __init__(self, pieces: list[bytes | tuple[int, int]]) -> None:
        self.pieces = pieces
        self.size = sum(len(p) if isinstance(p, bytes)
                        else len(_ENCODE) + 5 + p[1] + len(_LATIN1) for p in pieces)

    def write_to(self, w: Any, slabs: Slabs) -> None:
        import numpy as np

        for p in self.pieces:
            if isinstance(p, bytes):
                w.write(p)
                continue
            w.write(_ENCODE + b"X" + struct.pack("<I", p[1]))
            for _, buf in slabs(p[0]):
                flat = buf.reshape(-1).view(np.uint8)
                for at in range(0, flat.size, 4 << 20):  # the text costs 3x: pieces of 4 MiB
                    w.write(bytes(flat[at:at + (4 << 20)]).decode("latin-1").encode("utf-8"))
                del buf
            w.write(_LATIN1)


def with_big_bytes(data: bytes, root: Node, specs: Sequence[ArraySpec], slabs: Slabs,
                   small: dict[int, bytes]) -> bytes | StreamedPickle:
    """``data`` (a pickle of :func:`python_state` with ``small``) with each large ``bytes``
    leaf's marker replaced by the leaf itself, streamed (``data`` when there are none).

    The leaf is read twice: once to count the bytes of 0x80 or more (the text's
    length comes first), once as it is written."""
    import numpy as np

    found = []  # (where the leaf's marker is in the pickle, its opcode's length, the leaf)
    for i in _bytes_leaves(root) - small.keys():
        mark = big_marker(i).encode()
        op = b"X" + struct.pack("<I", len(mark)) + mark  # BINUNICODE of the marker
        at = data.find(op)
        if at >= 0:  # a leaf the pickled value does not reach is not written
            found.append((at, len(op), i))
    if not found:
        return data
    pieces: list[bytes | tuple[int, int]] = []
    end = 0
    for at, oplen, i in sorted(found):
        n = 0
        for _, buf in slabs(i):
            flat = buf.reshape(-1).view(np.uint8)
            n += flat.size + int(np.count_nonzero(flat >= 0x80))
            del buf
        if n >= 1 << 32:
            raise UnsupportedTypeError(
                f"a bytes value of {n} bytes as pickled text is too large for a torch.save "
                "pickle (protocol 2 holds up to 4 GiB)")
        pieces += [data[end:at], (i, n)]
        end = at + oplen
    return StreamedPickle(pieces + [data[end:]])


def _bytes_leaves(node: Node, out: set[int] | None = None) -> set[int]:
    """The array indices of the ``bytes`` leaves under ``node``."""
    out = set() if out is None else out
    if node.kind == "bytes":
        out.add(node.array or 0)
    for c in node.children or []:
        _bytes_leaves(c, out)
    return out
