"""PyTorch DCP directories (``.metadata`` + ``__<rank>_<n>.distcp``) read without torch.

``.metadata`` is a pickle: it is read by the restricted unpickler, which
admits DCP's metadata classes (as inert records), ``torch.Size``, dtypes,
layouts and plain containers, nothing else. Each tensor chunk is a byte
range of a ``.distcp`` file holding either the raw bytes or a small
torch.save archive of the chunk (DCP's default); the archive's header is
parsed here and only the tensor's bytes are read later, into destinations.
Non-tensor values (``BytesStorageMetadata``) are torch.save archives of plain
objects, unpickled the same restricted way.
"""

from __future__ import annotations

import io
import math
import os
import re
import stat
import zipfile
from collections.abc import Callable
from typing import Any

from statestream.errors import (
    CheckpointCorruptError,
    CheckpointError,
    PickleNotAllowedError,
    UnsafeCheckpointError,
    UnsupportedTypeError,
)
from statestream.format import (
    DTYPE_NAMES,
    ArrayEntry,
    ChunkEntry,
    FileEntry,
    Manifest,
    itemsize_of,
)
from statestream.interop._chunks import check_stored_bytes, check_tiling, row_chunks
from statestream.interop._files import (
    ZIP_ERRORS,
    FileSetReader,
    open_binary,
    open_plain,
    plain_size,
    read_capped,
)
from statestream.interop._safetensors import looks_like_safetensors, parse_header
from statestream.interop._torchfile import (
    DType,
    Expansion,
    RestrictedUnpickler,
    TensorRef,
    _data_offsets_in,
    _storage,
    check_row_major,
    read_entry,
    to_node,
)
from statestream.tree import MAX_TREE_DEPTH, Key, KeyPath, Node, format_keypath

__all__ = ["METADATA_NAME", "looks_like_dcp", "open_dcp"]

METADATA_NAME = ".metadata"
MAX_METADATA_BYTES = 1 << 30
MAX_BYTES_ITEM = 256 << 20
_DISTCP_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]{0,254}$")
_DCP = "torch.distributed.checkpoint.metadata"
#: the reader's in-memory file holding bytes values read from the metadata's items
_MEMORY = "<bytes values>"


class Record:
    """An inert stand-in for one of DCP's metadata classes: just its pickled state."""

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, tuple) and len(state) == 2 and isinstance(state[1], dict):
            state = {**(state[0] or {}), **state[1]}  # (dict, slots)
        if isinstance(state, dict):
            self.__dict__.update(state)
        else:
            self.__dict__["_state"] = state


def _record(name: str) -> type[Record]:
    return type(name, (Record,), {})


def _enum(name: str) -> Any:
    return lambda *a: f"{name}{a!r}"


_ALLOWED: dict[tuple[str, str], Any] = {
    (_DCP, n): _record(n) for n in (
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
        "TensorProperties", "MetadataIndex", "StorageMeta")
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): _record("_StorageInfo"),
    (_DCP, "_MEM_FORMAT_ENCODING"): _enum("_MEM_FORMAT_ENCODING"),
    ("torch.serialization", "_get_layout"): _enum("layout"),
    ("pathlib", "PosixPath"): lambda *a: "/".join(map(str, a)),
    ("pathlib", "WindowsPath"): lambda *a: "\\".join(map(str, a)),
}


def looks_like_dcp(directory: str) -> bool:
    """A directory with ``.metadata`` and at least one ``*.distcp`` file, or whose
    ``.metadata`` alone looks like DCP's (:func:`_dcp_head`): a checkpoint whose data
    files are all gone is DCP missing them (damage, naming one), not a directory of no
    known format (it was 'no COMMITTED marker')."""
    try:
        names = os.listdir(directory)
    except OSError:  # not a readable directory: not DCP; the caller's open reports why
        return False
    if METADATA_NAME not in names:
        return False
    return any(n.endswith(".distcp") for n in names) or _dcp_head(
        os.path.join(directory, METADATA_NAME))


