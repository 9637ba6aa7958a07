"""Foreign chunk layouts are checked as strictly as a statestream manifest's."""

from __future__ import annotations

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
