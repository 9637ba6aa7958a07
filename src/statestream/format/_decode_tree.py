"""Manifest decoding, part 1: scalar checks, data file names and the tree.

Split out of ``_manifest.py``; the decoder proper is in ``_decode.py``.
"""

from __future__ import annotations

import re
from typing import Any, NoReturn

from statestream.errors import CheckpointCorruptError, CheckpointError, UnsafeCheckpointError
from statestream.format._manifest import (
    _ARRAY_KINDS,
    _BASE_NAME_RE,
    _CONTAINERS,
    _FILE_NAME_RE,
    _KEYED,
    _LEAF_VALUE_KINDS,
    MAX_ARRAYS,
    MAX_FILE_BYTES,
    MAX_INT_HEX_DIGITS,
    ArrayEntry,
)
from statestream.tree import MAX_TREE_DEPTH, Key, Node


class _Bad(Exception):
    pass


class OverLimit(Exception):
    """More arrays than a caller's ``max_arrays`` (within the format's limit): the
    checkpoint is not damaged, the load is bounded tighter than the format."""

    def __init__(self, n: int, limit: int, exact: bool) -> None:
        super().__init__(n, limit, exact)
        self.n, self.limit, self.exact = n, limit, exact

    def error(self, where: str, what: str = "manifest") -> CheckpointError:
        many = f"{self.n}" if self.exact else f"more than {self.limit}"
        err = CheckpointError(
            f"{what} {where} declares {many} arrays, over the caller's limit of "
            f"{self.limit} (max_arrays); nothing was read. A checkpoint you trust with more "
            f"arrays loads with max_arrays= set higher (at most {MAX_ARRAYS}, the format's "
            "limit)")
        err.max_arrays = self.limit  # type: ignore[attr-defined]  # see over_max_arrays
        return err


def over_limit(n: int, limit: int, exact: bool = True) -> None:
    """Raise :class:`OverLimit` when ``n`` arrays exceed ``limit``."""
    if n > limit:
        raise OverLimit(n if exact else limit, limit, exact)


def check_max_arrays(n: int, limit: int, where: str) -> None:
    """Raise CheckpointError, naming ``where`` and ``limit``, when a foreign checkpoint
    (a torch file, safetensors, DCP or Orbax: its manifest built as it was read) holds
    more than ``limit`` arrays. (Its message said "manifest", which it has none of.)"""
    if n > limit:
        raise OverLimit(n, limit, True).error(where, "checkpoint")


def over_max_arrays(exc: BaseException) -> bool:
    """Whether ``exc`` is the refusal of a manifest of more arrays than a caller's
    ``max_arrays`` (:func:`check_max_arrays`, ``decode_manifest``): a plain
    ``CheckpointError``, not damage, which ``verify`` raises rather than reports."""
    return isinstance(exc, CheckpointError) and isinstance(getattr(exc, "max_arrays", None), int)


def _int(v: Any, what: str, lo: int = 0, hi: int = 1 << 62) -> int:
    if type(v) is not int or not lo <= v <= hi:
        raise _Bad(f"{what} must be an integer in [{lo}, {hi}], got {v!r:.80}")
    return v


def _list(v: Any, what: str) -> list[Any]:
    if type(v) is not list:
        raise _Bad(f"{what} must be a list")
    return v


def _str(v: Any, what: str) -> str:
    if type(v) is not str:
        raise _Bad(f"{what} must be a string")
    return v


def validate_file_name(name: str) -> str:
    """Accept only ``data/<plain name>``: no separators, no ``..``, no absolute paths."""
    if type(name) is not str or not _FILE_NAME_RE.fullmatch(name) or ".." in name:
        raise UnsafeCheckpointError(
            f"manifest names data file {name!r:.120}, which is not a plain file inside the "
            "checkpoint's data/ directory; refusing to read it (the checkpoint is corrupt or "
            "hostile)"
        )
    return name


def validate_base_name(name: str) -> str:
    """Accept only a sibling checkpoint's name: one path component, no ``..`` (format v2)."""
    if type(name) is not str or not _BASE_NAME_RE.fullmatch(name) or ".." in name:
        raise UnsafeCheckpointError(
            f"manifest names base checkpoint {name!r:.120}, which is not a sibling directory "
            "of the checkpoint; refusing to follow it (the checkpoint is corrupt or hostile)"
        )
    return name


