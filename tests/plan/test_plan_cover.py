"""Tests for statestream.plan._cover: the ranks' boxes of an array must cover it exactly
once, checked while planning a multi-process save (assign_writers)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from statestream.errors import TargetMismatchError
from statestream.plan import _cover, assign_writers
from statestream.plan._cover import Box, CoverFault, cover_fault

ISZ = {"float32": 4}


def _grid(cuts: list[list[int]]) -> list[Box]:
    """The cells of the product grid with these cut points per axis."""
    spans = [list(zip(c, c[1:])) for c in cuts]
    return [(tuple(a for a, _ in cell), tuple(b - a for a, b in cell))
            for cell in itertools.product(*spans)]


def _counts(shape: tuple[int, ...], boxes: list[Box]) -> np.ndarray:
    """How many boxes hold each element (what the check must agree with)."""
    counts = np.zeros(shape, dtype=np.int64)
    for s, n in boxes:
        counts[tuple(slice(x, x + k) for x, k in zip(s, n))] += 1
    return counts


def _at(a: np.ndarray, box: Box) -> np.ndarray:
    return a[tuple(slice(x, x + k) for x, k in zip(*box))]


@pytest.mark.parametrize("shape, boxes", [
    ((4, 4), [((0, 0), (4, 4))]),                               # plain or replicated
    ((), [((), ())]),                                           # a 0-d array
    ((0, 3), []),                                               # empty: nothing to hold
    ((7, 3), [((0, 0), (3, 3)), ((3, 0), (3, 3)), ((6, 0), (1, 3))]),   # uneven rows
    ((4, 6), [((0, 0), (4, 3)), ((0, 3), (4, 3))]),             # Shard(1)
    ((4, 4), _grid([[0, 2, 4], [0, 1, 4]])),                    # a 2-D mesh
    ((4, 6, 2), _grid([[0, 1, 4], [0, 3, 6], [0, 2]])),         # 3-D
    ((8, 2), [((0, 0), (2, 2)), ((4, 0), (2, 2)), ((2, 0), (2, 2)), ((6, 0), (2, 2))]),
    ((4, 4), [((0, 0), (2, 4)), ((2, 0), (2, 4)), ((4, 0), (0, 4))]),  # an empty shard
    # not a product grid: a brick wall
    ((2, 4), [((0, 0), (1, 2)), ((0, 2), (1, 2)), ((1, 0), (1, 1)), ((1, 1), (1, 3))]),
])
def test_layouts_that_hold_every_element_once_pass(shape: tuple[int, ...],
                                                    boxes: list[Box]) -> None:
    assert cover_fault(shape, boxes) is None


def test_product_grids_are_checked_without_the_cell_count(monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    def slow(*_: object) -> None:
        raise AssertionError("took the slow path")

    monkeypatch.setattr(_cover, "_grid_fault", slow)
    monkeypatch.setattr(_cover, "_sweep_fault", slow)
    cuts = [0, *range(3, 3 * 128, 3), 3 * 128]
    assert cover_fault((384, 384), _grid([cuts, cuts])) is None       # 16384 boxes
    assert cover_fault((20000, 2), _grid([list(range(20001)), [0, 2]])) is None
    assert cover_fault((6, 4, 4), _grid([[0, 3, 6], [0, 4], [0, 1, 2, 4]])) is None


@st.composite
def _layouts(draw: st.DrawFn) -> tuple[tuple[int, ...], list[Box]]:
    """A grid's cells, some merged or lost, maybe a stray box: any layout, mostly
    nearly right."""
    nd = draw(st.integers(1, 3))
    shape = tuple(draw(st.lists(st.integers(1, 6), min_size=nd, max_size=nd)))
    cuts = [[0, *sorted(draw(st.sets(st.integers(1, max(1, d - 1)), max_size=3)) - {d}), d]
            for d in shape]
    boxes = _grid(cuts)
    for _ in range(draw(st.integers(0, 2))):
        if boxes:
            boxes.pop(draw(st.integers(0, len(boxes) - 1)))
    for _ in range(draw(st.integers(0, 2))):
        s = tuple(draw(st.integers(0, d - 1)) for d in shape)
        n = tuple(draw(st.integers(1, d - x)) for x, d in zip(s, shape))
        boxes.append((s, n))
    return shape, list(dict.fromkeys(boxes))  # distinct, as assign_writers passes them


def _check_against_counts(shape: tuple[int, ...], boxes: list[Box]) -> None:
    counts = _counts(shape, boxes)
    fault = cover_fault(shape, boxes)
    assert (fault is None) == bool(np.all(counts == 1)), (boxes, fault)
    if fault is None:
        return
    assert fault.kind in ("gap", "overlap")
    if fault.kind == "overlap":
        assert fault.region is not None and all(b in boxes for b in fault.boxes)
        assert np.all(_at(counts, fault.region) >= 2)
        for b in fault.boxes:  # each of the two holds all of the region
            assert np.all(_at(_counts(shape, [b]), fault.region) == 1)
    else:
        assert not np.any(counts >= 2)  # a gap is reported once no overlap is found
        assert fault.missing == int(np.sum(counts == 0))
        if fault.region is not None:
            assert np.all(_at(counts, fault.region) == 0)


@settings(max_examples=300, deadline=None)
@given(_layouts())
def test_the_fault_is_where_the_elements_say(layout: tuple[tuple[int, ...], list[Box]]) -> None:
    _check_against_counts(*layout)


@settings(max_examples=150, deadline=None)
@given(_layouts())
def test_a_layout_too_fine_for_the_cell_count_is_swept(
        layout: tuple[tuple[int, ...], list[Box]]) -> None:
    old = _cover._CELLS_PER_BOX, _cover._CELLS_FREE
    _cover._CELLS_PER_BOX, _cover._CELLS_FREE = 0, 0
    try:
        _check_against_counts(*layout)
    finally:
        _cover._CELLS_PER_BOX, _cover._CELLS_FREE = old


def test_a_box_outside_the_array_is_named() -> None:
    assert cover_fault((4,), [((0,), (2,)), ((2,), (3,))]) == \
        CoverFault("outside", None, (((2,), (3,)),))


def _desc(key: str, shape: tuple[int, ...], *boxes: Box) -> tuple[str, str, tuple[int, ...],
                                                                   list[Box]]:
    return key, "float32", shape, list(boxes)


ROWS01, ROWS23, WHOLE = ((0, 0), (2, 4)), ((2, 0), (2, 4)), ((0, 0), (4, 4))


def _raised(per_rank: list[list[tuple[str, str, tuple[int, ...], list[Box]]]]) -> str:
    with pytest.raises(TargetMismatchError) as info:
        assign_writers(per_rank, ISZ)
    return str(info.value)


def test_a_sharded_key_path_on_one_rank_only_names_what_no_rank_holds() -> None:
    b = _desc("b", (2,), ((0,), (2,)))
    msg = _raised([[b], [b, _desc("extra", (4, 4), ROWS23)]])
    assert msg.startswith("rows 0-1 of key path 'extra' (float32[4, 4]) are held by no rank "
                          "(8 of its 16 elements are); rank 1 holds rows 2-3; rank 0 has no "
                          "such key path."), msg
    assert msg.endswith("nothing was written")


def test_a_sharded_array_on_one_rank_and_a_plain_one_on_another_overlap() -> None:
    msg = _raised([[_desc("a", (4, 4), ROWS01)], [_desc("a", (4, 4), WHOLE)]])
    assert msg.startswith("rows 0-1 of key path 'a' (float32[4, 4]) are held by ranks 0 and 1 "
                          "with different boxes; rank 0 holds rows 0-1; rank 1 holds the whole "
                          "array."), msg


def test_different_placements_on_different_ranks_overlap() -> None:
    msg = _raised([[_desc("a", (4, 4), ROWS01)], [_desc("a", (4, 4), ((0, 2), (4, 2)))]])
    assert msg.startswith("elements [0:2, 2:4] of key path 'a' (float32[4, 4]) are held by "
                          "ranks 0 and 1 with different boxes; rank 0 holds rows 0-1; rank 1 "
                          "holds columns 2-3."), msg


def test_replicas_count_once_and_every_rank_is_accounted_for() -> None:
    # ranks 0-3 hold a Replicate x Shard(0) layout but rank 5 holds a shard of its own
    # and rank 4 an empty one (it saves the key path, holds none of it)
    shard = [[_desc("w", (8, 2), ((2 * (r % 2), 0), (2, 2)))] for r in range(4)]
    msg = _raised([*shard, [_desc("w", (8, 2))], [_desc("w", (8, 2), ((6, 0), (2, 2)))], []])
    assert msg.startswith("rows 4-5 of key path 'w' (float32[8, 2]) are held by no rank (4 of "
                          "its 16 elements are); ranks 0, 2 hold rows 0-1; ranks 1, 3 hold rows "
                          "2-3; rank 5 holds rows 6-7; rank 4 holds none of it; rank 6 has no "
                          "such key path."), msg


def test_the_boxes_of_one_rank_are_named_together() -> None:
    # _StridedShard-like: rank 0 holds two blocks of rows, rank 1 one, and rows 6-7 none
    msg = _raised([[_desc("s", (8,), ((0,), (2,)), ((4,), (2,)))], [_desc("s", (8,),
                                                                       ((2,), (2,)))]])
    assert msg.startswith("elements 6-7 of key path 's' (float32[8]) are held by no rank (2 of "
                          "its 8 elements are); rank 0 holds elements 0-1, elements 4-5; rank 1 "
                          "holds elements 2-3."), msg


def test_a_long_list_of_boxes_is_cut_short() -> None:
    per_rank = [[_desc("v", (64,), ((r,), (1,)))] if r != 10 else [] for r in range(64)]
    msg = _raised(per_rank)
    assert "element 10 of key path 'v' (float32[64]) is held by no rank (1 of its 64" in msg
    assert "rank 7 holds element 7; 55 more boxes are held; rank 10 has no such key path" in msg


def test_layouts_that_tile_still_get_one_writer_per_box() -> None:
    # a plain tensor on one rank only is the whole array: kept, as documented
    per_rank = [[_desc("a", (4, 4), ROWS01)], [_desc("a", (4, 4), ROWS23),
                                               _desc("only1", (3,), ((0,), (3,)))]]
    assert assign_writers(per_rank, ISZ) == {("a", (0, 0), (2, 4)): 0, ("a", (2, 0), (2, 4)): 1,
                                             ("only1", (0,), (3,)): 1}
