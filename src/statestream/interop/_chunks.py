"""Foreign tensors as statestream chunks: row blocks of one contiguous byte range."""

from __future__ import annotations

import math

from statestream.format import ChunkEntry, itemsize_of

__all__ = ["ROW_BLOCK_BYTES", "row_chunks"]

#: A foreign tensor is described as chunks of about this size, so that a read of
#: some of its rows (a slab of a conversion, a shard of a resharded load) reads
#: only those rows' bytes. Foreign formats carry no checksums to keep whole.
ROW_BLOCK_BYTES = 4 << 20


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
