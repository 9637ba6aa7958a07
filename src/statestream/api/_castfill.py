"""In-place loads into a target of another dtype (an fp32 checkpoint into a bf16
model), read in pieces within the memory budget and cast into the target.

Until 2026-12-08 such a load read the whole array (or mapped its whole file) and
cast it into a full copy before copying that into the target: a 1 GiB float32
array into a float64 target took 3 GiB beside it. The pieces (each saved chunk's
box, split to at most a quarter of the budget) are read twice: once to check every
value fits the target's dtype (nothing is written when one does not, as before),
once to cast each into the target's own memory.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from statestream._memory import fresh_bytes
from statestream.api._open import has_checksums, skip_missing_checksums
from statestream.engine import IOOptions, MemoryOptions, read_budget, read_requests
from statestream.format import ArrayEntry, Manifest, dtype_from_name
from statestream.plan import LoadPlan, ReadPiece, Wanted
from statestream.providers import ArrayProvider
from statestream.storage import CheckpointReader
from statestream.tree import KeyPath

__all__ = ["CastFill", "cast_fill", "run_cast_fills"]

#: smaller arrays take the general path (a cast copy of at most this much)
_MIN_BYTES = 1 << 20
#: the most a piece holds (besides a quarter of the budget)
_MAX_PIECE = 32 << 20

Box = tuple[tuple[int, ...], tuple[int, ...]]


@dataclasses.dataclass
class CastFill:
    """Array ``index`` cast into its target in pieces: ``check(piece)`` raises for a
    value the target's dtype cannot hold, ``write(box, piece)`` casts it in."""

    index: int
    entry: ArrayEntry
    check: Callable[[np.ndarray], None]
    write: Callable[[tuple[slice, ...], np.ndarray], None]


def cast_fill(prov: ArrayProvider, index: int, entry: ArrayEntry, like: Any,
              path: KeyPath) -> CastFill | None:
    """The piecewise fill of target ``like`` (another dtype than the saved one), or
    None where its provider cannot do one (the general path casts a copy)."""
    make = getattr(prov, "cast_fill", None)
    if make is None or not entry.shape or entry.nbytes < _MIN_BYTES:
        return None
    got = make(entry.dtype, entry.shape, like, path)
    if got is None:
        return None
    check, write = got
    return CastFill(index, entry, check, write)


def run_cast_fills(fills: Sequence[CastFill], reader: CheckpointReader, m: Manifest,
                   names: list[str], io: IOOptions, memory: MemoryOptions,
                   describe: Callable[[ReadPiece], str]) -> None:
    """Check every piece of every fill, then write them (a refused value leaves every
    such target as it was)."""
    limit = max(1, min(_MAX_PIECE, memory.resolved() // 4))

    def each(fill: CastFill, use: Callable[[Box, np.ndarray], None]) -> None:
        dt = dtype_from_name(fill.entry.dtype)
        boxes = list(_pieces(fill.entry, dt.itemsize, limit))
        most = max(math.prod(shape) for _, shape in boxes)
        buf = fresh_bytes(most * dt.itemsize).view(dt)
        for start, shape in boxes:
            dest = buf[:math.prod(shape)].reshape(shape)
            plan = LoadPlan(m.arrays, checksums=has_checksums(reader))
            plan.add(Wanted(fill.index, start, dest))
            requests = plan.requests(max_request_bytes=io.max_request_bytes)
            skip_missing_checksums(reader, requests)
            read_requests(reader, names, requests, options=io, budget=read_budget(memory),
                          describe=describe)
            use((start, shape), dest)

    for fill in fills:
        each(fill, lambda _, piece, f=fill: f.check(piece))  # type: ignore[misc]
    for fill in fills:
        each(fill, lambda box, piece, f=fill: f.write(_slices(box), piece))  # type: ignore[misc]


def _slices(box: Box) -> tuple[slice, ...]:
    start, shape = box
    return tuple(slice(a, a + n) for a, n in zip(start, shape))


def _pieces(entry: ArrayEntry, itemsize: int, limit: int) -> Iterator[Box]:
    """Boxes tiling the array: each chunk's box, split to at most ``limit`` bytes
    where a slab of it fits (else one element row of its last axis at a time)."""
    for c in sorted(entry.chunks, key=lambda c: c.start):
        if math.prod(c.shape):
            yield from _tiles(tuple(c.start), tuple(c.shape), itemsize, limit)


def _tiles(start: tuple[int, ...], shape: tuple[int, ...], itemsize: int,
           limit: int) -> Iterator[Box]:
    inner, ax = itemsize, len(shape)
    while ax > 0 and inner * shape[ax - 1] <= limit:  # trailing axes that fit whole
        ax -= 1
        inner *= shape[ax]
    if ax == 0:
        yield start, shape
        return
    ax -= 1  # stepped along, by as many as fit; the axes before it one at a time
    step = max(1, limit // inner)
    for lead in itertools.product(*(range(n) for n in shape[:ax])):
        for i in range(0, shape[ax], step):
            here = tuple(s + j for s, j in zip(start, lead)) + (start[ax] + i,)
            yield (here + start[ax + 1:],
                   (1,) * ax + (min(step, shape[ax] - i),) + shape[ax + 1:])
