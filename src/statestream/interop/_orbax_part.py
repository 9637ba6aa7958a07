"""Reads of part of an Orbax array block (interop/_orbax.py): a byte range of the block,
in C order, read as the few boxes it spans straight into the caller's buffers.

Tensorstore decodes a storage chunk whole (orbax writes one per array, zstd-compressed),
so a block read in parts (``verify``'s 8 MiB steps, a conversion's slabs) is read through
a tensorstore of its own whose chunk cache holds that one decoded chunk: it is decoded
once, not once per part, and no second copy of it is made. That tensorstore (and the
decoded chunk) goes once every byte of the block has been read, when more than
``MAX_PARTS`` blocks are being read in parts, or when the reader closes.
"""

from __future__ import annotations

import math
import threading
from collections import OrderedDict
from typing import Any

import numpy as np

from statestream._memory import fresh_bytes
from statestream.interop._deps import require

__all__ = ["PART_MIN_BYTES", "PartReads", "range_boxes"]

#: A block at least this large read in part is read through a tensorstore of its own that
#: keeps its decoded chunk (smaller ones are decoded again for each part: cheap).
PART_MIN_BYTES = 4 << 20

#: Blocks read in parts at once, each holding its decoded chunk (about one per reader
#: thread); the least recently read goes first.
MAX_PARTS = 4

#: Tensorstore's cache holds a decoded chunk and a little more (its own bookkeeping).
_CACHE_SLACK = 1 << 20


def range_boxes(shape: tuple[int, ...], e0: int, e1: int
                ) -> list[tuple[int, tuple[slice, ...]]]:
    """The elements ``[e0, e1)`` of a C-order array of ``shape`` as boxes (at most
    ``2 * ndim - 1``), each as (its first element's index less ``e0``, its slices); each
    box's elements are contiguous in C order, so it lands in one span of a flat buffer."""
    out: list[tuple[int, tuple[slice, ...]]] = []
    strides = [math.prod(shape[i + 1:]) for i in range(len(shape))]

    def walk(prefix: tuple[slice, ...], dim: int, lo: int, hi: int) -> None:
        if lo >= hi:
            return
        if dim == len(shape):
            out.append((sum(s.start * st for s, st in zip(prefix, strides)) - e0, prefix))
            return
        inner = strides[dim]
        r0, a = divmod(lo, inner)
        r1, b = divmod(hi, inner)
        if r0 == r1:
            walk(prefix + (slice(r0, r0 + 1),), dim + 1, a, b)
            return
        if a:
            walk(prefix + (slice(r0, r0 + 1),), dim + 1, a, inner)
            r0 += 1
        if r1 > r0:
            rest = tuple(slice(0, n) for n in shape[dim + 1:])
            box = prefix + (slice(r0, r1),) + rest
            out.append((sum(s.start * st for s, st in zip(box, strides)) - e0, box))
        if b:
            walk(prefix + (slice(r1, r1 + 1),), dim + 1, 0, b)

    walk((), 0, e0, e1)
    return out


class PartReads:
    """The tensorstores of the blocks being read in parts, each with a chunk cache that
    holds its decoded chunk, and how many of its bytes have been read."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        #: block name -> [its tensorstore, bytes read so far]
        self._open: OrderedDict[str, list[Any]] = OrderedDict()
        #: tensorstores opened (tests count them: one per block read in parts)
        self.opened = 0

    def store(self, name: str, store: Any, nbytes: int) -> Any:
        """The tensorstore to read part of block ``name`` (``nbytes`` bytes, from the
        array's ``store``) through: one of its own, opened on first use, whose cache keeps
        the block's decoded chunk; ``store`` itself for a small block."""
        if nbytes < PART_MIN_BYTES:
            return store
        with self._lock:
            got = self._open.get(name)
            if got is not None:
                self._open.move_to_end(name)
                return got[0]
            ts = require("tensorstore", "orbax", "reading Orbax checkpoints")
            ctx = ts.Context({"cache_pool": {"total_bytes_limit": nbytes + _CACHE_SLACK}})
            own = ts.open(store.spec(), context=ctx, open=True, read=True).result()
            self.opened += 1
            self._open[name] = [own, 0]
            while len(self._open) > MAX_PARTS:
                self._open.popitem(last=False)
            return own

    def done(self, name: str, nbytes: int, size: int) -> None:
        """``nbytes`` more of block ``name`` (``size`` bytes) were read: once all of them
        were, its tensorstore and decoded chunk go."""
        with self._lock:
            got = self._open.get(name)
            if got is None:
                return
            got[1] += nbytes
            if got[1] >= size:
                del self._open[name]

    def close(self) -> None:
        with self._lock:
            self._open.clear()


def read_part(store: Any, start: tuple[int, ...], bshape: tuple[int, ...], dt: np.dtype,
              offset: int, view: memoryview) -> None:
    """Bytes ``[offset, offset + len(view))`` of the C-order block at ``start`` (of shape
    ``bshape``) of ``store``'s array, read into ``view``: each box the range spans written
    straight into its span of ``view`` (a range not on element boundaries through a
    buffer of the elements it touches)."""
    ts = require("tensorstore", "orbax", "reading Orbax checkpoints")
    isz = dt.itemsize
    e0, e1 = offset // isz, -(-(offset + view.nbytes) // isz)
    if e0 * isz != offset or e1 * isz != offset + view.nbytes:
        tmp = fresh_bytes((e1 - e0) * isz)
        read_part(store, start, bshape, dt, e0 * isz, tmp.data)
        skip = offset - e0 * isz
        view[:] = tmp[skip:skip + view.nbytes].data
        return
    futures = []
    for at, box in range_boxes(bshape, e0, e1):
        n = math.prod(s.stop - s.start for s in box)
        dst = np.frombuffer(view, dtype=dt, count=n, offset=at * isz).reshape(
            tuple(s.stop - s.start for s in box))
        src = tuple(slice(b + s.start, b + s.stop) for b, s in zip(start, box))
        futures.append(ts.array(dst, copy=False, write=True).write(store[src]))
    for f in futures:
        f.result()