def _dcp_head(path: str) -> bool:
    """Whether the first bytes of ``path`` are a pickle (protocol 2 or later) naming DCP's
    metadata module, as ``dcp.save``'s ``.metadata`` starts. Only a regular file is
    opened (never a link, FIFO or device, nor waited on), and only its first 128 bytes read."""
    try:
        if not stat.S_ISREG(os.lstat(path).st_mode):
            return False
        fd = open_plain(path)
    except (CheckpointError, OSError):
        return False
    try:
        head = os.read(fd, 128)
    except OSError:
        return False
    finally:
        os.close(fd)
    return len(head) > 2 and head[0] == 0x80 and 2 <= head[1] <= 5 and _DCP.encode() in head


def _attr(obj: Any, name: str, where: str) -> Any:
    if not isinstance(obj, Record) or name not in obj.__dict__:
        raise CheckpointCorruptError(f"{where}: expected a DCP record with {name!r}")
    return obj.__dict__[name]


def _record_of(obj: Any, name: str, where: str) -> Record:
    """The DCP record ``obj.<name>`` (``obj``: a record)."""
    got = _attr(obj, name, where)
    if not isinstance(got, Record):
        raise CheckpointCorruptError(f"{where}: {name} {got!r:.80} is not a DCP record")
    return got


def _ints_of(obj: Any, name: str, where: str) -> tuple[int, ...]:
    """``obj.<name>`` as a tuple of non-negative ints (a size or an offset)."""
    got = _attr(obj, name, where)
    if not isinstance(got, (tuple, list)) or any(type(x) is not int or x < 0 for x in got):
        raise CheckpointCorruptError(f"{where}: {name} {got!r:.80} is not a tuple of "
                                     "non-negative integers")
    return tuple(got)


def _read_range(path: str, offset: int, length: int) -> bytes:
    with open_binary(path) as f:
        if offset + length > os.fstat(f.fileno()).st_size:  # never reserve what is not there
            raise CheckpointCorruptError(f"{path} ends before byte {offset + length}")
        f.seek(offset)
        data = f.read(length)
    if len(data) != length:
        raise CheckpointCorruptError(f"{path} ends before byte {offset + length}")
    return data


def _torch_archive(path: str, offset: int, length: int, where: str, want_tensor: bool,
                   allow_pickle: bool) -> Any:
    """Unpickle the small torch.save archive at [offset, offset+length) of ``path``."""
    if want_tensor:  # only the archive's directory and data.pkl are read here
        with open_binary(path) as f:
            view = _Slice(f, offset, length)
            try:
                with zipfile.ZipFile(view) as z:
                    pkl = [n for n in z.namelist() if n.endswith("/data.pkl")]
                    if len(pkl) != 1:
                        raise CheckpointCorruptError(f"{where}: not a torch.save archive")
                    data = read_entry(z, z.getinfo(pkl[0]), length, MAX_BYTES_ITEM, where)
                    offsets = _data_offsets_in(view, z, length, where)
            except CheckpointError:
                raise
            except ZIP_ERRORS as exc:
                raise CheckpointCorruptError(f"{where}: bad torch.save archive: "
                                             f"{type(exc).__name__}: {exc}") from None
        obj = RestrictedUnpickler(data, where, allow_pickle=allow_pickle,
                                  persistent=_storage).load()
        return obj, offsets, pkl[0][: -len("data.pkl")]
    if length > MAX_BYTES_ITEM:
        raise CheckpointCorruptError(f"{where} is {length} bytes, more than allowed")
    raw = _read_range(path, offset, length)
    try:
        with zipfile.ZipFile(io.BytesIO(raw)) as z:
            pkl = [n for n in z.namelist() if n.endswith("/data.pkl")]
            if len(pkl) != 1:
                raise CheckpointCorruptError(f"{where}: not a torch.save archive")
            data = read_entry(z, z.getinfo(pkl[0]), length, MAX_BYTES_ITEM, where)
    except CheckpointError:
        raise
    except ZIP_ERRORS as exc:
        raise CheckpointCorruptError(f"{where}: bad torch.save archive: "
                                     f"{type(exc).__name__}: {exc}") from None
    return RestrictedUnpickler(data, where, allow_pickle=allow_pickle).load()


