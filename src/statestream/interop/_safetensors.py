"""safetensors files and Hugging Face sharded safetensors: our own header parser.

The header is untrusted input: its size is bounded, it must be one JSON
object without duplicate keys, every tensor's dtype must be known, its size
must match its shape, and its bytes must lie inside the file without
overlapping another tensor's. Nothing is allocated before all of that holds.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import struct
from typing import Any

from statestream.errors import CheckpointCorruptError, CheckpointError, UnsafeCheckpointError
from statestream.format import (
    MAX_DIM,
    MAX_NDIM,
    ArrayEntry,
    FileEntry,
    Manifest,
    decode_tree,
    itemsize_of,
)
from statestream.interop._chunks import row_chunks
from statestream.interop._files import FileSetReader, hub_blob, open_binary, read_capped
from statestream.tree import Key, Node

__all__ = [
    "MAX_HEADER_BYTES",
    "ST_DTYPES",
    "SafetensorsHeader",
    "TensorInfo",
    "looks_like_safetensors",
    "open_safetensors",
    "open_sharded",
    "parse_header",
]

#: The largest header accepted (safetensors' own limit is 100 MB).
MAX_HEADER_BYTES = 100_000_000
MAX_TENSORS = 1 << 22
MAX_INDEX_BYTES = 256 << 20
#: safetensors dtype code -> statestream dtype name (sub-byte F4/F6 codes are refused).
ST_DTYPES = {
    "BOOL": "bool", "U8": "uint8", "I8": "int8", "U16": "uint16", "I16": "int16",
    "U32": "uint32", "I32": "int32", "U64": "uint64", "I64": "int64",
    "F16": "float16", "BF16": "bfloat16", "F32": "float32", "F64": "float64",
    "C64": "complex64", "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2",
    "F8_E4M3FNUZ": "float8_e4m3fnuz", "F8_E5M2FNUZ": "float8_e5m2fnuz",
    "F8_E8M0": "float8_e8m0fnu",
}
#: statestream dtype name -> safetensors code
ST_CODES = {v: k for k, v in ST_DTYPES.items()}
#: __metadata__ keys statestream writes to make a round trip exact
TREE_KEY = "statestream.tree"
NAMES_KEY = "statestream.arrays"
META_KEY = "statestream.meta"
_SHARD_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]{0,254}$")


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    """One tensor of a safetensors file: absolute byte offset in the file."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int


@dataclasses.dataclass(frozen=True)
class SafetensorsHeader:
    """A validated header: tensors in header order and the ``__metadata__``."""

    tensors: list[TensorInfo]
    metadata: dict[str, str]
    data_start: int
    file_size: int


class _Bad(Exception):
    pass


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise _Bad(f"key {k!r:.80} appears twice")
        out[k] = v
    return out


def _no_constant(name: str) -> Any:
    raise _Bad(f"{name} is not a JSON value")


def _json(data: bytes, what: str) -> Any:
    """Strict JSON: no duplicate keys, and no ``NaN``/``Infinity`` (which Python's parser
    takes, but no writer of these files writes, and which statestream metadata carried
    into a converted checkpoint could not be written back)."""
    try:
        return json.loads(data.decode("utf-8"), object_pairs_hook=_no_duplicates,
                          parse_constant=_no_constant)
    except _Bad as exc:
        raise CheckpointCorruptError(f"{what}: {exc}") from None
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise CheckpointCorruptError(f"{what} is not valid UTF-8 JSON: {exc}") from None


def looks_like_safetensors(head: bytes, file_size: int) -> bool:
    """True when the first bytes are a plausible safetensors header length and ``{``."""
    if len(head) < 9:
        return False
    (n,) = struct.unpack("<Q", head[:8])
    return 2 <= n <= min(MAX_HEADER_BYTES, file_size - 8) and head[8:9] == b"{"


def _tensor(name: str, d: Any, data_len: int, data_start: int) -> TensorInfo:
    if type(d) is not dict or set(d) != {"dtype", "shape", "data_offsets"}:
        raise _Bad(f"tensor {name!r:.120} must have exactly dtype, shape and data_offsets")
    code = d["dtype"]
    if type(code) is not str or code not in ST_DTYPES:
        raise _Bad(f"tensor {name!r:.120} has dtype {code!r:.40}, which statestream does not "
                   f"read (known: {', '.join(ST_DTYPES)})")
    shape = d["shape"]
    if (type(shape) is not list or len(shape) > MAX_NDIM
            or any(type(x) is not int or not 0 <= x <= MAX_DIM for x in shape)):
        raise _Bad(f"tensor {name!r:.120} has an invalid shape {shape!r:.120}")
    offs = d["data_offsets"]
    if (type(offs) is not list or len(offs) != 2 or any(type(x) is not int for x in offs)
            or not 0 <= offs[0] <= offs[1] <= data_len):
        raise _Bad(f"tensor {name!r:.120} has data_offsets {offs!r:.80} outside the "
                   f"{data_len} data bytes of the file")
    dtype = ST_DTYPES[code]
    nbytes = math.prod(shape) * itemsize_of(dtype)
    if offs[1] - offs[0] != nbytes:
        raise _Bad(f"tensor {name!r:.120} spans {offs[1] - offs[0]} bytes but its shape "
                   f"{tuple(shape)} of {code} needs {nbytes}")
    return TensorInfo(name, dtype, tuple(shape), data_start + offs[0], nbytes)


