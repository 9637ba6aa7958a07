"""Tests for statestream.plan._manifest: tree merge across ranks, manifest building, and
recognising a committed manifest as one's own."""

from __future__ import annotations

from typing import Any

import pytest

from statestream.errors import TargetMismatchError
from statestream.format import (
    ChunkEntry,
    ChunkRef,
    FileEntry,
    decode_manifest,
    encode_manifest,
)
from statestream.plan import (
    ArrayDecl,
    MergedTree,
    RankPart,
    RankTree,
    build_manifest,
    manifest_matches,
    merge_trees,
)
from statestream.tree import Node


def _dict(keys: list[str], kids: list[Node]) -> Node:
    return Node("dict", keys=list(keys), children=kids)


def _arr(i: int) -> Node:
    return Node("array", array=i, attrs={"kind": "numpy"})


def test_keyed_containers_unite_in_rank_order_and_arrays_are_numbered_first_seen() -> None:
    r0 = RankTree(_dict(["shared", "only0", "step"], [_arr(0), _arr(1), Node("int", value=7)]),
                  [ArrayDecl("shared", "float32", (4,)), ArrayDecl("only0", "int8", (2,))])
    r1 = RankTree(_dict(["only1", "shared", "step"], [_arr(0), _arr(1), Node("int", value=9)]),
                  [ArrayDecl("only1", "uint8", (3,)), ArrayDecl("shared", "float32", (4,))])
    m = merge_trees([r0, r1])
    assert m.tree.keys == ["shared", "only0", "step", "only1"]
    assert m.index == {"shared": 0, "only0": 1, "only1": 2}
    assert [a.key for a in m.arrays] == ["shared", "only0", "only1"]
    assert m.tree.children is not None and m.tree.children[2].value == 7  # rank 0 decides
    assert [c.array for c in m.tree.children if c.kind == "array"] == [0, 1, 2]


@pytest.mark.parametrize("other,words", [
    (_dict(["a"], [_dict(["x"], [_arr(0)])]), ["rank 0 holds an array (float32[4])",
                                               "rank 1 holds a dict", "'a'"]),
    (_dict(["a"], [Node("list", children=[_arr(0)] * 2)]), ["rank 1 holds a list of 2"]),
])
def test_kind_mismatch_names_every_rank(other: Node, words: list[str]) -> None:
    r0 = RankTree(_dict(["a"], [_arr(0)]), [ArrayDecl("a", "float32", (4,))])
    r1 = RankTree(other, [ArrayDecl("a/x", "float32", (4,))])
    with pytest.raises(TargetMismatchError) as ei:
        merge_trees([r0, r1, r0])
    for w in words:
        assert w in str(ei.value), str(ei.value)
    assert "rank 2 holds an array" in str(ei.value)


def test_list_lengths_and_array_shapes_must_agree() -> None:
    def lst(n: int) -> RankTree:
        return RankTree(_dict(["l"], [Node("list", children=[Node("none")] * n)]), [])

    with pytest.raises(TargetMismatchError, match="lists of different lengths at key path 'l'"):
        merge_trees([lst(3), lst(2)])
    a = RankTree(_dict(["w"], [_arr(0)]), [ArrayDecl("w", "float32", (4,))])
    b = RankTree(_dict(["w"], [_arr(0)]), [ArrayDecl("w", "float32", (5,))])
    with pytest.raises(TargetMismatchError, match=r"rank 0: float32\[4\]; rank 1: float32\[5\]"):
        merge_trees([a, b])


def test_parts_join_with_file_indices_remapped_and_survive_the_wire() -> None:
    tree = RankTree(_dict(["w"], [_arr(0)]), [ArrayDecl("w", "uint8", (8,))])
    m = merge_trees([tree, tree])
    p0 = RankPart([FileEntry("data/r0-0.bin", 4)], {0: [ChunkEntry(0, 0, 4, 1, (0,), (4,))]})
    p1 = RankPart([FileEntry("data/r1-0.bin", 64), FileEntry("data/r1-1.bin", 4)],
                  {0: [ChunkEntry(1, 0, 4, 2, (4,), (4,))]})
    p1 = RankPart.from_wire(p1.to_wire())
    man = build_manifest(m, [p0, p1], {"world_size": 2})
    assert [f.name for f in man.files] == ["data/r0-0.bin", "data/r1-0.bin", "data/r1-1.bin"]
    assert [(c.file, c.start) for c in man.arrays[0].chunks] == [(0, (0,)), (2, (4,))]
    back = decode_manifest(encode_manifest(man), "test")
    assert back.arrays[0].chunks[1].checksum == 2