class _Slice(io.RawIOBase):
    """A read-only, seekable window [start, start+length) of an open file."""

    def __init__(self, f: Any, start: int, length: int) -> None:
        self.f, self.start, self.length, self.pos = f, start, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, pos: int, whence: int = 0) -> int:
        base = {0: 0, 1: self.pos, 2: self.length}[whence]
        self.pos = max(0, min(self.length, base + pos))
        return self.pos

    def readinto(self, b: Any) -> int:
        n = min(len(b), self.length - self.pos)
        if n <= 0:
            return 0
        self.f.seek(self.start + self.pos)
        data = self.f.read(n)
        b[: len(data)] = data
        self.pos += len(data)
        return len(data)


def _metadata(directory: str, allow_pickle: bool) -> Any:
    path = os.path.join(directory, METADATA_NAME)
    data = read_capped(path, MAX_METADATA_BYTES)
    try:
        return RestrictedUnpickler(data, path, allow_pickle=allow_pickle, extra=_ALLOWED).load()
    except (CheckpointCorruptError, UnsupportedTypeError, PickleNotAllowedError):
        raise
    except Exception as exc:
        raise CheckpointCorruptError(f"{path} cannot be read: {exc}") from None


def open_dcp(directory: str, *, allow_pickle: bool = False
             ) -> tuple[FileSetReader, Manifest]:
    """A DCP checkpoint directory as a reader and a manifest."""
    where = os.path.join(directory, METADATA_NAME)
    md = _metadata(directory, allow_pickle)
    sdm = _attr(md, "state_dict_metadata", where)
    storage = _attr(md, "storage_data", where)
    if not isinstance(sdm, dict) or not isinstance(storage, dict):
        raise CheckpointCorruptError(f"{where}: state_dict_metadata/storage_data are not maps")
    infos: dict[tuple[str, Any], Any] = {}
    files: dict[str, int] = {}
    for idx, info in storage.items():
        fqn = _attr(idx, "fqn", where)
        off = idx.__dict__.get("offset")
        infos[(fqn, tuple(off) if off is not None else None)] = info
        rel = _attr(info, "relative_path", where)
        if type(rel) is not str or not _DISTCP_RE.fullmatch(rel) or ".." in rel:
            raise UnsafeCheckpointError(
                f"{where} names data file {rel!r:.120}, which is not a plain file in "
                f"{directory}; refusing to read it")
        if info.__dict__.get("transform_descriptors"):
            raise UnsupportedTypeError(
                f"{where}: {fqn!r} is stored with transforms "
                f"{info.__dict__['transform_descriptors']!r:.80}, which statestream does not read")
        files.setdefault(rel, len(files))
    sizes = {rel: plain_size(os.path.join(directory, rel)) for rel in files}
    arrays: list[ArrayEntry] = []
    values: dict[str, Node] = {}
    memory = bytearray()
    mem_index = len(files)

    def blob(data: bytes) -> ArrayEntry:
        memory.extend(data)
        return ArrayEntry("uint8", (len(data),), row_chunks(
            mem_index, len(memory) - len(data), "uint8", (len(data),)))

    for fqn, meta in sdm.items():
        if type(fqn) is not str:
            raise CheckpointCorruptError(f"{where}: key {fqn!r:.80} is not a string")
        ctx = _Ctx(directory, fqn, infos, files, sizes, allow_pickle, where)
        if type(meta).__name__ == "BytesStorageMetadata":
            values[fqn] = ctx.value(arrays, blob, _key_path(fqn, md.__dict__.get("planner_data")))
        else:
            arrays.append(ctx.tensor(meta))
            values[fqn] = Node("array", array=len(arrays) - 1, attrs={"kind": "torch"})
    check_stored_bytes(arrays, sum(sizes.values()) + len(memory), directory)
    root = _nest(values, md.__dict__.get("planner_data"))
    reader = FileSetReader(directory, {r: os.path.join(directory, r) for r in files},
                           memory={_MEMORY: bytes(memory)})
    return reader, Manifest(root, arrays, [FileEntry(r, sizes[r]) for r in files]
                            + [FileEntry(_MEMORY, len(memory))])