def parse_header(head: bytes, file_size: int, where: str) -> SafetensorsHeader:
    """Validate a safetensors header (``head`` holds at least all of it)."""
    if len(head) < 8 or file_size < 8:
        raise CheckpointCorruptError(f"{where} is too short to be a safetensors file")
    (n,) = struct.unpack("<Q", head[:8])
    if not 2 <= n <= MAX_HEADER_BYTES or n > file_size - 8 or len(head) < 8 + n:
        raise CheckpointCorruptError(
            f"{where}: safetensors header length {n} is outside the file ({file_size} bytes) "
            f"or above the {MAX_HEADER_BYTES}-byte limit")
    doc = _json(head[8:8 + n], f"{where}: safetensors header")
    if type(doc) is not dict:
        raise CheckpointCorruptError(f"{where}: safetensors header must be a JSON object")
    if len(doc) > MAX_TENSORS:
        raise CheckpointCorruptError(f"{where}: more than {MAX_TENSORS} tensors")
    meta = doc.pop("__metadata__", None)
    if meta is None:  # absent, or null as safetensors writes no metadata
        meta = {}
    if type(meta) is not dict or any(type(v) is not str for v in meta.values()):
        raise CheckpointCorruptError(f"{where}: __metadata__ must map strings to strings")
    data_start = 8 + n
    data_len = file_size - data_start
    try:
        tensors = [_tensor(name, d, data_len, data_start) for name, d in doc.items()]
        _check_overlaps(tensors)
    except _Bad as exc:
        raise CheckpointCorruptError(f"{where}: {exc}") from None
    return SafetensorsHeader(tensors, meta, data_start, file_size)


def _check_overlaps(tensors: list[TensorInfo]) -> None:
    spans = sorted((t.offset, t.offset + t.nbytes, t.name) for t in tensors if t.nbytes)
    for (_, e0, n0), (b1, _, n1) in zip(spans, spans[1:]):
        if b1 < e0:
            raise _Bad(f"tensors {n0!r:.120} and {n1!r:.120} overlap")


def read_header(path: str) -> SafetensorsHeader:
    """Read and validate the header of the safetensors file at ``path``."""
    with open_binary(path) as f:
        size = os.fstat(f.fileno()).st_size
        first = f.read(8)
        if len(first) == 8:
            (n,) = struct.unpack("<Q", first)
            if 2 <= n <= min(MAX_HEADER_BYTES, size - 8):
                first += f.read(n)
    return parse_header(first, size, path)


# ----------------------------------------------------------------------------- manifest


def _manifest(entries: list[tuple[int, TensorInfo]], files: list[FileEntry],
              meta: dict[str, str], where: str) -> Manifest:
    """A manifest over safetensors tensors (file index, info), tree from metadata if any."""
    arrays = [ArrayEntry(t.dtype, t.shape, row_chunks(fi, t.offset, t.dtype, t.shape))
              for fi, t in entries]
    user = {k: v for k, v in meta.items() if k not in (TREE_KEY, NAMES_KEY, META_KEY)}
    out_meta: dict[str, Any] = {}
    if META_KEY in meta:
        saved = _json(meta[META_KEY].encode(), f"{where}: {META_KEY}")
        if type(saved) is dict:
            out_meta.update(saved)
    if user:
        out_meta["__metadata__"] = user
    names = [t.name for _, t in entries]
    tree = None
    if TREE_KEY in meta and NAMES_KEY in meta:
        order = _json(meta[NAMES_KEY].encode(), f"{where}: {NAMES_KEY}")
        if (type(order) is not list or any(type(n) is not str for n in order)
                or sorted(order) != sorted(names) or len(set(names)) != len(names)):
            raise CheckpointCorruptError(
                f"{where}: {NAMES_KEY} does not list exactly the file's tensors (as strings)")
        pos = {n: i for i, n in enumerate(names)}
        arrays = [arrays[pos[n]] for n in order]
        doc = _json(meta[TREE_KEY].encode(), f"{where}: {TREE_KEY}")
        try:
            tree = decode_tree(doc, len(arrays), arrays=arrays)
        except CheckpointCorruptError as exc:
            raise CheckpointCorruptError(f"{where}: {TREE_KEY}: {exc}") from None
    if tree is None:
        keys: list[Key] = list(names)
        tree = Node("dict", keys=keys, children=[Node("array", array=i)
                                                 for i in range(len(names))])
    return Manifest(tree=tree, arrays=arrays, files=files, meta=out_meta)


