"""Tests for engine/_plans.py: a multi-process save's plan kept apart from its values."""

from __future__ import annotations

import pytest

from statestream.engine import _plans
from statestream.engine._plans import (
    KeptPlan,
    fill_values,
    forget_plans,
    keep_plan,
    kept_plan,
    plan_digest,
    split_values,
    with_refs,
)
from statestream.format import encode_tree
from statestream.plan import ArrayDecl, RankTree, merge_trees
from statestream.tree import Node


def _arr(i: int) -> Node:
    return Node("array", array=i, attrs={"kind": "torch"})


def _rank_tree(rank: int, step: int) -> tuple[Node, list[ArrayDecl]]:
    """A rank's tree: shared keys, keys of its own, every kind of plain value."""
    leaves = Node("tuple", children=[Node("none"), Node("bool", value=step % 2 == 0),
                                     Node("float", value=step / 3)])
    own = Node("dict", keys=[f"r{rank}", "note"],
               children=[_arr(1), Node("str", value=f"rank {rank} at {step}")])
    nt = Node("namedtuple", keys=["a", "b"], children=[Node("int", value=step + rank), leaves],
              type_name="NT")
    tree = Node("dict", keys=["w", "own", "step", "nt", 3],
                children=[_arr(0), own, Node("int", value=step * 1000 + rank), nt,
                          Node("int", value=-(2 ** 70) - rank)])
    return tree, [ArrayDecl("w", "float32", (4,)), ArrayDecl(f"own/r{rank}", "int8", (2,))]


def _via_refs(trees: list[tuple[Node, list[ArrayDecl]]]) -> Node:
    structures = [split_values(t) for t, _ in trees]
    merged = merge_trees([RankTree(with_refs(s, r), decls)
                          for r, ((s, _), (_, decls)) in enumerate(zip(structures, trees))])
    return fill_values(merged.tree, [v for _, v in structures])


def test_merging_structures_then_filling_values_is_merging_the_trees() -> None:
    trees = [_rank_tree(r, 7 + r) for r in range(3)]
    want = merge_trees([RankTree(t, d) for t, d in trees])
    assert _via_refs(trees) == want.tree
    # the lowest rank holding a key path gives its value, as merge_trees does
    assert want.tree.children[2].value == 7000


def test_the_digest_sees_the_structure_and_arrays_not_the_values() -> None:
    def digest(step: int, decls_shape: tuple[int, ...] = (4,), key: str = "note") -> str:
        tree, _ = _rank_tree(0, step)
        tree.children[1].keys[1] = key  # type: ignore[index]
        s, _ = split_values(tree)
        return plan_digest(encode_tree(s), [["w", "float32", list(decls_shape)]])

    assert digest(1) == digest(2)
    assert digest(1) != digest(1, (5,))
    assert digest(1) != digest(1, key="other")
    # a value of another kind is another structure
    t, _ = _rank_tree(0, 1)
    t.children[2] = Node("float", value=1.0)
    assert plan_digest(encode_tree(split_values(t)[0]), []) != \
        plan_digest(encode_tree(split_values(_rank_tree(0, 1)[0])[0]), [])


def test_filling_refuses_a_value_of_another_kind() -> None:
    s, _ = split_values(Node("dict", keys=["x"], children=[Node("int", value=1)]))
    with pytest.raises(ValueError, match="rank 0's value 0 is not a int"):
        fill_values(with_refs(s, 0), [[Node("str", value="1")]])
    with pytest.raises(ValueError, match="rank 0's value 0"):
        fill_values(with_refs(s, 0), [[]])


def test_plans_are_kept_per_rank_and_digests_the_oldest_going_first() -> None:
    forget_plans()
    plan = KeptPlan(Node("none"), [], {}, [])
    try:
        keep_plan(0, ("a", "b"), plan)
        assert kept_plan(0, ("a", "b")) is plan
        assert kept_plan(1, ("a", "b")) is None and kept_plan(0, ("b", "a")) is None
        for i in range(_plans.KEEP):
            keep_plan(0, (str(i),), plan)
        assert kept_plan(0, ("a", "b")) is None  # the oldest went
        assert kept_plan(0, ("0",)) is plan
        keep_plan(0, ("new",), plan)  # "0" was used last: "1" goes
        assert kept_plan(0, ("0",)) is plan and kept_plan(0, ("1",)) is None
    finally:
        forget_plans()


def test_kept_plans_are_bounded_by_their_arrays(monkeypatch: pytest.MonkeyPatch) -> None:
    forget_plans()
    monkeypatch.setattr(_plans, "KEEP_ARRAYS", 10)

    def plan(n: int) -> KeptPlan:
        return KeptPlan(Node("none"), [object()] * n, {}, [])

    try:
        keep_plan(0, ("a",), plan(6))
        keep_plan(0, ("b",), plan(4))  # 10 arrays in all: both stay
        assert kept_plan(0, ("a",)) is not None and kept_plan(0, ("b",)) is not None
        keep_plan(0, ("c",), plan(3))  # 13: the least recently used ("a") goes
        assert kept_plan(0, ("a",)) is None and kept_plan(0, ("b",)) is not None
        big = plan(50)
        keep_plan(0, ("d",), big)  # over the bound alone: the newest is still kept
        assert kept_plan(0, ("d",)) is big
        assert kept_plan(0, ("b",)) is None and kept_plan(0, ("c",)) is None
    finally:
        forget_plans()