def _decode_node(d: Any, depth: int, n_arrays: int, used: set[int]) -> Node:
    """Decode a plain-JSON tree recursively (``decode_tree``)."""
    if depth > MAX_TREE_DEPTH + 2:
        raise _Bad(f"tree is nested deeper than {MAX_TREE_DEPTH}")
    if type(d) is not dict:
        raise _Bad("tree node must be an object")
    kids = None
    if d.get("t") in _CONTAINERS or d.get("t") == "stateful":
        kids = [_decode_node(c, depth + 1, n_arrays, used) for c in _list(d.get("c"), "children")]
    node = _make_node(d, kids)
    if node.array is not None:
        _use_array(node, n_arrays, used)
        # (what _TreeHook refuses as it parses: there, such an object is made a Node)
        if node.attrs and any(type(v) is dict and "t" in v for v in node.attrs.values()):
            raise _Bad("leaf attributes must hold plain values, not tree nodes")
    return node


def _use_array(node: Node, n_arrays: int, used: set[int]) -> None:
    """Range-check a leaf's array index; only ``alias`` leaves may share one."""
    idx = node.array
    assert idx is not None
    what = "alias's array index" if node.kind == "alias" else "array index"
    if n_arrays == 0:
        raise _Bad(f"{what} refers to an empty array table")
    if idx >= n_arrays:
        raise _Bad(f"{what} must be an integer in [0, {n_arrays - 1}], got {idx}")
    if node.kind == "alias":  # _check_leaf_arrays checks that an array leaf holds it
        return
    if idx in used:
        raise _Bad(f"array {idx} is referenced twice")
    used.add(idx)


_KIND_NAMES = {
    k: k for k in (*_CONTAINERS, "stateful", *_LEAF_VALUE_KINDS, *_ARRAY_KINDS, "alias")
}


def _make_node(d: dict[str, Any], kids: list[Any] | None) -> Node:
    """One validated node from its JSON object, its children already decoded."""
    t = d.get("t")
    k = _KIND_NAMES.get(t) if type(t) is str else None
    if k == "array":  # most nodes: checked first
        return _array_node(k, d, "array index")
    if k in _CONTAINERS or k == "stateful":
        if kids is None:
            raise _Bad("children must be a list")
        for c in kids:
            if type(c) is not Node:
                _not_a_node(c)
        if k == "stateful":
            if len(kids) != 1:
                raise _Bad("stateful node must have exactly one child")
            return Node(k, children=kids, type_name=_str(d.get("n", ""), "type name"))
        keys: list[Key] | None = None
        if k in _KEYED:
            keys = _list(d.get("k"), "keys")
            for key in keys:
                if type(key) is not str and type(key) is not int:
                    raise _Bad(f"key {key!r:.80} must be a string or integer")
                if k != "dict" and type(key) is not str:
                    raise _Bad(f"field name {key!r:.80} must be a string")
            if len(keys) != len(kids):
                raise _Bad("keys and children differ in length")
            if len(set(keys)) != len(keys):  # (str or int only: 1 and "1" are two keys)
                raise _Bad(f"key {_repeated(keys)!r:.80} appears twice in one {k}")
        tn = d.get("n")
        if tn is not None:
            _str(tn, "type name")
        return Node(k, keys=keys, children=kids, type_name=tn)
    if k == "none":
        return Node(k)
    if k == "bool":
        if type(d.get("v")) is not bool:
            raise _Bad("bool value must be true or false")
        return Node(k, value=d["v"])
    if k == "int":
        s = _str(d.get("v"), "int value")
        if not re.fullmatch(r"-?[0-9a-f]+", s) or len(s) > MAX_INT_HEX_DIGITS:
            raise _Bad(f"int value {s!r:.80} is not lowercase hex")
        return Node(k, value=int(s, 16))
    if k == "float":
        s = _str(d.get("v"), "float value")
        try:
            value = float.fromhex(s)
        except (ValueError, OverflowError) as exc:
            raise _Bad(f"float value {s!r:.80} is not a hex float") from exc
        return Node(k, value=value)
    if k == "str":
        return Node(k, value=_str(d.get("v"), "str value"))
    if k in _ARRAY_KINDS:
        return _array_node(k, d, "array index")
    if k == "alias":  # another leaf holding the same array (tied weights)
        return _array_node(k, d, "alias's array index")
    raise _Bad(f"unknown tree node type {d.get('t')!r:.40}")


def _repeated(keys: list[Key]) -> Key:
    """The first key that appears again (there is one)."""
    seen: set[Key] = set()
    for x in keys:
        if x in seen:
            return x
        seen.add(x)
    raise AssertionError("no key repeats")


def _array_node(k: str, d: dict[str, Any], what: str) -> Node:
    idx = _int(d.get("a"), what, 0, MAX_FILE_BYTES)
    attrs = d.get("x")
    if attrs is not None and type(attrs) is not dict:
        raise _Bad("leaf attributes must be an object")
    return Node(k, array=idx, attrs=attrs)


_PLAIN = frozenset((str, bool, int))


