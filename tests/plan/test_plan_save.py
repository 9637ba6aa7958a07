"""Tests for statestream.plan._save: split_chunks and StreamPlanner."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from statestream.plan import ArraySpec, StreamPlanner, WriteItem, split_chunks

KiB = 1024


# ----------------------------------------------------------------------------- split_chunks


def covered_rows(chunks: list[tuple[tuple[int, ...], tuple[int, ...]]]) -> list[int]:
    rows: list[int] = []
    for start, shape in chunks:
        rows.extend(range(start[0], start[0] + shape[0]))
    return rows


def test_zero_d_has_one_chunk() -> None:
    assert split_chunks((), 8, 1) == [((), ())]


@pytest.mark.parametrize("shape", [(0,), (0, 5), (5, 0), (3, 0, 2)])
def test_empty_arrays_have_no_chunks(shape: tuple[int, ...]) -> None:
    assert split_chunks(shape, 4, 1 << 20) == []


def test_one_row_larger_than_limit_is_its_own_chunk() -> None:
    # a single row of 4 MiB with a 1 KiB limit: rows are never split
    chunks = split_chunks((3, 1 << 20), 4, KiB)
    assert chunks == [((0, 0), (1, 1 << 20)), ((1, 0), (1, 1 << 20)), ((2, 0), (1, 1 << 20))]


def test_exact_multiple() -> None:
    chunks = split_chunks((12, 4), 4, 48)  # 3 rows per chunk, 4 chunks exactly
    assert chunks == [((r, 0), (3, 4)) for r in (0, 3, 6, 9)]


def test_remainder_chunk() -> None:
    assert split_chunks((10, 4), 4, 48)[-1] == ((9, 0), (1, 4))


def test_whole_array_fits() -> None:
    assert split_chunks((7, 3, 2), 8, 1 << 30) == [((0, 0, 0), (7, 3, 2))]


def test_one_d() -> None:
    assert split_chunks((10,), 1, 4) == [((0,), (4,)), ((4,), (4,)), ((8,), (2,))]


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.integers(1, 7), min_size=1, max_size=4),
    st.sampled_from([1, 2, 4, 8]),
    st.integers(1, 600),
)
def test_split_property(shape_l: list[int], itemsize: int, limit: int) -> None:
    shape = tuple(shape_l)
    chunks = split_chunks(shape, itemsize, limit)
    assert covered_rows(chunks) == list(range(shape[0]))
    row_bytes = math.prod(shape[1:]) * itemsize
    for start, cshape in chunks:
        assert start[1:] == (0,) * (len(shape) - 1) and cshape[1:] == shape[1:]
        assert cshape[0] * row_bytes <= limit or cshape[0] == 1


# ----------------------------------------------------------------------------- StreamPlanner
# (plan_save and SavePlan, used only by tests, were removed; the planner every save
# uses is StreamPlanner, held here to the invariants plan_save was.)


_spec = st.builds(
    ArraySpec,
    st.lists(st.integers(0, 6), max_size=3).map(tuple),
    st.sampled_from([1, 2, 4, 8]),
    st.booleans(),
)


@settings(max_examples=60, deadline=None)
@given(st.lists(_spec, max_size=8), st.integers(1, 5), st.integers(1, 200),
       st.integers(1, 64))
def test_stream_planner_property(specs: list[ArraySpec], max_files: int, max_chunk: int,
                                 block: int) -> None:
    sp = StreamPlanner(file_prefix="data/r0", max_files=max_files, max_chunk_bytes=max_chunk,
                       block_bytes=block)
    per_file: dict[int, list[WriteItem]] = {}
    for a, spec in enumerate(specs):
        items = sp.add(a, spec)
        assert [(s, sh) for s, sh, _ in sp.chunks[a]] == (
            split_chunks(spec.shape, spec.itemsize, max_chunk)
            if math.prod(spec.shape) * spec.itemsize > max_chunk or not math.prod(spec.shape)
            else [((0,) * len(spec.shape), spec.shape)])
        for it in items:
            assert (it.start, it.shape, it.nbytes) == sp.chunks[a][it.chunk]
            assert it.staging_bytes == (it.nbytes if spec.copies else 0)
            per_file.setdefault(it.file, []).append(it)
    files = sp.files()
    assert len(files) <= max_files
    sizes = {f.name: f.size for f in files}
    for fi, items in per_file.items():
        end = 0
        for it in items:  # placed in order, never overlapping, aligned
            assert it.offset >= end
            assert it.offset % (4096 if it.nbytes >= 256 * KiB else 64) == 0
            end = it.offset + it.nbytes
        assert sizes[sp.file_name(fi)] == end
    assert sp.total_bytes == sum(nb for per in sp.chunks for _, _, nb in per)
