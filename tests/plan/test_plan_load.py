"""Tests for statestream.plan._load: plan_load, plan_verify and coalesce."""

from __future__ import annotations

import numpy as np
import pytest

from statestream.format import ArrayEntry, ChunkEntry
from statestream.plan import ReadPiece, ReadRequest, Wanted, coalesce, plan_load, plan_verify


def row_chunked(rows: int, cols: int, rows_per_chunk: int, *, file: int = 0,
                base: int = 0, gap: int = 0) -> ArrayEntry:
    """float32 (rows, cols) stored as row blocks, back to back (plus ``gap``) in ``file``."""
    chunks = []
    off = base
    for r in range(0, rows, rows_per_chunk):
        n = min(rows_per_chunk, rows - r)
        nb = n * cols * 4
        chunks.append(ChunkEntry(file, off, nb, r, (r, 0), (n, cols)))
        off += nb + gap
    return ArrayEntry("float32", (rows, cols), tuple(chunks))


def pieces_of(reqs: list[ReadRequest]) -> list[ReadPiece]:
    return [p for r in reqs for p in r.pieces]


def addr(a: np.ndarray) -> int:
    return int(a.__array_interface__["data"][0])


def test_whole_array_reads_directly_into_destination() -> None:
    entry = row_chunked(8, 4, 2)
    dest = np.zeros((8, 4), np.float32)
    reqs = plan_load([entry], [Wanted(0, (0, 0), dest)])
    ps = pieces_of(reqs)
    assert [p.chunk for p in ps] == [0, 1, 2, 3]
    for p in ps:
        assert p.direct is not None and not p.scatter and p.staging_bytes == 0
        assert p.direct.dtype == np.uint8 and p.direct.nbytes == p.nbytes == 32
        assert addr(p.direct) == addr(dest) + p.chunk * 32
        assert p.dtype == np.float32 and p.chunk_shape == (2, 4)
        assert p.checksum == 2 * p.chunk  # carried from the manifest


def test_destination_box_that_cuts_chunks_scatters() -> None:
    entry = row_chunked(8, 4, 2)
    dest = np.zeros((4, 4), np.float32)  # global rows 1..4
    ps = {p.chunk: p for p in pieces_of(plan_load([entry], [Wanted(0, (1, 0), dest)]))}
    assert sorted(ps) == [0, 1, 2]  # chunk 3 (rows 6-7) is not read
    # chunk 0 contributes its row 1 only -> scatter via scratch
    p0 = ps[0]
    assert p0.direct is None and p0.staging_bytes == 32
    ((dview, csl),) = p0.scatter
    assert csl == (slice(1, 2), slice(0, 4)) and np.shares_memory(dview, dest)
    assert dview.shape == (1, 4) and addr(dview) == addr(dest)
    # chunk 1 (rows 2-3) lands whole at destination rows 1-2
    p1 = ps[1]
    assert p1.direct is not None and addr(p1.direct) == addr(dest) + 16 and not p1.scatter
    # chunk 2 contributes its row 4
    ((dview2, csl2),) = ps[2].scatter
    assert csl2 == (slice(0, 1), slice(0, 4)) and addr(dview2) == addr(dest) + 3 * 16


def test_column_cut_scatters_every_chunk() -> None:
    entry = row_chunked(4, 4, 2)
    dest = np.zeros((4, 2), np.float32)
    ps = pieces_of(plan_load([entry], [Wanted(0, (0, 1), dest)]))
    assert len(ps) == 2
    for p in ps:
        assert p.direct is None and len(p.scatter) == 1
        assert p.scatter[0][1] == (slice(0, 2), slice(1, 3))


def test_non_contiguous_destination_scatters() -> None:
    entry = row_chunked(2, 4, 2)
    big = np.zeros((4, 4), np.float32)
    dest = big[::2]  # a strided view of the right shape
    (p,) = pieces_of(plan_load([entry], [Wanted(0, (0, 0), dest)]))
    assert p.direct is None and p.scatter[0][1] == (slice(0, 2), slice(0, 4))


