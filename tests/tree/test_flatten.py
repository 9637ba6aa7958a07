"""Tests for statestream.tree._flatten: flatten() and rebuild_container()."""

from __future__ import annotations

import collections
import dataclasses
from typing import Any, NamedTuple

import numpy as np
import pytest

from statestream.errors import CheckpointError, TargetMismatchError, UnsupportedTypeError
from statestream.providers import expand_pytree
from statestream.tree import (
    CONTAINER_KINDS,
    MAX_TREE_DEPTH,
    KeyPath,
    Node,
    flatten,
    is_stateful,
    rebuild_container,
    type_name,
)


def leaf(path: KeyPath, x: Any) -> Node | None:
    """A leaf function like save()'s: plain values and NumPy arrays."""
    if x is None:
        return Node("none")
    for t, kind in ((bool, "bool"), (int, "int"), (float, "float"), (str, "str")):
        if type(x) is t:
            return Node(kind, value=x)
    if isinstance(x, np.ndarray):
        return Node("array", value=x, attrs={"path": path})
    return None


class Point(NamedTuple):
    x: Any
    y: Any


@dataclasses.dataclass
class Config:
    lr: float
    layers: list[int]
    extra: Any = None


@dataclasses.dataclass(frozen=True)
class Frozen:
    a: int
    b: int = dataclasses.field(default=0, init=False)


class Counter:
    def __init__(self, n: int) -> None:
        self.n = n

    def state_dict(self) -> dict[str, Any]:
        return {"n": self.n, "w": np.arange(3)}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.n = sd["n"]


class BrokenStateful:
    def state_dict(self) -> Any:
        raise RuntimeError("boom")

    def load_state_dict(self, sd: Any) -> None:
        pass


def leaves_of(node: Node, path: KeyPath = ()) -> dict[KeyPath, Node]:
    out: dict[KeyPath, Node] = {}
    if node.kind == "stateful":
        assert node.children is not None
        return leaves_of(node.children[0], path)
    if node.children is None:
        out[path] = node
        return out
    keys = node.keys if node.keys is not None else list(range(len(node.children)))
    for k, c in zip(keys, node.children):
        out.update(leaves_of(c, path + (k,)))
    return out


# ----------------------------------------------------------------------------- flatten


def test_plain_containers() -> None:
    state = {"a": [1, 2.5, (None, "s")], 3: True}
    node = flatten(state, leaf)
    assert node.kind == "dict" and node.keys == ["a", 3] and node.type_name is None
    lst = node.child("a")
    assert lst is not None and lst.kind == "list" and lst.keys is None
    tup = lst.child(2)
    assert tup is not None and tup.kind == "tuple"
    got = {p: (n.kind, n.value) for p, n in leaves_of(node).items()}
    assert got == {
        ("a", 0): ("int", 1),
        ("a", 1): ("float", 2.5),
        ("a", 2, 0): ("none", None),
        ("a", 2, 1): ("str", "s"),
        (3,): ("bool", True),
    }


def test_child_lookup_distinguishes_int_and_str_keys() -> None:
    node = flatten({1: 10, "1": 20}, leaf)
    one, s_one = node.child(1), node.child("1")
    assert one is not None and one.value == 10
    assert s_one is not None and s_one.value == 20
    assert node.child(2) is None
    lst = flatten([5], leaf)
    assert lst.child(0) is not None and lst.child(1) is None and lst.child("0") is None
    assert Node("int", value=1).child(0) is None


def test_dict_subclass_records_type_name() -> None:
    node = flatten(collections.OrderedDict(b=1, a=2), leaf)
    assert node.kind == "dict"
    assert node.keys == ["b", "a"]  # insertion order kept
    assert node.type_name == "collections.OrderedDict"


def test_namedtuple() -> None:
    node = flatten(Point(1, np.zeros(2)), leaf)
    assert node.kind == "namedtuple"
    assert node.keys == ["x", "y"]
    assert node.type_name == type_name(Point(0, 0))
    assert set(leaves_of(node)) == {("x",), ("y",)}


def test_dataclass() -> None:
    node = flatten(Config(0.1, [1, 2]), leaf)
    assert node.kind == "dataclass"
    assert node.keys == ["lr", "layers", "extra"]
    assert node.type_name is not None and node.type_name.endswith("Config")
    assert set(leaves_of(node)) == {("lr",), ("layers", 0), ("layers", 1), ("extra",)}


def test_dataclass_class_itself_is_not_walked() -> None:
    with pytest.raises(UnsupportedTypeError, match="key path 'cls'"):
        flatten({"cls": Config}, leaf)


def test_stateful_object() -> None:
    c = Counter(7)
    assert is_stateful(c) and not is_stateful(Counter) and not is_stateful({})
    node = flatten({"opt": c}, leaf)
    inner = node.child("opt")
    assert inner is not None and inner.kind == "stateful"
    assert inner.type_name is not None and inner.type_name.endswith("Counter")
    assert inner.children is not None and len(inner.children) == 1
    sd = inner.children[0]
    assert sd.kind == "dict" and sd.keys == ["n", "w"]
    # the state dict's leaves keep the stateful object's key path
    assert leaves_of(node)[("opt", "w")].attrs == {"path": ("opt", "w")}


