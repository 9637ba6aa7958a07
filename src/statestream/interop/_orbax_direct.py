"""Reading a whole Orbax storage chunk straight into its destination (interop/_orbax.py).

Tensorstore decodes a chunk into a buffer of its own and copies it into the array it is
asked to fill, so a load of a 512 MiB array stored as one chunk (orbax's default) held
it twice at its peak (+1,021 MiB for a 512 MiB result). For the layout orbax writes by
default, zarr v2 with zstd or no compression, no filters, C order, a chunk is one zstd
frame of the array's bytes: here tensorstore's own key-value store (OCDBT or files)
reads the frame in 4 MiB ranges, and zstd decompresses it into the destination as they
come, so the peak is the destination plus a few MiB. Any other layout (zarr v3,
filters, another codec, a chunk that is missing and reads as fill values) goes through
tensorstore.

The frame must decompress to exactly the block's bytes (a short or long one is damage);
zstd checks the frame's own checksum when it has one.
"""

from __future__ import annotations

import math
from typing import IO, Any, cast

import numpy as np

from statestream.errors import CheckpointCorruptError

__all__ = ["read_chunk_direct"]

#: The compressed bytes of a chunk are read in ranges of this size.
_PIECE = 4 << 20


def _chunk_key(meta: dict[str, Any], start: tuple[int, ...], bshape: tuple[int, ...],
               dt: np.dtype) -> str | None:
    """The key of the zarr v2 chunk that is exactly the block at ``start`` (``bshape``),
    when the array's layout is one this module decodes; else None."""
    if meta.get("zarr_format") != 2 or meta.get("filters") or meta.get("order") != "C":
        return None
    comp = meta.get("compressor")
    if comp is not None and comp.get("id") != "zstd":
        return None
    try:  # a dtype NumPy does not name (bfloat16 without ml_dtypes): tensorstore's to read
        want = np.dtype(meta["dtype"]) if isinstance(meta.get("dtype"), str) else None
    except TypeError:
        return None
    if want is None or want != dt or (want.itemsize > 1 and want.byteorder == ">"):
        return None
    chunks = tuple(int(c) for c in meta.get("chunks", ()))
    shape = tuple(int(n) for n in meta.get("shape", ()))
    if len(chunks) != len(bshape) or not chunks and bshape:
        return None
    idx = []
    for s, n, c, full in zip(start, bshape, chunks, shape):
        if s % c or n != min(c, full - s):
            return None
        idx.append(str(s // c))
    if any(n < c for n, c in zip(bshape, chunks)):
        return None  # an edge chunk is stored padded to the chunk shape
    sep = meta.get("dimension_separator", ".")
    if sep not in (".", "/"):  # zarr v2 knows these two; a key is never built from others
        return None
    return str(sep).join(idx) or "0"


class _Frame:
    """The value of ``key`` in ``kv`` (a tensorstore KvStore) as a file read in ranges of
    at most ``_PIECE`` bytes: never the whole compressed chunk in memory at once (held
    whole, it and the client's copy of it took twice its size beside the destination)."""

    def __init__(self, kv: Any, key: str, where: str) -> None:
        self._kv, self._key, self._where = kv, key, where
        self._pos = 0
        self._end = False
        self._generation: bytes | None = None

    def read(self, n: int = -1) -> bytes:
        if self._end:
            return b""
        n = _PIECE if n is None or n < 0 else min(n, _PIECE)
        try:
            got = self._kv.read(self._key, byte_range=slice(self._pos, self._pos + n)).result()
        except ValueError as exc:
            if "OUT_OF_RANGE" not in str(exc):
                raise
            # the value ends before pos + n: the rest of it, from pos
            got = self._kv.read(self._key, byte_range=slice(self._pos, None)).result()
            self._end = True
        if got.state != "value":
            raise CheckpointCorruptError(f"{self._where}: its chunk {self._key!r} vanished "
                                         "while being read")
        gen = bytes(got.stamp.generation)
        if self._generation is None:
            self._generation = gen
        elif gen != self._generation:
            raise CheckpointCorruptError(f"{self._where}: its chunk {self._key!r} changed "
                                         "while being read")
        data = bytes(got.value)
        self._pos += len(data)
        if len(data) < n:
            self._end = True
        return data


def read_chunk_direct(store: Any, start: tuple[int, ...], bshape: tuple[int, ...],
                      dt: np.dtype, view: memoryview, where: str) -> bool:
    """Read the block at ``start`` of ``store``'s array into ``view`` (its bytes, C
    order) by decompressing its chunk straight into it, the compressed bytes read in
    ranges; False (nothing read) when the layout is not one this module decodes or the
    chunk is missing."""
    import zstandard  # it reads only read(n) of its source

    spec = store.spec().to_json()
    if spec.get("driver") != "zarr" or "transform" in spec and any(
            spec["transform"].get(k) for k in ("input_labels", "output")):
        return False
    meta = spec.get("metadata", {})
    key = _chunk_key(meta, start, bshape, dt)
    if key is None or view.nbytes != math.prod(bshape) * dt.itemsize:
        return False
    kv = store.kvstore
    try:
        first = kv.read(key, byte_range=slice(0, 0)).result()
    except ValueError:
        first = None  # an empty value: read below, as any other
    if first is not None and first.state != "value":
        return False  # missing: tensorstore fills it (or reports it)
    frame = _Frame(kv, key, where)
    n = 0
    if meta.get("compressor") is None:
        while n < view.nbytes and (piece := frame.read(view.nbytes - n)):
            view[n:n + len(piece)] = piece
            n += len(piece)
        extra = frame.read(1)
    else:
        source = cast(IO[bytes], frame)
        with zstandard.ZstdDecompressor().stream_reader(source, read_size=_PIECE) as reader:
            while n < view.nbytes and (k := reader.readinto(view[n:])):
                n += k
            extra = reader.read(1)
    if n != view.nbytes or extra:
        raise CheckpointCorruptError(
            f"{where}: its chunk {key!r} holds {'more than ' if extra else ''}"
            f"{n} bytes (decompressed), not {view.nbytes}")
    return True