def test_several_destinations_share_one_piece() -> None:
    entry = row_chunked(4, 4, 4)
    top = np.zeros((2, 4), np.float32)
    bottom = np.zeros((2, 4), np.float32)
    (p,) = pieces_of(plan_load([entry], [Wanted(0, (0, 0), top), Wanted(0, (2, 0), bottom)]))
    assert p.direct is None
    assert [csl for _, csl in p.scatter] == [(slice(0, 2), slice(0, 4)), (slice(2, 4), slice(0, 4))]


def test_scalar_and_empty_arrays() -> None:
    scalar = ArrayEntry("int64", (), (ChunkEntry(0, 0, 8, 1, (), ()),))
    empty = ArrayEntry("float32", (0, 3), ())
    zero_chunk = ArrayEntry("float32", (0,), (ChunkEntry(0, 64, 0, 0, (0,), (0,)),))
    d0 = np.zeros((), np.int64)
    reqs = plan_load([scalar, empty, zero_chunk], [
        Wanted(0, (), d0),
        Wanted(1, (0, 0), np.zeros((0, 3), np.float32)),
        Wanted(2, (0,), np.zeros((0,), np.float32)),
    ])
    (p,) = pieces_of(reqs)
    assert p.array == 0 and p.direct is not None and addr(p.direct) == addr(d0)


def test_requests_sorted_by_file_and_offset() -> None:
    a = ArrayEntry("float32", (3, 4), (
        ChunkEntry(1, 0, 16, 0, (0, 0), (1, 4)),
        ChunkEntry(0, 500_000, 16, 0, (1, 0), (1, 4)),
        ChunkEntry(0, 64, 16, 0, (2, 0), (1, 4)),
    ))
    b = ArrayEntry("float32", (1, 4), (ChunkEntry(0, 0, 16, 0, (0, 0), (1, 4)),))
    reqs = plan_load([a, b], [Wanted(0, (0, 0), np.zeros((3, 4), np.float32)),
                              Wanted(1, (0, 0), np.zeros((1, 4), np.float32))])
    assert [(r.file, r.offset) for r in reqs] == [(0, 0), (0, 500_000), (1, 0)]
    assert [(p.array, p.chunk) for p in reqs[0].pieces] == [(1, 0), (0, 2)]


def test_coalescing_neighbours() -> None:
    entry = row_chunked(8, 4, 1, gap=16)  # 16-byte chunks with 16-byte gaps
    dest = np.zeros((8, 4), np.float32)
    (req,) = plan_load([entry], [Wanted(0, (0, 0), dest)])
    assert req.offset == 0 and req.nbytes == 8 * 16 + 7 * 16
    assert len(req.pieces) == 8


def test_gap_limit_splits_requests() -> None:
    entry = row_chunked(4, 4, 1, gap=100)
    dest = np.zeros((4, 4), np.float32)
    assert len(plan_load([entry], [Wanted(0, (0, 0), dest)], max_gap_bytes=100)) == 1
    reqs = plan_load([entry], [Wanted(0, (0, 0), dest)], max_gap_bytes=99)
    assert [(r.offset, r.nbytes) for r in reqs] == [(0, 16), (116, 16), (232, 16), (348, 16)]


def test_request_size_limit_splits_requests() -> None:
    entry = row_chunked(6, 4, 1)  # six 16-byte chunks back to back
    dest = np.zeros((6, 4), np.float32)
    reqs = plan_load([entry], [Wanted(0, (0, 0), dest)], max_request_bytes=32)
    assert [(r.offset, r.nbytes, len(r.pieces)) for r in reqs] == [
        (0, 32, 2), (32, 32, 2), (64, 32, 2)]
    reqs = plan_load([entry], [Wanted(0, (0, 0), dest)], max_request_bytes=40)
    assert [r.nbytes for r in reqs] == [32, 32, 32]
    # a single piece larger than the limit still gets its own request
    reqs = plan_load([entry], [Wanted(0, (0, 0), dest)], max_request_bytes=8)
    assert [r.nbytes for r in reqs] == [16] * 6


def test_piece_count_limit_splits_requests() -> None:
    entry = row_chunked(5, 4, 1)
    reqs = plan_load([entry], [Wanted(0, (0, 0), np.zeros((5, 4), np.float32))],
                     max_pieces_per_request=2)
    assert [len(r.pieces) for r in reqs] == [2, 2, 1]


