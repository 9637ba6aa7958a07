"""Foreign tensors as statestream chunks: row blocks of one contiguous byte range."""

from __future__ import annotations

import math

import numpy as np

from statestream.errors import CheckpointCorruptError, CheckpointError
from statestream.format import (
    MAX_ARRAY_BYTES,
    MAX_DIM,
    MAX_NDIM,
    ArrayEntry,
    ChunkEntry,
    itemsize_of,
    tiles_exactly,
)

__all__ = ["ROW_BLOCK_BYTES", "check_shape", "check_stored_bytes", "check_tiling",
           "row_chunks"]

#: A foreign tensor is described as chunks of about this size, so that a read of
#: some of its rows (a slab of a conversion, a shard of a resharded load) reads
#: only those rows' bytes. Foreign formats carry no checksums to keep whole.
ROW_BLOCK_BYTES = 4 << 20

#: A foreign file's tensors may add up to this many times the bytes stored for them,
#: plus :data:`_STORED_SLACK` (:func:`check_stored_bytes`).
STORED_FACTOR = 8
_STORED_SLACK = 64 << 20


def row_chunks(file: int, offset: int, dtype: str, shape: tuple[int, ...],
               origin: tuple[int, ...] = ()) -> tuple[ChunkEntry, ...]:
    """Chunks covering a C-contiguous tensor stored at ``offset`` of data file ``file``.

    ``origin`` is where the tensor starts in its array (a shard of a larger one).
    """
    nbytes = math.prod(shape) * itemsize_of(dtype)
    if not nbytes:
        return ()
    if not shape:
        return (ChunkEntry(file, offset, nbytes, 0, (), ()),)
    o = origin or (0,) * len(shape)
    row = nbytes // shape[0]
    step = max(1, ROW_BLOCK_BYTES // row)
    return tuple(
        ChunkEntry(file, offset + r0 * row, (min(shape[0], r0 + step) - r0) * row, 0,
                   (o[0] + r0,) + o[1:], (min(shape[0], r0 + step) - r0,) + shape[1:])
        for r0 in range(0, shape[0], step))


def check_shape(shape: tuple[int, ...], dtype: str, what: str,
                error: type[CheckpointError] = CheckpointCorruptError) -> None:
    """Refuse a shape a statestream manifest could not hold (more than ``MAX_NDIM``
    dimensions, one above ``MAX_DIM``, more than ``MAX_ARRAY_BYTES``) with ``error``: a
    foreign file's could otherwise be loaded, or converted into a checkpoint that cannot
    be read back. An empty array is no exception (NumPy refuses ``(0, 2**70)``)."""
    if len(shape) > MAX_NDIM or any(not 0 <= n <= MAX_DIM for n in shape) or (
            math.prod(shape) * itemsize_of(dtype) > MAX_ARRAY_BYTES):
        raise error(f"{what}: shape {shape!r:.200} is outside statestream's limits "
                    f"({MAX_NDIM} dimensions of at most {MAX_DIM})")


def check_tiling(entry: ArrayEntry, what: str) -> None:
    """The checks a statestream manifest gets: limits, chunks inside the array, covering it
    exactly once. A foreign format's metadata could otherwise make ``load`` allocate an
    array far larger than the file, or return memory no chunk filled."""
    shape = entry.shape
    check_shape(shape, entry.dtype, what)
    covered = 0
    for c in entry.chunks:
        if len(c.start) != len(shape) or len(c.shape) != len(shape) or any(
                x < 0 or n < 0 or x + n > s for x, n, s in zip(c.start, c.shape, shape)):
            raise CheckpointCorruptError(
                f"{what}: a chunk at {c.start} of shape {c.shape} lies outside {shape}")
        covered += math.prod(c.shape)
    if covered != math.prod(shape):
        raise CheckpointCorruptError(
            f"{what}: its chunks cover {covered} of its {math.prod(shape)} elements")
    live = [c for c in entry.chunks if math.prod(c.shape)]
    if len(live) < 2 or not shape:
        return
    lo = np.array([c.start for c in live], dtype=np.int64)
    hi = lo + np.array([c.shape for c in live], dtype=np.int64)
    # linear, as a manifest's chunks are checked (comparing every pair of 10,000 chunks
    # of a 3 MB DCP .metadata took 8 s and 350 MiB)
    if not tiles_exactly(lo, hi, shape, what):
        raise CheckpointCorruptError(f"{what}: two of its chunks overlap")


def check_stored_bytes(arrays: list[ArrayEntry], stored: int, where: str) -> None:
    """Refuse tensors that add up to far more than the ``stored`` bytes they are read from.

    A torch file's tensors are views of its storages and a DCP checkpoint's chunk records
    name byte ranges of its files, each loaded as an array of its own: a few bytes of
    pickle can name the same bytes over and over (100,000 views of a 1 MB storage: 100 GB
    to allocate). A state holds its bytes once, or a few times (a weight and a view of
    it, overlapping slices): up to :data:`STORED_FACTOR` times plus 64 MiB is read.

    Raises:
        CheckpointCorruptError: naming ``where``, the total and the stored bytes.
    """
    total = sum(math.prod(a.shape) * itemsize_of(a.dtype) for a in arrays)
    if total > STORED_FACTOR * stored + _STORED_SLACK:
        raise CheckpointCorruptError(
            f"{where}: its {len(arrays)} tensors add up to {total} bytes, more than "
            f"{STORED_FACTOR} times the {stored} bytes stored for them (plus 64 MiB): they "
            "name the same bytes over and over; refusing to load them")
