"""torch.save files (zip format) read without torch: a restricted unpickler, byte ranges.

``data.pkl`` is unpickled by :class:`RestrictedUnpickler`, which resolves
only the globals ``torch.load(weights_only=True)`` admits for plain state
(tensor rebuild functions, storage and dtype names, ``OrderedDict``,
``torch.Size``, ``torch.device``, a few builtins) -- and resolves them to
our own inert stand-ins, never to torch. Tensors become byte ranges of the
zip's ``data/<key>`` entries (stored, not compressed), read straight into
destination buffers.
"""

from __future__ import annotations

import _compat_pickle
import collections
import dataclasses
import io
import math
import os
import pickle
import pickletools
import struct
import zipfile
from collections.abc import Callable
from typing import Any

from statestream.errors import (
    CheckpointCorruptError,
    CheckpointError,
    PickleNotAllowedError,
    UnsupportedTypeError,
)
from statestream.format import DTYPE_NAMES, ArrayEntry, FileEntry, Manifest, itemsize_of
from statestream.interop._chunks import check_shape, check_stored_bytes, row_chunks
from statestream.interop._files import ZIP_ERRORS, FileSetReader, open_binary
from statestream.tree import Key, KeyPath, Node, format_keypath

__all__ = ["Expansion", "RestrictedUnpickler", "looks_like_torch_zip", "open_torch_file",
           "to_node"]

MAX_PICKLE_BYTES = 1 << 30
MAX_ZIP_ENTRIES = 1 << 22

#: torch's legacy storage classes -> dtype names
STORAGE_DTYPES = {
    "DoubleStorage": "float64", "FloatStorage": "float32", "HalfStorage": "float16",
    "LongStorage": "int64", "IntStorage": "int32", "ShortStorage": "int16",
    "CharStorage": "int8", "ByteStorage": "uint8", "BoolStorage": "bool",
    "BFloat16Storage": "bfloat16", "ComplexDoubleStorage": "complex128",
    "ComplexFloatStorage": "complex64",
}
#: torch dtype attribute names -> dtype names (aliases included)
TORCH_DTYPES = {n: n for n in DTYPE_NAMES} | {
    "float": "float32", "double": "float64", "half": "float16", "long": "int64",
    "int": "int32", "short": "int16", "cfloat": "complex64", "cdouble": "complex128",
}
#: torch dtypes statestream does not hold: recognised by name (an inert :class:`DType`),
#: so a tensor of one is refused as unsupported, not as foreign code or damage
UNSUPPORTED_TORCH_DTYPES = {"chalf": "complex32"} | {n: n for n in (
    "complex32", "quint8", "qint8", "qint32", "quint4x2", "quint2x4", "bits1x8", "bits2x4",
    "bits4x2", "bits8", "bits16", "float4_e2m1fn_x2", "int1", "int3", "int5", "int6", "int7",
    "uint1", "uint3", "uint5", "uint6", "uint7")}
#: torch's quantized storage classes (their dtype names are unsupported ones above)
QUANTIZED_STORAGES = frozenset(
    {"QUInt8Storage", "QInt8Storage", "QInt32Storage", "QUInt4x2Storage", "QUInt2x4Storage"})


@dataclasses.dataclass(frozen=True)
class StorageType:
    """Stand-in for a torch storage class (or a dtype: ``dtype`` is its element type)."""

    dtype: str


@dataclasses.dataclass(frozen=True)
class DType:
    """Stand-in for a ``torch.dtype`` value."""

    name: str

    def __str__(self) -> str:
        return f"torch.{self.name}"


@dataclasses.dataclass(frozen=True)
class StorageRef:
    key: str
    dtype: str
    numel: int


@dataclasses.dataclass(frozen=True)
class TensorRef:
    """A tensor of the file: a view of a storage (element offset, shape, strides)."""

    storage: StorageRef
    offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: str


@dataclasses.dataclass(frozen=True)
class UnsupportedTensor:
    """Stand-in for a tensor statestream cannot hold (sparse, nested, quantized, meta):
    what it is, refused with its key path once the tree is built."""

    what: str
    fix: str = ""


def _ints(x: Any, what: str) -> tuple[int, ...]:
    if not isinstance(x, (tuple, list)) or any(type(v) is not int or v < 0 for v in x):
        raise CheckpointCorruptError(f"tensor {what} {x!r:.80} is not a tuple of integers")
    return tuple(x)