def test_different_files_never_merge() -> None:
    a = row_chunked(2, 4, 2, file=0)
    b = row_chunked(2, 4, 2, file=1)
    reqs = plan_load([a, b], [Wanted(0, (0, 0), np.zeros((2, 4), np.float32)),
                              Wanted(1, (0, 0), np.zeros((2, 4), np.float32))])
    assert [(r.file, r.offset) for r in reqs] == [(0, 0), (1, 0)]


def _piece(file: int, offset: int, nbytes: int, chunk: int = 0) -> ReadPiece:
    return ReadPiece(0, chunk, file, offset, nbytes, 0, (nbytes,), np.dtype(np.uint8))


def test_coalesce_directly() -> None:
    ps = [_piece(0, 100, 10, 1), _piece(0, 0, 10, 0), _piece(0, 10, 5, 2), _piece(2, 0, 1, 3)]
    reqs = coalesce(ps, max_gap_bytes=0)
    assert [(r.file, r.offset, r.nbytes) for r in reqs] == [(0, 0, 15), (0, 100, 10), (2, 0, 1)]
    assert [p.chunk for p in reqs[0].pieces] == [0, 2]
    assert coalesce([]) == []


def test_plan_verify_reads_every_chunk_into_scratch() -> None:
    a = row_chunked(4, 4, 2)
    b = ArrayEntry("float16", (0,), ())
    c = row_chunked(2, 4, 1, file=1)
    reqs = plan_verify([a, b, c])
    ps = pieces_of(reqs)
    assert sorted((p.array, p.chunk) for p in ps) == [(0, 0), (0, 1), (2, 0), (2, 1)]
    assert all(p.direct is None and p.staging_bytes == p.nbytes for p in ps)
    assert [(r.file, r.offset, r.nbytes) for r in reqs] == [(0, 0, 64), (1, 0, 32)]
    assert [r.nbytes for r in plan_verify([a], max_request_bytes=32)] == [32, 32]


@pytest.mark.parametrize("rows_per_chunk", [1, 3, 8])
@pytest.mark.parametrize("box", [((0, 0), (8, 4)), ((2, 1), (5, 2)), ((7, 0), (1, 4))])
def test_plan_covers_destination_exactly(rows_per_chunk: int,
                                         box: tuple[tuple[int, int], tuple[int, int]]) -> None:
    """Simulate the engine on the plan: every destination element is written once."""
    entry = row_chunked(8, 4, rows_per_chunk)
    src = np.arange(32, dtype=np.float32).reshape(8, 4)
    (r0, c0), (nr, nc) = box
    dest = np.full((nr, nc), -1, np.float32)
    for req in plan_load([entry], [Wanted(0, (r0, c0), dest)]):
        for p in req.pieces:
            c = entry.chunks[p.chunk]
            chunk_bytes = src[c.start[0] : c.start[0] + c.shape[0]].tobytes()
            if p.direct is not None:
                p.direct[...] = np.frombuffer(chunk_bytes, np.uint8)
            for dview, csl in p.scatter:
                dview[...] = np.frombuffer(chunk_bytes, np.float32).reshape(c.shape)[csl]
    np.testing.assert_array_equal(dest, src[r0 : r0 + nr, c0 : c0 + nc])


def test_a_chunk_without_checksums_is_read_for_the_rows_a_box_needs() -> None:
    """``checksums=False`` (a foreign format's chunks): a box of some rows of a raw chunk
    reads those rows, straight into the box; with a whole-chunk checksum to check, the
    whole chunk is read into scratch (a conversion's slabs of one Orbax chunk each read
    all of it before)."""
    entry = row_chunked(64, 4, 64, base=100)
    dest = np.zeros((8, 4), np.float32)
    (p,) = pieces_of(plan_load([entry], [Wanted(0, (16, 0), dest)], checksums=False))
    assert (p.offset, p.nbytes, p.chunk_shape) == (100 + 16 * 16, 8 * 16, (8, 4))
    assert p.direct is not None and addr(p.direct) == addr(dest) and not p.scatter
    (q,) = pieces_of(plan_load([entry], [Wanted(0, (16, 0), dest)]))
    assert (q.offset, q.nbytes, q.direct) == (100, 64 * 16, None) and q.scatter
