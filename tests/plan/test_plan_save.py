"""Tests for statestream.plan._save: split_chunks and plan_save."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from statestream.plan import ArraySpec, SavePlan, plan_save, split_chunks

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


# ----------------------------------------------------------------------------- plan_save


def check_layout(plan: SavePlan, specs: list[ArraySpec]) -> None:
    """Invariants every plan must satisfy."""
    seen: list[tuple[int, int]] = []
    for fi, f in enumerate(plan.files):
        assert f.name == f"data/r0-{fi}.bin"
        end = 0
        for it in f.items:
            assert it.file == fi
            assert it.offset >= end, "items overlap or are out of order"
            align = 4096 if it.nbytes >= 256 * KiB else 64
            assert it.offset % align == 0
            end = it.offset + it.nbytes
            assert it.staging_bytes == (it.nbytes if specs[it.array].copies else 0)
            assert (it.start, it.shape, it.nbytes) == plan.chunks[it.array][it.chunk]
            seen.append((it.array, it.chunk))
        assert f.size == end
    # every chunk written exactly once, in array order across files
    assert seen == [(a, c) for a, per in enumerate(plan.chunks) for c in range(len(per))]
    assert plan.total_bytes == sum(nb for per in plan.chunks for _, _, nb in per)
    for a, per in enumerate(plan.chunks):
        assert all(nb == math.prod(sh) * specs[a].itemsize for _, sh, nb in per)


def test_docstring_example() -> None:
    p = plan_save([ArraySpec((4,), 4), ArraySpec((), 8)], file_prefix="data/r0",
                  max_files=4, max_chunk_bytes=1 << 20)
    assert [(f.name, f.size, len(f.items)) for f in p.files] == [("data/r0-0.bin", 72, 2)]
    assert [it.offset for it in p.files[0].items] == [0, 64]


def test_small_chunks_align_to_64_bytes() -> None:
    specs = [ArraySpec((3,), 1), ArraySpec((5,), 2), ArraySpec((1,), 8)]
    p = plan_save(specs, file_prefix="data/r0", max_files=1, max_chunk_bytes=1 << 20)
    assert [it.offset for it in p.files[0].items] == [0, 64, 128]
    assert p.files[0].size == 136
    check_layout(p, specs)


def test_large_chunks_align_to_pages() -> None:
    specs = [ArraySpec((100,), 1), ArraySpec((256 * KiB,), 1), ArraySpec((10,), 1),
             ArraySpec((300 * KiB,), 1)]
    p = plan_save(specs, file_prefix="data/r0", max_files=1, max_chunk_bytes=1 << 20)
    offs = [it.offset for it in p.files[0].items]
    assert offs == [0, 4096, 4096 + 256 * KiB, 4096 * 2 + 256 * KiB]
    check_layout(p, specs)


def test_chunk_just_below_page_threshold_packs_tightly() -> None:
    specs = [ArraySpec((1,), 1), ArraySpec((256 * KiB - 1,), 1)]
    p = plan_save(specs, file_prefix="data/r0", max_files=1, max_chunk_bytes=1 << 20)
    assert [it.offset for it in p.files[0].items] == [0, 64]


def test_balances_bytes_across_files() -> None:
    specs = [ArraySpec((1000,), 4) for _ in range(10)]
    p = plan_save(specs, file_prefix="data/r0", max_files=4, max_chunk_bytes=1 << 20,
                  min_file_bytes=1)
    assert len(p.files) == 4
    data = [sum(it.nbytes for it in f.items) for f in p.files]
    assert sum(data) == 40_000
    assert max(data) - min(data) <= 4000  # within one chunk
    check_layout(p, specs)


def test_balances_chunks_of_one_big_array() -> None:
    specs = [ArraySpec((64, 1024), 4)]  # 256 KiB in 4 KiB rows
    p = plan_save(specs, file_prefix="data/r0", max_files=3, max_chunk_bytes=8 * KiB,
                  min_file_bytes=1)
    assert len(p.files) == 3
    data = [sum(it.nbytes for it in f.items) for f in p.files]
    assert max(data) - min(data) <= 8 * KiB
    check_layout(p, specs)


def test_file_count_grows_with_state_size() -> None:
    specs = [ArraySpec((10 * KiB,), 1)]
    one = plan_save(specs, file_prefix="data/r0", max_files=8, max_chunk_bytes=KiB,
                    min_file_bytes=1 << 20)
    assert len(one.files) == 1
    three = plan_save(specs, file_prefix="data/r0", max_files=8, max_chunk_bytes=KiB,
                      min_file_bytes=4 * KiB)
    assert len(three.files) == 3
    capped = plan_save(specs, file_prefix="data/r0", max_files=2, max_chunk_bytes=KiB,
                       min_file_bytes=1)
    assert len(capped.files) == 2


def test_staging_bytes_only_for_copying_arrays() -> None:
    specs = [ArraySpec((10,), 4, copies=False), ArraySpec((6, 2), 8, copies=True)]
    p = plan_save(specs, file_prefix="data/r0", max_files=1, max_chunk_bytes=32)
    staged = {(it.array, it.chunk): it.staging_bytes for it in p.files[0].items}
    assert staged == {(0, 0): 0, (0, 1): 0, (1, 0): 32, (1, 1): 32, (1, 2): 32}
    check_layout(p, specs)


def test_empty_and_scalar_arrays() -> None:
    specs = [ArraySpec((0, 3), 4), ArraySpec((), 2), ArraySpec((0,), 8)]
    p = plan_save(specs, file_prefix="data/r1", max_files=4, max_chunk_bytes=100)
    assert p.chunks == [[], [((), (), 2)], []]
    assert p.total_bytes == 2
    assert [(f.name, f.size) for f in p.files] == [("data/r1-0.bin", 2)]


def test_no_arrays_no_files() -> None:
    p = plan_save([], file_prefix="data/r0", max_files=4, max_chunk_bytes=100)
    assert p.files == [] and p.chunks == [] and p.total_bytes == 0
    p = plan_save([ArraySpec((0,), 4)], file_prefix="data/r0", max_files=4,
                  max_chunk_bytes=100)
    assert p.files == [] and p.total_bytes == 0


_spec = st.builds(
    ArraySpec,
    st.lists(st.integers(0, 6), max_size=3).map(tuple),
    st.sampled_from([1, 2, 4, 8]),
    st.booleans(),
)


@settings(max_examples=60, deadline=None)
@given(st.lists(_spec, max_size=8), st.integers(1, 5), st.integers(1, 200),
       st.integers(1, 500))
def test_plan_save_property(specs: list[ArraySpec], max_files: int, max_chunk: int,
                            min_file: int) -> None:
    p = plan_save(specs, file_prefix="data/r0", max_files=max_files,
                  max_chunk_bytes=max_chunk, min_file_bytes=min_file)
    assert len(p.files) <= max_files
    check_layout(p, specs)
    for a, spec in enumerate(specs):
        assert [(s, sh) for s, sh, _ in p.chunks[a]] == split_chunks(
            spec.shape, spec.itemsize, max_chunk)