def check_row_major(t: TensorRef, where: str, fix: str) -> None:
    """Refuse a tensor whose strides are not row-major (a transposed or sliced view):
    statestream reads a tensor's bytes in row-major order, so it would be scrambled.

    Raises:
        UnsupportedTypeError: a non-contiguous view (``fix`` says what to do).
        CheckpointCorruptError: size and stride differ in length.
    """
    if len(t.shape) != len(t.stride):
        raise CheckpointCorruptError(f"{where}: size and stride differ in length")
    if not math.prod(t.shape):  # no element to scramble; torch calls any strides contiguous
        return
    expect, acc = [], 1
    for n in reversed(t.shape):
        expect.append(acc)
        acc *= n
    if any(n > 1 and s != e for n, s, e in zip(t.shape, t.stride, reversed(expect))):
        raise UnsupportedTypeError(
            f"{where} is a non-contiguous view (size {t.shape}, stride {t.stride}); {fix}")


def _rebuild_v2(storage: Any, offset: Any, size: Any, stride: Any, *rest: Any) -> TensorRef:
    if not isinstance(storage, StorageRef) or type(offset) is not int or offset < 0:
        raise CheckpointCorruptError("a tensor is rebuilt from something that is not a storage")
    return TensorRef(storage, offset, _ints(size, "size"), _ints(stride, "stride"),
                     storage.dtype)


def _rebuild_v3(storage: Any, offset: Any, size: Any, stride: Any, requires_grad: Any,
                hooks: Any, dtype: Any, *rest: Any) -> TensorRef:
    t = _rebuild_v2(storage, offset, size, stride)
    if not isinstance(dtype, DType):
        raise CheckpointCorruptError(f"tensor dtype {dtype!r:.80} is not a torch dtype")
    return dataclasses.replace(t, dtype=dtype.name)


def _rebuild_parameter(data: Any, *rest: Any) -> Any:
    return data


def _layout(name: Any) -> str:
    """``torch.serialization._get_layout``: the layout's name (``"torch.sparse_coo"``)."""
    return name if type(name) is str else "an unknown layout"


def _rebuild_sparse(layout: Any, *rest: Any) -> UnsupportedTensor:
    return UnsupportedTensor(f"sparse tensor ({layout if type(layout) is str else 'sparse'})",
                             "save tensor.to_dense() to convert it")


def _unsupported(what: str, fix: str = "") -> Callable[..., UnsupportedTensor]:
    return lambda *args: UnsupportedTensor(what, fix)


def _device(kind: Any, index: Any = None) -> str:
    return str(kind) if index is None else f"{kind}:{index}"


def _bytearray(*args: Any) -> bytearray:
    """``bytearray`` as a pickle rebuilds one: from bytes, or from text and its encoding
    (protocol 2) -- never from a count, which would allocate that many bytes."""
    if not args or (len(args) == 1 and type(args[0]) is bytes):
        return bytearray(*args)
    if len(args) == 2 and type(args[0]) is str:
        return bytearray(_encode(*args))
    raise CheckpointCorruptError(f"bytearray{args!r:.80} is not how a pickle rebuilds one")


def _encode(text: Any, encoding: Any = "utf-8") -> bytes:
    if type(text) is not str or encoding not in ("latin1", "latin-1", "utf-8", "utf8"):
        raise PickleNotAllowedError(f"_codecs.encode with encoding {encoding!r:.40} refused")
    return text.encode(encoding)


_SAFE: dict[tuple[str, str], Any] = {
    ("collections", "OrderedDict"): collections.OrderedDict,
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild_v2,
    ("torch._utils", "_rebuild_tensor_v3"): _rebuild_v3,
    ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
    ("torch._utils", "_rebuild_parameter_with_state"): _rebuild_parameter,
    ("torch", "Size"): tuple,
    ("torch", "device"): _device,
    ("builtins", "set"): set,
    ("builtins", "frozenset"): frozenset,
    ("builtins", "complex"): complex,
    ("builtins", "bytearray"): _bytearray,
    ("_codecs", "encode"): _encode,
}