def test_v2_chunk_fields_make_a_v2_manifest_and_travel_between_ranks() -> None:
    tree = RankTree(Node("array", array=0), [ArrayDecl("", "uint8", (4,))])
    m = merge_trees([tree])
    plain = ChunkEntry(0, 0, 4, 1, (0,), (4,))
    assert plain.codec is None and plain.ref is None and plain.digest is None
    ok = build_manifest(m, [RankPart([FileEntry("data/r0-0.bin", 4)], {0: [plain]})], {})
    assert b"codec" not in encode_manifest(ok) and b'"version":1,' in encode_manifest(ok)
    digest = bytes(range(16))
    for chunk in (ChunkEntry(0, 0, 3, 1, (0,), (4,), codec="zstd", shuffle=True),
                  ChunkEntry(0, 0, 4, 1, (0,), (4,), digest=digest),
                  ChunkEntry(0, 0, 4, 1, (0,), (4,), digest=digest,
                             ref=ChunkRef("step_1", 0))):
        part = RankPart([FileEntry("data/r0-0.bin", 4)], {0: [chunk]})
        assert RankPart.from_wire(part.to_wire()) == part
        data = encode_manifest(build_manifest(m, [part], {}))
        assert b'"version":2,' in data
        assert decode_manifest(data, "test").arrays[0].chunks[0] == chunk


def _two_ranks(step: int) -> tuple[MergedTree, list[RankPart]]:
    trees = [RankTree(_dict(["w", "step"], [_arr(0), Node("int", value=step)]),
                      [ArrayDecl("w", "uint8", (8,))]) for _ in range(2)]
    parts = [RankPart([FileEntry("data/r0-0.bin", 4)], {0: [ChunkEntry(0, 0, 4, 1, (0,), (4,))]}),
             RankPart([FileEntry("data/r1-0.bin", 4)], {0: [ChunkEntry(0, 0, 4, 2, (4,), (4,))]})]
    return merge_trees(trees), parts


def test_a_committed_manifest_matches_only_the_parts_that_built_it() -> None:
    merged, parts = _two_ranks(7)
    meta: dict[str, Any] = {"library": "statestream x", "created_unix": 1.5, "world_size": 2,
            "user": {"run": "a", "tags": ("x", "y")}}
    data = encode_manifest(build_manifest(merged, parts, meta))
    # another process's clock and a user tuple that JSON made a list: still this save
    mine = dict(meta, created_unix=99.0)
    assert manifest_matches(data, merged, parts, mine)
    # an older checkpoint that differs only in a plain value
    old, _ = _two_ranks(3)
    older = encode_manifest(build_manifest(old, parts, meta))
    assert not manifest_matches(older, merged, parts, mine)
    # another chunk checksum, another file size, other user metadata, another world
    crc = [parts[0], RankPart(parts[1].files, {0: [ChunkEntry(0, 0, 4, 3, (4,), (4,))]})]
    size = [parts[0], RankPart([FileEntry("data/r1-0.bin", 5)], parts[1].chunks)]
    for other_parts in (crc, size):
        assert not manifest_matches(data, merged, other_parts, mine)
    for other_meta in (dict(mine, user={"run": "b", "tags": ["x", "y"]}),
                       {k: v for k, v in mine.items() if k != "user"},
                       dict(mine, world_size=3)):
        assert not manifest_matches(data, merged, parts, other_meta)
    # not a manifest at all
    assert not manifest_matches(b"{}", merged, parts, mine)