class _TreeHook:
    """``object_hook`` that turns tree nodes into :class:`Node` as the parser closes
    them, so a manifest's tree never exists twice (as JSON objects and as Nodes).

    Inside a tree, an object with a ``t`` key is a node; attribute objects
    (``x``) hold plain values, never such an object. Small attribute objects
    repeat (``{"kind": "torch"}`` on every leaf) and are shared.
    """

    def __init__(self) -> None:
        self.attrs: dict[tuple[Any, ...], dict[str, Any]] = {}
        #: a container had compact array leaves (``ak``, format v3)
        self.compact = False

    def __call__(self, d: dict[str, Any]) -> Any:
        if "t" not in d:
            return self._share(d)
        kids = d.get("c")
        if kids is not None and type(kids) is not list:
            raise _Bad("children must be a list")
        if "ak" in d:
            kids = self._leaves(d, kids)
        node = _make_node(d, kids)
        # (attrs came through this hook as the parser closed them: already shared)
        if node.attrs is not None and Node in set(map(type, node.attrs.values())):
            raise _Bad("leaf attributes must hold plain values, not tree nodes")
        return node

    def _leaves(self, d: dict[str, Any], kids: list[Any] | None) -> list[Any]:
        """A container's children with its compact array leaves (bare array indexes,
        of kind ``ak``) made nodes."""
        ak = d["ak"]
        if type(ak) is not str or (d.get("t") not in _CONTAINERS and d.get("t") != "stateful"):
            raise _Bad("only a container's children may be compact array leaves, of a "
                       "string kind")
        if kids is None:
            raise _Bad("children must be a list")
        self.compact = True
        attrs = self._share({"kind": ak})
        out = []
        for c in kids:
            if type(c) is int:
                c = Node("array", array=_int(c, "array index", 0, MAX_FILE_BYTES), attrs=attrs)
            out.append(c)
        return out

    def _share(self, d: dict[str, Any]) -> dict[str, Any]:
        if len(d) > 4:
            return d
        vals = tuple(d.values())
        types = tuple(map(type, vals))  # True == 1 and 0 == -0: equal values, other types
        if not _PLAIN.issuperset(types):
            return d
        key = (tuple(d), vals, types)
        got = self.attrs.get(key)
        if got is not None:
            return got
        if len(self.attrs) < 4096:
            self.attrs[key] = d
        return d


def _not_a_node(x: Any) -> NoReturn:
    if type(x) is dict:  # an object the hook left alone: it has no "t"
        raise _Bad(f"unknown tree node type {x.get('t')!r:.40}")
    raise _Bad("tree node must be an object")


def _check_tree(root: Any, n_arrays: int) -> Node:
    """Depth and array references of a tree decoded by :class:`_TreeHook`."""
    if type(root) is not Node:
        _not_a_node(root)
    used: set[int] = set()
    stack = [(root, 0)]
    while stack:
        n, depth = stack.pop()
        if depth > MAX_TREE_DEPTH + 2:
            raise _Bad(f"tree is nested deeper than {MAX_TREE_DEPTH}")
        if n.array is not None:
            _use_array(n, n_arrays, used)
        if n.children:
            stack.extend((c, depth + 1) for c in n.children)
    return root


def _check_leaf_arrays(tree: Node, arrays: list[ArrayEntry]) -> None:
    """A bytes or pickle leaf's array is a 1-D uint8 blob; an alias refers to an array
    that an array leaf holds."""
    stack = [tree]
    plain: set[int] = set()
    aliases: set[int] = set()
    while stack:
        n = stack.pop()
        if n.children:
            stack.extend(n.children)
        if n.kind == "alias" and n.array is not None:
            aliases.add(n.array)
        elif n.kind == "array" and n.array is not None:
            plain.add(n.array)
        if n.kind in ("bytes", "pickle") and n.array is not None:
            a = arrays[n.array]
            if a.dtype != "uint8" or len(a.shape) != 1:
                raise _Bad(f"{n.kind} leaf must be a 1-D uint8 blob")
    if not aliases <= plain:
        raise _Bad(f"an alias refers to array {min(aliases - plain)}, which no array leaf "
                   "holds")


def decode_tree(doc: Any, n_arrays: int, *, arrays: list[ArrayEntry] | None = None) -> Node:
    """Parse and validate the JSON form of a tree whose leaves index ``n_arrays`` arrays.

    With ``arrays`` (the ``n_arrays`` entries), its leaves are checked against them as
    a manifest's are: a tree stored elsewhere (a safetensors file's metadata) is then
    held to everything :func:`decode_manifest` checks of a tree.
    """
    try:
        tree = _decode_node(doc, 0, n_arrays, set())
        if arrays is not None:
            _check_leaf_arrays(tree, arrays)
        return tree
    except _Bad as exc:
        raise CheckpointCorruptError(f"malformed tree: {exc}") from None