#: torch.load(weights_only=True) rebuilds these, but statestream cannot hold what they
#: make: inert stand-ins (never torch's), even with allow_pickle, so such a tensor is
#: refused by name and key path rather than as foreign code or a damaged file
_UNSUPPORTED: dict[tuple[str, str], Any] = {
    ("torch.serialization", "_get_layout"): _layout,
    ("torch._utils", "_rebuild_sparse_tensor"): _rebuild_sparse,
    ("torch._utils", "_rebuild_nested_tensor"): _unsupported(
        "nested tensor", "save its tensor.unbind() pieces to convert it"),
    ("torch._utils", "_rebuild_meta_tensor_no_storage"): _unsupported(
        "meta tensor (it has no data)"),
    ("torch._utils", "_rebuild_qtensor"): _unsupported(
        "quantized tensor", "save tensor.dequantize() to convert it"),
}
#: torch's quantization schemes (values, in a quantized tensor's pickle)
_QSCHEMES = frozenset({"per_tensor_affine", "per_channel_affine", "per_tensor_symmetric",
                       "per_channel_symmetric", "per_channel_affine_float_qparams"})

#: Opcodes that store into the unpickler's memo at an index the pickle chooses.
_PUTS = frozenset({"PUT", "BINPUT", "LONG_BINPUT"})


def _check_memo(data: bytes, where: str) -> None:
    """Refuse a pickle that stores into the memo at an index beyond its opcode count.

    Python's unpickler grows its memo table to twice the largest index it is
    given (8 bytes each) before storing, so one LONG_BINPUT of 2**31 in a
    15-byte pickle would allocate 32 GiB; a pickler numbers entries from 0.
    """
    try:
        for n, (op, arg, _) in enumerate(pickletools.genops(data)):
            if op.name in _PUTS and isinstance(arg, int) and arg > n:
                raise CheckpointCorruptError(
                    f"{where}: the pickle stores memo entry {arg} after {n} opcodes "
                    "(a pickler numbers them from 0); refusing to allocate for it")
    except CheckpointCorruptError:
        raise
    except Exception as exc:
        raise CheckpointCorruptError(f"{where} is not a valid pickle: {exc}") from None


class RestrictedUnpickler(pickle.Unpickler):
    """Admits only what ``torch.load(weights_only=True)`` admits for plain state.

    Anything else raises :class:`PickleNotAllowedError` before it is
    imported or called, unless ``allow_pickle`` (then Python's own lookup).
    """

    def __init__(self, data: bytes, where: str, *, allow_pickle: bool = False,
                 extra: dict[tuple[str, str], Any] | None = None,
                 persistent: Callable[[Any], Any] | None = None) -> None:
        super().__init__(io.BytesIO(data))
        self.data = data
        self.where = where
        self.allow_pickle = allow_pickle
        self.extra = extra or {}
        self.persistent = persistent

    def load(self) -> Any:
        """The unpickled object; any failure is a :class:`CheckpointCorruptError`
        naming the file (or :class:`PickleNotAllowedError`)."""
        _check_memo(self.data, self.where)
        try:
            return super().load()
        except CheckpointError as exc:
            if type(exc) in (CheckpointCorruptError, PickleNotAllowedError) and (
                    self.where not in str(exc)):
                # raised by a stand-in (a storage's persistent id, a tensor's size, an
                # encoding), which does not know the file: name it here
                raise type(exc)(f"{self.where}: {exc}") from None
            raise
        except Exception as exc:
            raise CheckpointCorruptError(f"{self.where} cannot be unpickled: {exc}") from None

    def find_class(self, module: str, name: str) -> Any:
        # protocol 2 (torch.save's) writes Python 2 names: __builtin__.set is builtins.set
        module, name = _compat_pickle.NAME_MAPPING.get(
            (module, name), (_compat_pickle.IMPORT_MAPPING.get(module, module), name))
        found = _SAFE.get((module, name), self.extra.get((module, name)))
        if found is None:
            found = _UNSUPPORTED.get((module, name))
        if found is not None:
            return found
        # a fresh stand-in each time: a pickle may BUILD (set attributes on) what it finds
        if (module, name) == ("torch.storage", "UntypedStorage"):
            return StorageType("uint8")
        if module == "torch" and name in STORAGE_DTYPES:
            return StorageType(STORAGE_DTYPES[name])
        if module == "torch" and name in TORCH_DTYPES:
            return DType(TORCH_DTYPES[name])
        if module == "torch" and name in UNSUPPORTED_TORCH_DTYPES:
            return DType(UNSUPPORTED_TORCH_DTYPES[name])
        if module == "torch" and name in _QSCHEMES:
            return UnsupportedTensor(f"quantization scheme torch.{name}")
        if module == "torch" and name in QUANTIZED_STORAGES:
            return StorageType(name[:-len("Storage")].lower())  # QUInt8Storage: quint8
        if self.allow_pickle:
            return super().find_class(module, name)
        raise PickleNotAllowedError(
            f"{self.where} refers to {module}.{name}, which a weights-only load does not "
            "admit (unpickling it could run arbitrary code); pass allow_pickle=True only if "
            "you trust this file")

    def persistent_load(self, pid: Any) -> Any:
        if self.persistent is None:
            raise PickleNotAllowedError(f"{self.where}: unexpected persistent id {pid!r:.80}")
        return self.persistent(pid)