def open_safetensors(path: str, real: str | None = None) -> tuple[FileSetReader, Manifest]:
    """One ``.safetensors`` file as a reader and a manifest.

    ``path`` is the caller's and may be a symbolic link (a hub cache's snapshot
    links to its blobs): it is resolved once, and the header and the data are
    both read from the file it names. ``real``: the file to read instead, for a
    ``path`` the caller did not name (the one file of a model directory: a link
    there is followed only into a hub cache's blobs, see :func:`hub_blob`).
    """
    real = os.path.realpath(path) if real is None else real
    h = read_header(real)
    name = os.path.basename(path)
    m = _manifest([(0, t) for t in h.tensors], [FileEntry(name, h.file_size)], h.metadata, path)
    return FileSetReader(path, {name: real}), m


def find_index(directory: str) -> str | None:
    """The ``*.safetensors.index.json`` of a directory (``model.`` first), if any."""
    try:
        names = sorted(n for n in os.listdir(directory) if n.endswith(".safetensors.index.json"))
    except OSError:  # not a readable directory: no index; the caller's open reports why
        return None
    if "model.safetensors.index.json" in names:
        return os.path.join(directory, "model.safetensors.index.json")
    if len(names) > 1:
        raise CheckpointCorruptError(
            f"{directory} holds several safetensors indexes ({', '.join(names)}); pass one "
            "shard file, or keep one index")
    return os.path.join(directory, names[0]) if names else None


def find_single(directory: str) -> str | None:
    """The one ``*.safetensors`` file of a directory without an index (what
    ``save_pretrained`` writes for a model below its shard size), if it holds exactly one."""
    try:
        names = [n for n in os.listdir(directory) if n.endswith(".safetensors")
                 and os.path.isfile(os.path.join(directory, n))]
    except OSError:  # not a readable directory: the caller's open reports why
        return None
    return os.path.join(directory, names[0]) if len(names) == 1 else None


def index_shards(index_path: str) -> set[str] | None:
    """The shard files an index's ``weight_map`` names, or None when it cannot be read
    (what a conversion may replace along with it: interop/_publish.py)."""
    try:
        doc = _json(read_capped(hub_blob(index_path), MAX_INDEX_BYTES, index_path), index_path)
    except (CheckpointError, OSError):
        return None
    wmap = doc.get("weight_map") if type(doc) is dict else None
    if type(wmap) is not dict:
        return None
    return {v for v in wmap.values() if type(v) is str}


def open_sharded(index_path: str) -> tuple[FileSetReader, Manifest]:
    """A Hugging Face sharded checkpoint: the index's ``weight_map`` decides where keys live.

    In a hub cache snapshot the index and the shards are links to the
    repository's blobs, which are followed (:func:`hub_blob`); no other link is.
    """
    directory = os.path.dirname(index_path)
    raw = read_capped(hub_blob(index_path), MAX_INDEX_BYTES, index_path)
    doc = _json(raw, index_path)
    wmap = doc.get("weight_map") if type(doc) is dict else None
    if type(wmap) is not dict or any(type(v) is not str for v in wmap.values()):
        raise CheckpointCorruptError(f"{index_path}: weight_map must map names to shard files")
    meta_doc = doc.get("metadata") or {}
    if type(meta_doc) is not dict:
        raise CheckpointCorruptError(f"{index_path}: metadata must be an object")
    shards: dict[str, SafetensorsHeader] = {}
    for shard in dict.fromkeys(wmap.values()):
        if not _SHARD_RE.fullmatch(shard) or ".." in shard:
            raise UnsafeCheckpointError(
                f"{index_path} names shard {shard!r:.120}, which is not a plain file in "
                f"{directory}; refusing to read it")
        shards[shard] = read_header(hub_blob(os.path.join(directory, shard)))
    order = list(shards)
    by_name = {s: {t.name: t for t in h.tensors} for s, h in shards.items()}
    entries: list[tuple[int, TensorInfo]] = []
    for name, shard in wmap.items():
        found = by_name[shard].get(name)
        if found is None:
            raise CheckpointCorruptError(
                f"{index_path}: key {name!r:.120} is mapped to {shard}, which does not hold it")
        entries.append((order.index(shard), found))
    files = [FileEntry(s, shards[s].file_size) for s in order]
    meta = {k: v for k, v in meta_doc.items() if type(v) is str}
    if not any(k in meta for k in (TREE_KEY, META_KEY)) and order:
        meta.update(shards[order[0]].metadata)
    reader = FileSetReader(directory, {s: hub_blob(os.path.join(directory, s)) for s in order})
    return reader, _manifest(entries, files, meta, index_path)