def test_stateful_state_dict_failure_names_key_path() -> None:
    with pytest.raises(UnsupportedTypeError, match=r"key path 'm/x~1y'.*RuntimeError: boom"):
        flatten({"m": {"x/y": BrokenStateful()}}, leaf)


def test_leaf_fn_wins_over_containers() -> None:
    def claim_lists(path: KeyPath, x: Any) -> Node | None:
        if isinstance(x, list):
            return Node("str", value="claimed")
        return leaf(path, x)

    node = flatten({"a": [1, 2]}, claim_lists)
    a = node.child("a")
    assert a is not None and a.kind == "str" and a.value == "claimed"


def test_fallback_fn_gets_unknown_values() -> None:
    seen: list[KeyPath] = []

    def fallback(path: KeyPath, x: Any) -> Node | None:
        seen.append(path)
        return Node("pickle", array=0)

    node = flatten({"o": object()}, leaf, fallback_fn=fallback)
    o = node.child("o")
    assert o is not None and o.kind == "pickle"
    assert seen == [("o",)]


def test_path_argument_prefixes_error_paths() -> None:
    with pytest.raises(UnsupportedTypeError, match="key path 'root/x'"):
        flatten({"x": object()}, leaf, path=("root",))


# ----------------------------------------------------------------------------- errors


@pytest.mark.parametrize("bad_key", [(1, 2), 1.5, None, b"k", True])
def test_unsupported_mapping_key_names_key_path(bad_key: Any) -> None:
    with pytest.raises(UnsupportedTypeError) as ei:
        flatten({"outer": {"ok": 1, bad_key: 2}}, leaf)
    msg = str(ei.value)
    assert "key path 'outer'" in msg and "use str or int keys" in msg
    assert isinstance(ei.value, TypeError) and isinstance(ei.value, CheckpointError)


def test_unsupported_type_names_key_path_and_suggests_pickle() -> None:
    with pytest.raises(UnsupportedTypeError) as ei:
        flatten({"a": [1, {"b/c": {1, 2}}]}, leaf)
    msg = str(ei.value)
    assert "builtins.set" in msg
    assert "key path 'a/1/b~1c'" in msg
    assert "pickle_paths=['a/1/b~1c']" in msg


def test_cycle_through_dict_names_key_path() -> None:
    d: dict[str, Any] = {"x": 1}
    d["self"] = {"back": d}
    with pytest.raises(UnsupportedTypeError, match=r"cycle at key path 'self/back'"):
        flatten(d, leaf)


def test_cycle_through_list() -> None:
    lst: list[Any] = [1]
    lst.append(lst)
    with pytest.raises(UnsupportedTypeError, match=r"cycle at key path '1'"):
        flatten(lst, leaf)


def test_shared_subtree_is_not_a_cycle() -> None:
    shared = {"w": 1}
    node = flatten({"a": shared, "b": shared, "c": [shared, shared]}, leaf)
    assert set(leaves_of(node)) == {("a", "w"), ("b", "w"), ("c", 0, "w"), ("c", 1, "w")}


def _nested(depth: int) -> Any:
    x: Any = 0
    for _ in range(depth):
        x = [x]
    return x


def test_max_depth_is_allowed() -> None:
    node = flatten(_nested(MAX_TREE_DEPTH), leaf)
    assert len(next(iter(leaves_of(node)))) == MAX_TREE_DEPTH


def test_too_deep_names_key_path() -> None:
    with pytest.raises(UnsupportedTypeError) as ei:
        flatten(_nested(MAX_TREE_DEPTH + 1), leaf)
    msg = str(ei.value)
    assert f"deeper than {MAX_TREE_DEPTH} levels" in msg
    assert "key path '" + "/".join(["0"] * (MAX_TREE_DEPTH + 1)) + "'" in msg


# ----------------------------------------------------------------------------- JAX pytrees


jax = pytest.importorskip("jax")


@jax.tree_util.register_pytree_with_keys_class
class Pair:
    def __init__(self, left: Any, right: Any) -> None:
        self.left, self.right = left, right

    def tree_flatten_with_keys(self) -> Any:
        ga = jax.tree_util.GetAttrKey
        return ((ga("left"), self.left), (ga("right"), self.right)), None

    def tree_flatten(self) -> Any:
        return (self.left, self.right), None

    @classmethod
    def tree_unflatten(cls, aux: Any, children: Any) -> Pair:
        return cls(*children)


@jax.tree_util.register_pytree_node_class
class Box:
    def __init__(self, *items: Any) -> None:
        self.items = items

    def tree_flatten(self) -> Any:
        return self.items, None

    @classmethod
    def tree_unflatten(cls, aux: Any, children: Any) -> Box:
        return cls(*children)