def _storage(pid: Any) -> StorageRef:
    if (not isinstance(pid, tuple) or len(pid) != 5 or pid[0] != "storage"
            or not isinstance(pid[1], StorageType) or type(pid[2]) is not str
            or type(pid[4]) is not int or pid[4] < 0):
        raise CheckpointCorruptError(f"persistent id {pid!r:.120} is not a tensor storage")
    return StorageRef(pid[2], pid[1].dtype, pid[4])


def looks_like_torch_zip(path: str) -> bool:
    """A zip archive with a ``<name>/data.pkl`` entry (what torch.save writes)."""
    try:
        with zipfile.ZipFile(path) as z:
            return any(n.endswith("/data.pkl") and n.count("/") == 1 for n in z.namelist())
    except (OSError, *ZIP_ERRORS):  # not a zip zipfile can read: not this format
        return False


def read_entry(z: zipfile.ZipFile, info: zipfile.ZipInfo, size: int, cap: int,
               where: str) -> bytes:
    """The bytes of zip entry ``info`` of an archive of ``size`` bytes, refusing
    sizes the archive cannot hold or above ``cap`` before reading: zipfile asks
    for the recorded compressed size at once (a 1 KiB file claiming 2 GiB would
    have it reserve 2 GiB)."""
    if info.file_size > cap:
        raise CheckpointCorruptError(f"{where}: {info.filename} is larger than allowed")
    _check_header_offset(info, size, where)
    if info.compress_size > size or (info.compress_type == zipfile.ZIP_STORED
                                      and info.compress_size != info.file_size):
        raise CheckpointCorruptError(
            f"{where}: zip entry {info.filename} claims {info.compress_size} stored bytes "
            f"in an archive of {size}")
    return z.read(info)


def _check_header_offset(info: zipfile.ZipInfo, size: int, where: str) -> None:
    """Refuse an entry whose local header the central directory places outside the
    archive: zipfile would seek there (a negative offset: a bare ``OSError`` EINVAL)."""
    if not 0 <= info.header_offset <= size - 30:
        raise CheckpointCorruptError(
            f"{where}: zip entry {info.filename!r:.120} has its header at byte "
            f"{info.header_offset}, outside the archive of {size} bytes")


def _data_offsets_in(f: Any, z: zipfile.ZipFile, size: int, where: str
                     ) -> dict[str, tuple[int, int]]:
    """Entry name -> (byte offset of its data in ``f``, length), stored entries only
    (``f``: an open, seekable file object of ``size`` bytes)."""
    out = {}
    infos = z.infolist()
    if len(infos) > MAX_ZIP_ENTRIES:
        raise CheckpointCorruptError(f"{where} has more than {MAX_ZIP_ENTRIES} zip entries")
    for info in infos:
        if info.compress_type != zipfile.ZIP_STORED or info.compress_size != info.file_size:
            continue
        _check_header_offset(info, size, where)
        f.seek(info.header_offset)
        head = f.read(30)
        if len(head) != 30 or head[:4] != b"PK\x03\x04":
            raise CheckpointCorruptError(f"{where}: bad zip local header for {info.filename}")
        n, m = struct.unpack("<HH", head[26:30])
        start = info.header_offset + 30 + n + m
        if start + info.file_size > size:
            raise CheckpointCorruptError(
                f"{where}: zip entry {info.filename} runs past the end of the file")
        out[info.filename] = (start, info.file_size)
    return out


