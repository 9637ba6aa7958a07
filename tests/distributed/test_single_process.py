"""Tests for statestream.distributed._base.SingleProcess."""

from __future__ import annotations

import inspect

from statestream.distributed import Collective, SingleProcess


def test_rank_and_world_size() -> None:
    c = SingleProcess()
    assert c.rank == 0 and c.world_size == 1
    assert type(c.rank) is int and type(c.world_size) is int


def test_barrier_returns_immediately() -> None:
    c = SingleProcess()
    assert c.barrier("statestream.save.written") is None
    assert c.barrier("") is None


def test_all_gather_returns_own_object_in_a_list() -> None:
    c = SingleProcess()
    obj = {"files": ["data/r0-0.bin"], "n": 3}
    out = c.all_gather_object(obj)
    assert out == [obj] and out[0] is obj
    assert c.all_gather_object(None) == [None]


def test_gather_to_the_one_process_returns_own_object_in_a_list() -> None:
    c = SingleProcess()
    obj = {"n": 1}
    out = c.gather_object(obj)
    assert out == [obj] and out[0] is obj


def test_broadcast_returns_object() -> None:
    c = SingleProcess()
    obj = ["x"]
    assert c.broadcast_object(obj) is obj
    assert c.broadcast_object(obj, src=0) is obj


def test_implements_every_collective_member() -> None:
    members = {n for n in vars(Collective) if not n.startswith("_")}
    assert members == {"rank", "world_size", "barrier", "all_gather_object", "broadcast_object",
                       "fork"}
    for name in members:
        assert hasattr(SingleProcess, name)
        proto, impl = getattr(Collective, name), getattr(SingleProcess, name)
        if callable(proto):
            assert list(inspect.signature(impl).parameters) == list(
                inspect.signature(proto).parameters)


def test_a_rank_that_leaves_records_nothing_without_a_store() -> None:
    from statestream.distributed import forget_left, note_left

    note_left(SingleProcess(), ValueError("x"), "its block")  # no store: nothing, no error
    forget_left(SingleProcess())


def test_the_record_of_a_rank_that_left_is_bounded() -> None:
    from statestream.distributed._left import MAX_CHARS, left_text

    text = left_text(ValueError("y" * 10_000 + "\nsecond line"), "its block")
    assert len(text) == MAX_CHARS and text.startswith("its block raised ValueError: yyy")
    assert left_text(KeyboardInterrupt(), "its block") == "its block raised KeyboardInterrupt"