def test_merged_trees_keep_every_field_of_every_node() -> None:
    # merge_trees builds nodes field by field (dataclasses.replace was too slow): a new
    # Node field must be carried there too, or merged trees would silently drop it.
    import dataclasses

    assert [f.name for f in dataclasses.fields(Node)] == [
        "kind", "keys", "children", "type_name", "value", "array", "attrs"], \
        "Node changed: carry the new field in plan/_manifest.py (_merge, _keyed, _number)"
    leaf = Node("array", array=0, attrs={"kind": "torch"}, type_name="T")
    seq = Node("tuple", children=[Node("int", value=3)], type_name="Pair", attrs={"a": 1})
    tree = Node("namedtuple", keys=["w", "p"], children=[leaf, seq], type_name="NT",
                attrs={"b": 2})
    m = merge_trees([RankTree(tree, [ArrayDecl("w", "float32", (2,))])] * 3)
    assert m.tree == tree  # the same tree back, node for node, field for field


def test_a_chunk_moved_to_another_file_keeps_every_other_field() -> None:
    import dataclasses

    c = ChunkEntry(1, 4096, 100, 7, (2, 0), (3, 4), 1, (5, 6, 7), "zstd", True, b"\x01" * 16,
                   ChunkRef("../base", 1))
    names = [f.name for f in dataclasses.fields(ChunkEntry)]
    assert all(getattr(c, n) != getattr(ChunkEntry(0, 0, 0, 0, (), ()), n) for n in names), \
        "give every field a non-default value here"
    assert c.in_file(9) == dataclasses.replace(c, file=9)


def test_a_tie_on_one_rank_only_is_described_as_a_tie() -> None:
    # rank 0 saved the same tensor twice (stored once: an alias of array 0), rank 1 a copy
    tied = RankTree(_dict(["a", "b"], [_arr(0), Node("alias", array=0)]),
                    [ArrayDecl("a", "float32", (2,))])
    copy = RankTree(_dict(["a", "b"], [_arr(0), _arr(1)]),
                    [ArrayDecl("a", "float32", (2,)), ArrayDecl("b", "float32", (2,))])
    with pytest.raises(TargetMismatchError) as ei:
        merge_trees([tied, copy])
    assert ("different kinds of value at key path 'b': rank 0 holds the same array as 'a' "
            "(tied: float32[2]); rank 1 holds an array (float32[2])") in str(ei.value)


def _int_and_str(rank_keys: list[Any], shapes: dict[Any, tuple[int, ...]]) -> RankTree:
    """A rank saving {"a": {k: array}} for each of ``rank_keys`` (its decls as a save
    makes them: keys told apart by key type)."""
    decls = [ArrayDecl.at(("a", k), "float32", shapes[k]) for k in rank_keys]
    return RankTree(_dict(["a"], [_dict(rank_keys, [_arr(i) for i in range(len(rank_keys))])]),
                    decls)


def test_an_int_key_and_the_str_key_that_reads_alike_are_two_arrays() -> None:
    shapes = {0: (2,), "0": (3,)}
    both = _int_and_str([0, "0"], shapes)
    m = merge_trees([both, both])
    assert [a.shape for a in m.arrays] == [(2,), (3,)]  # not one array, not a disagreement
    inner = m.tree.children[0]  # type: ignore[index]
    assert inner.keys == [0, "0"] and [c.array for c in inner.children] == [0, 1]
    assert len(set(m.index.values())) == 2
    # a rank holding both tells two entries from a rank holding one of them
    assert len(merge_trees([_int_and_str([0], shapes), both]).arrays) == 2
    assert len(merge_trees([both, _int_and_str(["0"], shapes)]).arrays) == 2


def test_an_int_key_on_one_rank_and_its_str_twin_on_another_are_refused() -> None:
    shapes = {0: (2,), "0": (2,)}
    with pytest.raises(TargetMismatchError) as ei:
        merge_trees([_int_and_str([0], shapes), _int_and_str(["0"], shapes),
                     _int_and_str([0, "0"], shapes)])
    assert ("processes saved keys of different types at key path 'a': rank 0 holds the int "
            "key 0; rank 1 holds the str key '0'; rank 2 holds the int key 0 and the str key "
            "'0'. Every process must save the same structure; nothing was written"
            ) in str(ei.value)
    plain = [RankTree(_dict(["a"], [_dict([k], [Node("int", value=1)])]), []) for k in ("5", 5)]
    with pytest.raises(TargetMismatchError, match="rank 0 holds the str key '5'; rank 1 holds "
                       "the int key 5"):
        merge_trees(plain)