def open_torch_file(path: str, *, allow_pickle: bool = False
                    ) -> tuple[FileSetReader, Manifest]:
    """A torch.save zip file as a reader and a manifest (weights-only semantics).

    ``path`` may be a symbolic link (the caller's own): it is resolved once.
    """
    real = os.path.realpath(path)
    try:
        with open_binary(real) as f, zipfile.ZipFile(f) as z:
            size = os.fstat(f.fileno()).st_size
            pkl = [n for n in z.namelist() if n.endswith("/data.pkl") and n.count("/") == 1]
            if len(pkl) != 1:
                raise CheckpointCorruptError(f"{path} is a zip file but not a torch.save file")
            data = read_entry(z, z.getinfo(pkl[0]), size, MAX_PICKLE_BYTES, str(path))
            offsets = _data_offsets_in(f, z, size, path)
    except CheckpointError:
        raise
    except ZIP_ERRORS as exc:
        raise CheckpointCorruptError(
            f"{path} is not a valid zip archive: {type(exc).__name__}: {exc}") from None
    prefix = pkl[0][: -len("data.pkl")]
    try:
        obj = RestrictedUnpickler(data, f"{path} ({pkl[0]})", allow_pickle=allow_pickle,
                                  persistent=_storage).load()
    except (PickleNotAllowedError, CheckpointCorruptError):
        raise
    except Exception as exc:
        raise CheckpointCorruptError(f"{path}: data.pkl cannot be read: {exc}") from None
    arrays: list[ArrayEntry] = []
    #: (storage, offset, shape, strides, dtype) -> the array first found there
    seen: dict[tuple[Any, ...], int] = {}

    def tensor(t: TensorRef, p: KeyPath) -> ArrayEntry | int:
        # a second tensor over the same bytes with the same view (tied weights: a
        # model's state_dict() gives each name its own tensor over one parameter)
        # is an alias of the first, as statestream's own save stores it
        key = (t.storage, t.offset, t.shape, t.stride, t.dtype)
        if key in seen:
            return seen[key]
        entry = _tensor_entry(t, offsets, prefix, path, p)
        if math.prod(t.shape):  # as the providers' alias keys, never an empty tensor
            seen[key] = len(arrays)
        return entry

    # bytes values are unpickled from data.pkl (inline, as torch.save pickles them):
    # served from memory, after the archive's own file
    memory = bytearray()

    def blob(data: bytes) -> ArrayEntry:
        memory.extend(data)
        return ArrayEntry("uint8", (len(data),),
                          row_chunks(1, len(memory) - len(data), "uint8", (len(data),)))

    root = to_node(obj, (), arrays, tensor, blob=blob, where=path,
                   limit=Expansion(len(data), f"{path} ({pkl[0]})"))
    check_stored_bytes(arrays, size + len(memory), path)
    name = os.path.basename(path)
    files = [FileEntry(name, size)]
    if memory:
        files.append(FileEntry(_BYTES, len(memory)))
    reader = FileSetReader(path, {name: real}, memory={_BYTES: bytes(memory)} if memory else None)
    return reader, Manifest(root, arrays, files)


#: The name of the in-memory "file" holding a torch.save file's bytes values.
_BYTES = "<bytes values>"


def _tensor_entry(t: TensorRef, offsets: dict[str, tuple[int, int]], prefix: str,
                  path: str, p: KeyPath) -> ArrayEntry:
    where = f"tensor at key path '{format_keypath(p)}' of {path}"
    for dtype in (t.dtype, t.storage.dtype):  # a _v3 tensor names both
        if dtype not in DTYPE_NAMES:
            raise UnsupportedTypeError(
                f"{where}: dtype {dtype} is not supported (statestream cannot hold it)")
    entry = offsets.get(f"{prefix}data/{t.storage.key}")
    if entry is None:
        raise CheckpointCorruptError(f"{where}: storage {t.storage.key!r:.40} is not in the "
                                     "archive (or is compressed)")
    start, length = entry
    item = itemsize_of(t.dtype)
    check_shape(t.shape, t.dtype, where, UnsupportedTypeError)  # torch holds more dimensions
    check_row_major(t, where, "save tensor.contiguous() to convert it")
    nbytes = math.prod(t.shape) * item
    off = t.offset * item
    if off + nbytes > min(length, t.storage.numel * itemsize_of(t.storage.dtype)):
        raise CheckpointCorruptError(f"{where} lies outside its storage's {length} bytes")
    return ArrayEntry(t.dtype, t.shape, row_chunks(0, start + off, t.dtype, t.shape))