class _Ctx:
    def __init__(self, directory: str, fqn: str, infos: dict[tuple[str, Any], Any],
                 files: dict[str, int], sizes: dict[str, int], allow_pickle: bool,
                 where: str) -> None:
        self.directory, self.fqn, self.infos, self.files = directory, fqn, infos, files
        self.sizes, self.allow_pickle, self.where = sizes, allow_pickle, where

    def _span(self, key: Any) -> tuple[str, int, int]:
        info = self.infos.get((self.fqn, key))
        if info is None:
            raise CheckpointCorruptError(f"{self.where}: no storage for {self.fqn!r} at {key}")
        rel, off, n = (_attr(info, a, self.where) for a in ("relative_path", "offset", "length"))
        if type(off) is not int or type(n) is not int or off < 0 or n < 0 or (
                off + n > self.sizes[rel]):
            raise CheckpointCorruptError(
                f"{self.where}: {self.fqn!r} lies outside {rel} ({self.sizes[rel]} bytes)")
        return rel, off, n

    def _in_safetensors(self, path: str, rel: str, off: int, dtype: str,
                        shape: tuple[int, ...]) -> int | None:
        return _safetensors_start(path, off, self.sizes[rel], self.fqn, dtype, shape)

    def value(self, arrays: list[ArrayEntry], blob: Callable[[bytes], ArrayEntry],
              path: KeyPath) -> Node:
        """The non-tensor value stored for this fqn (``path``: its key path, for errors)."""
        rel, off, n = self._span(None)
        file = os.path.join(self.directory, rel)
        obj = _torch_archive(file, off, n, f"{self.fqn!r} in {rel}", False, self.allow_pickle)

        def no_tensor(t: Any, p: KeyPath) -> ArrayEntry:
            raise UnsupportedTypeError(f"key path '{format_keypath(p)}' ({self.fqn!r} in "
                                       f"{file}) holds a tensor inside a non-tensor value")

        where = f"{self.fqn!r} in {file}"
        return to_node(obj, path, arrays, no_tensor, blob=blob, where=where,
                       limit=Expansion(n, where))

    def tensor(self, meta: Any) -> ArrayEntry:
        props = _record_of(meta, "properties", self.where)
        state = props.__dict__.get("_state", props.__dict__)
        dtype = (state[0] if isinstance(state, tuple) and state
                 else state.get("dtype") if isinstance(state, dict) else None)
        if not isinstance(dtype, DType) or dtype.name not in DTYPE_NAMES:
            raise UnsupportedTypeError(f"{self.where}: {self.fqn!r} has dtype {dtype!s:.40}, "
                                       "which statestream cannot hold")
        where = f"{self.where}: {self.fqn!r}"
        shape = _ints_of(meta, "size", where)
        records = _attr(meta, "chunks", where)
        if not isinstance(records, (list, tuple)):
            raise CheckpointCorruptError(f"{where}: chunks {records!r:.80} is not a list")
        chunks: list[ChunkEntry] = []
        for c in records:
            origin, csize = _ints_of(c, "offsets", where), _ints_of(c, "sizes", where)
            chunks.extend(self._chunk(dtype.name, origin, csize))
        entry = ArrayEntry(dtype.name, shape, tuple(chunks))
        check_tiling(entry, f"{self.where}: tensor {self.fqn!r}")
        return entry

    def _chunk(self, dtype: str, origin: tuple[int, ...], size: tuple[int, ...]
               ) -> tuple[ChunkEntry, ...]:
        rel, off, n = self._span(origin)
        path = os.path.join(self.directory, rel)
        nbytes = math.prod(size) * itemsize_of(dtype)
        if n == nbytes:
            start = self._in_safetensors(path, rel, off, dtype, size)
            if start is not None:
                return row_chunks(self.files[rel], start, dtype, size, origin)
            if _read_range(path, off, min(n, 4)) != b"PK\x03\x04":
                return row_chunks(self.files[rel], off, dtype, size, origin)  # raw bytes
        obj, offsets, prefix = _torch_archive(path, off, n, f"{self.fqn!r} in {rel}", True,
                                              self.allow_pickle)
        where = f"{self.where}: the chunk of {self.fqn!r} at {origin}"
        if not isinstance(obj, TensorRef) or obj.dtype != dtype or obj.shape != size:
            raise CheckpointCorruptError(f"{where} does not hold the tensor its metadata "
                                         "describes")
        check_row_major(obj, where, "load it with torch.distributed.checkpoint and save "
                        "the tensor .contiguous()")
        entry = offsets.get(f"{prefix}data/{obj.storage.key}")
        if entry is None or obj.offset * itemsize_of(dtype) + nbytes > entry[1]:
            raise CheckpointCorruptError(f"{self.where}: the chunk of {self.fqn!r} lies outside "
                                         "its archive")
        return row_chunks(self.files[rel], off + entry[0] + obj.offset * itemsize_of(dtype),
                          dtype, size, origin)


