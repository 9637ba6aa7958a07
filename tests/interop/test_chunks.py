"""Foreign chunk layouts are checked as strictly as a statestream manifest's."""

from __future__ import annotations

import dataclasses
import itertools
import tracemalloc

import pytest

from statestream.errors import CheckpointCorruptError
from statestream.format import ArrayEntry, ChunkEntry
from statestream.interop._chunks import ROW_BLOCK_BYTES, check_tiling, row_chunks


def _c(start: tuple[int, ...], shape: tuple[int, ...]) -> ChunkEntry:
    return ChunkEntry(0, 0, 4 * shape[0] * shape[1], 0, start, shape)


def test_row_chunks_tile_the_tensor() -> None:
    rows = ROW_BLOCK_BYTES // (4 * 1024)
    chunks = row_chunks(2, 100, "float32", (rows * 2 + 3, 1024), origin=(5, 7))
    assert [c.start for c in chunks] == [(5, 7), (5 + rows, 7), (5 + 2 * rows, 7)]
    assert chunks[1].offset == 100 + rows * 4096 and chunks[2].shape == (3, 1024)
    check_tiling(ArrayEntry("float32", (rows * 2 + 3, 1024),
                            row_chunks(0, 0, "float32", (rows * 2 + 3, 1024))), "t")


@pytest.mark.parametrize("shape,chunks,match", [
    ((4, 4), [_c((0, 0), (2, 4)), _c((1, 0), (2, 4))], "overlap"),  # full volume, overlapping
    ((4, 4), [_c((0, 0), (2, 4))], "cover 8 of"),  # a hole: memory nobody filled
    ((4, 4), [_c((3, 0), (2, 4)), _c((0, 0), (2, 4))], "outside"),
    ((1 << 40, 1 << 40), [_c((0, 0), (2, 4))], "limits"),
])
def test_bad_tilings_refused(shape: tuple[int, ...], chunks: list[ChunkEntry],
                             match: str) -> None:
    with pytest.raises(CheckpointCorruptError, match=match):
        check_tiling(ArrayEntry("float32", shape, tuple(chunks)), "t")


def _unit_chunks(n: int, ndim: int) -> ArrayEntry:
    """An ``(n, 1, ..., 1)`` float32 tensor recorded as ``n`` chunks of one element (what a
    3 MB DCP ``.metadata`` can say of 10,000 chunks)."""
    rest = (0,) * (ndim - 1)
    return ArrayEntry("float32", (n,) + (1,) * (ndim - 1), tuple(
        ChunkEntry(0, 4 * i, 4, 0, (i,) + rest, (1,) * ndim) for i in range(n)))


def test_many_chunks_are_checked_in_linear_memory() -> None:
    # every pair of chunks was compared, in 512 x n x ndim boolean temporaries: 2,000
    # chunks of 32 dimensions peaked at ~100 MiB, 10,000 took 8 s and 350 MiB
    entry = _unit_chunks(2000, 32)
    tracemalloc.start()
    try:
        check_tiling(entry, "t")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 8 << 20  # (the chunk coordinates themselves: 1 MiB)
    bad = _unit_chunks(2000, 32)
    chunks = list(bad.chunks)
    chunks[1500] = dataclasses.replace(chunks[1500], start=(1499,) + (0,) * 31)
    chunks[1499] = dataclasses.replace(chunks[1499], start=(1500,) + (0,) * 31)
    check_tiling(dataclasses.replace(bad, chunks=tuple(chunks)), "t")  # swapped: still a tiling
    chunks[7] = dataclasses.replace(chunks[7], shape=(2,) + (1,) * 31)  # rows 7 and 8
    chunks[8] = dataclasses.replace(chunks[8], shape=(0,) + (1,) * 31)  # (an empty one)
    check_tiling(dataclasses.replace(bad, chunks=tuple(chunks)), "t")
    chunks[9] = dataclasses.replace(chunks[9], start=(7,) + (0,) * 31)  # 7 twice, 9 nowhere
    with pytest.raises(CheckpointCorruptError, match="t: two of its chunks overlap"):
        check_tiling(dataclasses.replace(bad, chunks=tuple(chunks)), "t")


def test_a_grid_of_chunks_is_checked_by_its_corners() -> None:
    grid = [_c((4 * i, 4 * j), (4, 4)) for i in range(8) for j in range(8)]
    check_tiling(ArrayEntry("float32", (32, 32), tuple(grid)), "t")
    grid[9] = _c((4, 5), (4, 4))  # overlaps its right neighbour, leaves a column uncovered
    with pytest.raises(CheckpointCorruptError, match="t: two of its chunks overlap"):
        check_tiling(ArrayEntry("float32", (32, 32), tuple(grid)), "t")


def test_chunks_split_on_too_many_axes_are_refused_naming_the_tensor() -> None:
    # one-element chunks of a 4^7 tensor: ~50 corner points each, over the manifest's bound
    # of 16 per chunk (plus 65,536)
    shape = (4,) * 7
    chunks = tuple(ChunkEntry(0, 0, 4, 0, p, (1,) * 7) for p in itertools.product(range(4),
                                                                                 repeat=7))
    with pytest.raises(CheckpointCorruptError, match="tensor 'w': chunks split along too many"):
        check_tiling(ArrayEntry("float32", shape, chunks), "tensor 'w'")