def test_pytree_expansion_with_named_keys() -> None:
    state = {"p": Pair(np.ones(2), {"inner": 3})}
    node = flatten(state, leaf, pytree_fn=expand_pytree)
    p = node.child("p")
    assert p is not None and p.kind == "pytree"
    assert p.keys == ["left", "right"]
    assert p.type_name is not None and p.type_name.endswith("Pair")
    # expansion is one level: the dict child is walked by flatten itself
    right = p.child("right")
    assert right is not None and right.kind == "dict"
    assert set(leaves_of(node)) == {("p", "left"), ("p", "right", "inner")}


def test_pytree_expansion_with_index_keys() -> None:
    node = flatten(Box(1, Box(2.0)), leaf, pytree_fn=expand_pytree)
    assert node.kind == "pytree" and node.keys == ["0", "1"]
    inner = node.child("1")
    assert inner is not None and inner.kind == "pytree" and inner.keys == ["0"]


def test_without_pytree_fn_registered_classes_are_unsupported() -> None:
    with pytest.raises(UnsupportedTypeError, match="key path 'p'"):
        flatten({"p": Pair(1, 2)}, leaf)


def test_expand_pytree_ignores_leaves() -> None:
    assert expand_pytree(np.ones(2)) is None
    assert expand_pytree(object()) is None
    assert expand_pytree(jax.numpy.ones(2)) is None


# ----------------------------------------------------------------------------- rebuild


def test_container_kinds() -> None:
    assert CONTAINER_KINDS == {"dict", "list", "tuple", "namedtuple", "dataclass", "pytree"}


@pytest.mark.parametrize(
    ("kind", "expected"),
    [
        ("list", [1, 2]),
        ("tuple", (1, 2)),
        ("dict", {"a": 1, "b": 2}),
        ("namedtuple", {"a": 1, "b": 2}),
        ("dataclass", {"a": 1, "b": 2}),
        ("pytree", {"a": 1, "b": 2}),
    ],
)
def test_rebuild_without_target_gives_plain_types(kind: str, expected: Any) -> None:
    got = rebuild_container(kind, None, ["a", "b"], [1, 2], ())
    assert got == expected and type(got) is type(expected)


def test_rebuild_dict_and_dict_subclass() -> None:
    got = rebuild_container("dict", {"x": 0}, ["x", 1], [5, 6], ())
    assert got == {"x": 5, 1: 6} and type(got) is dict
    od = rebuild_container("dict", collections.OrderedDict(), ["b", "a"], [1, 2], ())
    assert type(od) is collections.OrderedDict and list(od) == ["b", "a"]
    # a subclass that cannot be built from a mapping falls back to a dict
    dd = rebuild_container("dict", collections.defaultdict(list), ["k"], [1], ())
    assert dd == {"k": 1}


def test_rebuild_namedtuple() -> None:
    got = rebuild_container("namedtuple", Point(0, 0), ["x", "y"], [1, 2], ())
    assert got == Point(1, 2) and type(got) is Point


def test_rebuild_list_and_tuples() -> None:
    assert rebuild_container("list", [0], [0, 1], ["a", "b"], ()) == ["a", "b"]
    t = rebuild_container("tuple", (0,), [0], ["a"], ())
    assert t == ("a",) and type(t) is tuple

    class MyTuple(tuple):  # type: ignore[type-arg]
        pass

    mt = rebuild_container("tuple", MyTuple(), [0, 1], [1, 2], ())
    assert type(mt) is MyTuple and tuple(mt) == (1, 2)


def test_rebuild_dataclass_keeps_target_object_unchanged() -> None:
    like = Config(0.0, [], extra="keep")
    got = rebuild_container("dataclass", like, ["lr", "layers"], [0.5, [3]], ())
    assert got == Config(0.5, [3], extra="keep")
    assert like == Config(0.0, [], extra="keep")


def test_rebuild_frozen_dataclass_with_non_init_field() -> None:
    got = rebuild_container("dataclass", Frozen(1), ["a", "b"], [10, 20], ())
    assert type(got) is Frozen and got.a == 10 and got.b == 20


def test_rebuild_into_unsupported_target_names_key_path() -> None:
    with pytest.raises(TargetMismatchError, match=r"key path 'a/b'.*builtins.int.*saved dict"):
        rebuild_container("dict", 5, ["x"], [1], ("a", "b"))


def test_a_defaultdict_target_keeps_its_factory(tmp_path) -> None:
    # it came back a plain dict (defaultdict(dict_of_values) fails: its first
    # argument is the factory), so resumed code's counts["new"] += 1 raised KeyError
    import collections

    import numpy as np

    import statestream as ss

    ss.save(tmp_path / "c", {"counts": collections.defaultdict(int, {"cat": 3}),
                             "w": np.ones(2)})
    out = ss.load(tmp_path / "c", {"counts": collections.defaultdict(int, {"cat": 0}),
                                   "w": np.zeros(2)})
    counts = out["counts"]
    assert type(counts) is collections.defaultdict and counts.default_factory is int
    counts["dog"] += 1
    assert dict(counts) == {"cat": 3, "dog": 1}