def _safetensors_start(path: str, off: int, size: int, fqn: str, dtype: str,
                       shape: tuple[int, ...]) -> int | None:
    """Where ``fqn``'s bytes start, if a safetensors blob begins at ``off`` of ``path``
    (``size`` bytes) and holds ``fqn`` with this dtype and shape; else None.

    DCP's ``serialization_format=SAFETENSORS`` writes each file's tensors as one
    safetensors blob keyed by fqn and records every chunk at the blob's start.
    """
    head = _read_range(path, off, min(9, size - off))
    if not looks_like_safetensors(head, size - off):
        return None
    n = int.from_bytes(head[:8], "little")
    try:
        header = parse_header(_read_range(path, off, 8 + n), size - off, path)
    except CheckpointCorruptError:
        return None  # not a safetensors blob after all: raw bytes that look like one
    if "DCP_SHARDING_INFO" not in header.metadata:
        return None
    for t in header.tensors:
        if t.name == fqn:
            if t.dtype != dtype or t.shape != shape:
                raise CheckpointCorruptError(
                    f"{path}: tensor {fqn!r} is {t.dtype} {t.shape} in its safetensors "
                    f"header but {dtype} {shape} in the DCP metadata")
            return off + t.offset
    raise CheckpointCorruptError(f"{path}: the safetensors data written by DCP at byte {off} "
                                 f"has no tensor {fqn!r}")


def _key_path(fqn: str, planner: Any) -> KeyPath:
    """``fqn``'s key path as :func:`_nest` would likely place it (for error messages)."""
    p = planner.get(fqn) if isinstance(planner, dict) else None
    if isinstance(p, tuple) and 0 < len(p) <= MAX_TREE_DEPTH and all(
            type(k) in (str, int) for k in p):
        return p
    return (fqn,)


def _nest(values: dict[str, Node], planner: Any) -> Node:
    """Nested dicts from DCP's planner_data (fqn -> original key path), else flat keys.

    One value at the empty path is the root itself: what a conversion to DCP writes for
    a state that is not a mapping or list (a torch.save of one tensor), as the item
    ``""`` (DCP's own save takes only dicts)."""
    if isinstance(planner, dict) and len(values) == 1 and planner.get(next(iter(values))) == ():
        return next(iter(values.values()))
    paths: dict[str, tuple[Key, ...]] = {}
    if isinstance(planner, dict) and all(
            isinstance(planner.get(f), tuple) and 0 < len(planner[f]) <= MAX_TREE_DEPTH
            and all(type(k) in (str, int) for k in planner[f]) for f in values):
        paths = {f: planner[f] for f in values}
    else:
        paths = {f: (f,) for f in values}
    top: dict[Key, Any] = {}
    for f, p in paths.items():
        d = top
        for k in p[:-1]:
            nxt = d.setdefault(k, {})
            if not isinstance(nxt, dict):
                return _flat(values)
            d = nxt
        if p[-1] in d:
            return _flat(values)
        d[p[-1]] = values[f]

    def build(d: dict[Key, Any]) -> Node:
        keys = list(d)
        kids = [build(v) if isinstance(v, dict) else v for v in d.values()]
        if keys and all(type(k) is int for k in keys) and sorted(keys) == list(range(len(keys))):
            # DCP's own unflattening makes a list where a path element is an int
            at = dict(zip(keys, kids))  # (keys.index per element was quadratic)
            return Node("list", children=[at[i] for i in range(len(keys))])
        return Node("dict", keys=keys, children=kids)

    return build(top)


def _flat(values: dict[str, Node]) -> Node:
    keys: list[Key] = list(values)
    return Node("dict", keys=keys, children=list(values.values()))