def _tied_pair(unheld: bool = False, tied: bool = True, shape: tuple[int, ...] = (2, 2)
               ) -> RankTree:
    """A rank saving {"a": w, "b": w}: as a tie (an alias of array 0), or as two arrays
    -- what a rank whose shard of w is empty walks (``unheld``: it holds no element)."""
    if tied:
        return RankTree(_dict(["a", "b"], [_arr(0), Node("alias", array=0)]),
                        [ArrayDecl("a", "float32", (2, 2))])
    return RankTree(_dict(["a", "b"], [_arr(0), _arr(1)]),
                    [ArrayDecl("a", "float32", (2, 2)), ArrayDecl("b", "float32", shape)],
                    {0, 1} if unheld else ())


@pytest.mark.parametrize("order", [[0, 1, 2], [2, 0, 1], [0, 2, 1]])
def test_a_rank_holding_no_element_of_a_tied_array_takes_the_tie(order: list[int]) -> None:
    # ranks 0 and 1 see w twice in the same memory; rank 2's shard of w is empty, so its
    # walk cannot tell: it has no say, and the tie is stored once on every rank
    views = [_tied_pair(), _tied_pair(), _tied_pair(unheld=True, tied=False)]
    m = merge_trees([views[r] for r in order])
    assert m.tree.children is not None
    assert [c.kind for c in m.tree.children] == ["array", "alias"]
    assert [c.array for c in m.tree.children] == [0, 0]
    assert len(m.arrays) == 1 and m.index == {"a": 0, "b": 0} and m.tied == {"b": "a"}


def test_a_tie_is_refused_where_a_rank_holding_elements_saves_two_arrays() -> None:
    # a rank whose shard is empty is said to hold no element: it has no say in the tie,
    # and "rank 1 holds an array" read as one more rank that disagreed
    views = [_tied_pair(), _tied_pair(unheld=True, tied=False), _tied_pair(tied=False)]
    with pytest.raises(TargetMismatchError, match="different kinds of value at key path 'b'"
                       ) as ei:
        merge_trees(views)
    assert ("rank 0 holds the same array as 'a' (tied: float32[2, 2]); rank 1 holds an array "
            "(float32[2, 2]) but none of its elements (an empty shard); rank 2 holds an "
            "array (float32[2, 2]). ") in str(ei.value)
    with pytest.raises(TargetMismatchError) as ei:  # unheld, but not the tied array's shape
        merge_trees([_tied_pair(), _tied_pair(unheld=True, tied=False, shape=(4,))])
    assert ("processes disagree about the array at key path 'a' (rank 0: float32[2, 2]; "
            "rank 1: float32[2, 2], but none of its elements (an empty shard); rank 1: "
            "float32[4] at 'b', tied to it, but none of its elements (an empty shard))"
            ) in str(ei.value)


def test_ties_to_different_arrays_are_refused() -> None:
    # rank 0 saved {"a": x, "b": y, "c": x}, rank 1 {"a": x, "b": y, "c": y}: 'c' is
    # stored once either way, but as which array? (rank 0's view was taken silently)
    def view(target: int) -> RankTree:
        return RankTree(_dict(["a", "b", "c"], [_arr(0), _arr(1), Node("alias", array=target)]),
                        [ArrayDecl("a", "float32", (2,)), ArrayDecl("b", "float32", (2,))])

    with pytest.raises(TargetMismatchError) as ei:
        merge_trees([view(0), view(1)])
    assert ("processes saved ties to different arrays at key path 'c': rank 0 holds the same "
            "array as 'a' (tied: float32[2]); rank 1 holds the same array as 'b' (tied: "
            "float32[2])") in str(ei.value)
    assert merge_trees([view(1), view(1)]).index == {"a": 0, "b": 1}