class Expansion:
    """What the tree of one unpickled state may grow to, from the pickle's size.

    A pickle refers to an object it built before by a memo index (a few bytes), and
    :func:`to_node` makes a node for every reference: ``x = [x] * 10`` nine times over is
    a pickle of 200 bytes and a tree of 10**9 nodes. Without sharing, a pickle needs an
    opcode or more of a few bytes per node, so a state may have up to
    ``8 * size + 65536`` nodes. A bytes value referred to again is stored once
    (``blobs``: its array entry by the object's id; the unpickled state keeps it alive).
    """

    def __init__(self, size: int, where: str) -> None:
        self.nodes, self.size, self.where = 8 * size + 65536, size, where
        self.blobs: dict[int, ArrayEntry] = {}

    def take(self, p: KeyPath) -> None:
        self.nodes -= 1
        if self.nodes < 0:
            raise CheckpointCorruptError(
                f"{self.where}: at key path '{format_keypath(p):.200}' the state is larger "
                f"than its {self.size}-byte pickle can hold without referring to one object "
                "over and over (a pickle that expands without bound); refusing to build it")


def to_node(obj: Any, p: KeyPath, arrays: list[ArrayEntry],
            tensor: Callable[[Any, KeyPath], ArrayEntry | int], depth: int = 0,
            blob: Callable[[bytes], ArrayEntry] | None = None, where: str = "", *,
            limit: Expansion) -> Node:
    """A statestream tree for an unpickled state (containers, scalars, tensor references).

    ``tensor`` describes a tensor's array, or gives the index of an earlier array
    that holds the same bytes (an ``alias`` leaf: tied weights). ``blob`` stores a
    bytes value (without it, bytes are refused). ``where``: the file, for messages.
    ``limit``: what the tree may grow to (every node and bytes value is counted).
    """
    if depth > 200:
        raise CheckpointCorruptError(f"state nested deeper than 200 at '{format_keypath(p)}'")
    limit.take(p)
    if isinstance(obj, UnsupportedTensor):
        fix = f"; {obj.fix}" if obj.fix else ""
        raise UnsupportedTypeError(
            f"key path '{format_keypath(p)}' holds a {obj.what}{f' in {where}' if where else ''}"
            f", which statestream does not support{fix}")
    if isinstance(obj, TensorRef) or type(obj).__name__ == "TensorStorageMetadata":
        entry = tensor(obj, p)
        if isinstance(entry, int):
            return Node("alias", array=entry, attrs={"kind": "torch"})
        arrays.append(entry)
        return Node("array", array=len(arrays) - 1, attrs={"kind": "torch"})
    if obj is None:
        return Node("none")
    for t, kind in ((bool, "bool"), (int, "int"), (float, "float"), (str, "str")):
        if type(obj) is t:
            return Node(kind, value=obj)
    if isinstance(obj, DType):
        return Node("str", value=str(obj))
    if type(obj) in (bytes, bytearray) and blob is not None:
        if id(obj) not in limit.blobs:
            limit.blobs[id(obj)] = blob(bytes(obj))
        arrays.append(limit.blobs[id(obj)])
        return Node("bytes", array=len(arrays) - 1)
    if isinstance(obj, dict):
        keys: list[Key] = []
        for k in obj:
            if type(k) not in (str, int):
                raise UnsupportedTypeError(
                    f"key {k!r:.60} at key path '{format_keypath(p)}'"
                    f"{f' in {where}' if where else ''} is not a str or int")
            keys.append(k)
        kids = [to_node(obj[k], p + (k,), arrays, tensor, depth + 1, blob, where, limit=limit)
                for k in keys]
        return Node("dict", keys=keys, children=kids)
    if type(obj) in (list, tuple):
        kids = [to_node(v, p + (i,), arrays, tensor, depth + 1, blob, where, limit=limit)
                for i, v in enumerate(obj)]
        return Node("list" if type(obj) is list else "tuple", children=kids)
    raise UnsupportedTypeError(
        f"key path '{format_keypath(p)}' holds a {type(obj).__name__}"
        f"{f' in {where}' if where else ''}, which statestream cannot represent from this "
        "format")
