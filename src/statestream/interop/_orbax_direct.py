"""Reading a whole Orbax storage chunk straight into its destination (interop/_orbax.py).

Tensorstore decodes a chunk into a buffer of its own and copies it into the array it is
asked to fill, so a load of a 512 MiB array stored as one chunk (orbax's default) held
it twice at its peak (+1,021 MiB for a 512 MiB result). For the layout orbax writes by
default, zarr v2 with zstd or no compression, no filters, C order, a chunk is one zstd
frame of the array's bytes: here tensorstore's own key-value store (OCDBT or files)
reads the frame, and zstd decompresses it into the destination, so the peak is the
destination plus the compressed frame. Any other layout (zarr v3, filters, another
codec, a chunk that is missing and reads as fill values) goes through tensorstore.

The frame must decompress to exactly the block's bytes (a short or long one is damage);
zstd checks the frame's own checksum when it has one.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from statestream.errors import CheckpointCorruptError

__all__ = ["read_chunk_direct"]


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
    return str(meta.get("dimension_separator", ".")).join(idx) or "0"


def read_chunk_direct(store: Any, start: tuple[int, ...], bshape: tuple[int, ...],
                      dt: np.dtype, view: memoryview, where: str) -> bool:
    """Read the block at ``start`` of ``store``'s array into ``view`` (its bytes, C
    order) by decompressing its chunk straight into it; False (nothing read) when the
    layout is not one this module decodes or the chunk is missing."""
    import zstandard

    spec = store.spec().to_json()
    if spec.get("driver") != "zarr" or "transform" in spec and any(
            spec["transform"].get(k) for k in ("input_labels", "output")):
        return False
    meta = spec.get("metadata", {})
    key = _chunk_key(meta, start, bshape, dt)
    if key is None or view.nbytes != math.prod(bshape) * dt.itemsize:
        return False
    got = store.kvstore.read(key).result()
    if got.state != "value":
        return False  # missing: tensorstore fills it (or reports it)
    frame = got.value
    del got
    if meta.get("compressor") is None:
        if len(frame) != view.nbytes:
            raise CheckpointCorruptError(f"{where}: its chunk {key!r} holds {len(frame)} "
                                         f"bytes, not {view.nbytes}")
        view[:] = frame
        return True
    n = 0
    with zstandard.ZstdDecompressor().stream_reader(frame) as reader:
        while n < view.nbytes:
            k = reader.readinto(view[n:])
            if not k:
                break
            n += k
        extra = reader.read(1)
    if n != view.nbytes or extra:
        raise CheckpointCorruptError(
            f"{where}: its chunk {key!r} decompresses to {'more' if extra else n} bytes, "
            f"not {view.nbytes}")
    return True
