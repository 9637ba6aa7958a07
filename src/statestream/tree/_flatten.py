"""Flatten nested containers into a tree of :class:`Node` and rebuild them."""

from __future__ import annotations

import collections
import copy
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, Protocol, runtime_checkable

from statestream.errors import TargetMismatchError, UnsupportedTypeError
from statestream.tree._keypath import Key, KeyPath, format_keypath

__all__ = [
    "CONTAINER_KINDS",
    "MAX_TREE_DEPTH",
    "Node",
    "PytreeExpansion",
    "Stateful",
    "flatten",
    "is_stateful",
    "rebuild_container",
    "state_fields",
    "type_name",
]

#: Deepest nesting a state (and a manifest tree) may have.
MAX_TREE_DEPTH = 256

CONTAINER_KINDS = frozenset({"dict", "list", "tuple", "namedtuple", "dataclass", "pytree"})


@runtime_checkable
class Stateful(Protocol):
    """An object saved through its ``state_dict()`` and restored by ``load_state_dict()``."""

    def state_dict(self) -> Any: ...

    def load_state_dict(self, state_dict: Any, /) -> Any: ...


@dataclasses.dataclass(slots=True)
class Node:
    """One node of a flattened state.

    Container kinds (``dict``, ``list``, ``tuple``, ``namedtuple``,
    ``dataclass``, ``pytree``) have ``keys`` and ``children``; ``stateful``
    has one child, the flattened ``state_dict()``. Leaf kinds are ``none``,
    ``bool``, ``int``, ``float``, ``str`` (with ``value``) and ``array``,
    ``bytes``, ``pickle`` (with ``array``, an index into the array table).
    ``attrs`` carries small extra facts about a leaf (e.g. which framework).
    """

    kind: str
    keys: list[Key] | None = None
    children: list[Node] | None = None
    type_name: str | None = None
    value: Any = None
    array: int | None = None
    attrs: dict[str, Any] | None = None

    def child(self, key: Key) -> Node | None:
        """Return the child under ``key`` (mapping key, field name or index)."""
        if self.children is None:
            return None
        if self.keys is None:
            if isinstance(key, int) and 0 <= key < len(self.children):
                return self.children[key]
            return None
        for k, c in zip(self.keys, self.children):
            if k == key and type(k) is type(key):
                return c
        return None


@dataclasses.dataclass(frozen=True, slots=True)
class PytreeExpansion:
    """How a framework pytree node (e.g. a JAX-registered class) splits into children."""

    type_name: str
    keys: list[str]
    children: list[Any]


LeafFn = Callable[[KeyPath, Any], "Node | None"]
PytreeFn = Callable[[Any], "PytreeExpansion | None"]


def type_name(obj: Any) -> str:
    """Return ``module.QualName`` of ``obj``'s type (informational only)."""
    t = type(obj)
    return f"{t.__module__}.{t.__qualname__}"


def is_stateful(obj: Any) -> bool:
    """True if ``obj`` follows the ``state_dict()`` / ``load_state_dict()`` protocol."""
    if isinstance(obj, type):
        return False
    return callable(getattr(obj, "state_dict", None)) and callable(
        getattr(obj, "load_state_dict", None)
    )


def state_fields(obj: Any) -> list[dataclasses.Field[Any]]:
    """The fields of dataclass ``obj`` that are state (saved, and loaded into a target).

    A field marked static is not state: ``flax.struct.field(pytree_node=False)``
    (a flax ``TrainState``'s ``apply_fn`` and ``tx``) or
    ``dataclasses.field(metadata={"static": True})`` (``jax.tree_util.register_dataclass``),
    or one that a :data:`DATA_FIELD_HOOKS` hook leaves out (a ``meta_fields=`` entry of
    ``register_dataclass``). A save skips it; a load keeps the target's value.

    Example:
        >>> @dataclasses.dataclass
        ... class S:
        ...     w: int
        ...     fn: object = dataclasses.field(default=None, metadata={"pytree_node": False})
        >>> [f.name for f in state_fields(S(1))]
        ['w']
    """
    data = _hooked_data_fields(obj)
    return [
        f for f in dataclasses.fields(obj)
        if (f.name in data if data is not None else
            f.metadata.get("pytree_node", True) is not False
            and f.metadata.get("static") is not True)
    ]


#: asked, in order, for the data fields of a dataclass before its field metadata: a
#: set of field names, or None where the hook has no answer (providers/jax.py adds
#: JAX's own, for ``register_dataclass(cls, data_fields=..., meta_fields=...)``)
DATA_FIELD_HOOKS: list[Callable[[Any], set[str] | None]] = []


def _hooked_data_fields(obj: Any) -> set[str] | None:
    for hook in DATA_FIELD_HOOKS:
        names = hook(obj)
        if names is not None:
            return names
    return None


def _is_namedtuple(obj: Any) -> bool:
    return isinstance(obj, tuple) and hasattr(type(obj), "_fields")


def _walk_builtin_container(x: Any, p: KeyPath, walk: Callable[[Any, KeyPath], Node]
                            ) -> Node | None:
    """Node for a stateful object or a built-in container (``walk`` recurses), else None.

    Kept as one function: each extra frame per tree level would lower the
    depth that fits Python's recursion limit below MAX_TREE_DEPTH.
    """
    if is_stateful(x):
        try:
            sd = x.state_dict()
        except Exception as exc:  # report where it happened
            raise UnsupportedTypeError(
                f"state_dict() of {type_name(x)} at key path '{format_keypath(p)}' "
                f"raised {type(exc).__name__}: {exc}"
            ) from exc
        return Node("stateful", type_name=type_name(x), children=[walk(sd, p)])
    if isinstance(x, dict):
        keys: list[Key] = []
        for k in x:
            if type(k) is not str and type(k) is not int:
                raise UnsupportedTypeError(
                    f"mapping key {k!r} of type {type(k).__name__} at key path "
                    f"'{format_keypath(p)}' is not supported; use str or int keys"
                )
            keys.append(k)
        return Node(
            "dict",
            keys=keys,
            children=[walk(x[k], p + (k,)) for k in keys],
            type_name=None if type(x) is dict else type_name(x),
        )
    if _is_namedtuple(x):
        fields = list(type(x)._fields)
        return Node(
            "namedtuple",
            keys=list(fields),
            children=[walk(v, p + (f,)) for f, v in zip(fields, x)],
            type_name=type_name(x),
        )
    if isinstance(x, (list, tuple)):
        kind = "list" if isinstance(x, list) else "tuple"
        return Node(kind, children=[walk(v, p + (i,)) for i, v in enumerate(x)])
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        names = [f.name for f in state_fields(x)]
        return Node(
            "dataclass",
            keys=list(names),
            children=[walk(getattr(x, n), p + (n,)) for n in names],
            type_name=type_name(x),
        )
    return None


def flatten(
    obj: Any,
    leaf_fn: LeafFn,
    *,
    pytree_fn: PytreeFn | None = None,
    fallback_fn: LeafFn | None = None,
    path: KeyPath = (),
) -> Node:
    """Flatten ``obj`` into a :class:`Node` tree.

    ``leaf_fn`` claims leaves (arrays, plain values) by returning a node;
    containers and stateful objects are walked here; ``pytree_fn`` expands
    framework-registered containers; ``fallback_fn`` gets anything left
    (it may pickle it); otherwise :class:`UnsupportedTypeError` names the
    key path.

    Example:
        >>> def leaf(path, x):
        ...     return Node("int", value=x) if type(x) is int else None
        >>> flatten({"a": [1, 2]}, leaf).children[0].kind
        'list'
    """
    return _Walker(leaf_fn, pytree_fn, fallback_fn).walk(obj, path)


class _Walker:
    """One flatten call. Methods, not nested closures: a closure that calls itself
    is a reference cycle, and everything its callbacks hold (a whole save job)
    would wait for the cyclic collector instead of being freed on return."""

    __slots__ = ("leaf_fn", "pytree_fn", "fallback_fn", "active")

    def __init__(self, leaf_fn: LeafFn, pytree_fn: PytreeFn | None,
                 fallback_fn: LeafFn | None) -> None:
        self.leaf_fn = leaf_fn
        self.pytree_fn = pytree_fn
        self.fallback_fn = fallback_fn
        self.active: set[int] = set()

    def walk(self, x: Any, p: KeyPath) -> Node:
        if len(p) > MAX_TREE_DEPTH:
            raise UnsupportedTypeError(
                f"state is nested deeper than {MAX_TREE_DEPTH} levels at key path "
                f"'{format_keypath(p)}'; flatten the state or pickle that subtree"
            )
        leaf = self.leaf_fn(p, x)
        if leaf is not None:
            return leaf
        oid = id(x)
        active = self.active
        if oid in active:
            raise UnsupportedTypeError(
                f"the state contains a reference cycle at key path '{format_keypath(p)}'; "
                "checkpoints hold trees, not graphs"
            )
        active.add(oid)
        try:
            # one helper frame per level, as before the split (MAX_TREE_DEPTH fits the stack)
            node = _walk_builtin_container(x, p, self.walk)
            return node if node is not None else self._walk_extension(x, p)
        finally:
            active.discard(oid)

    def _walk_extension(self, x: Any, p: KeyPath) -> Node:
        if self.pytree_fn is not None:
            exp = self.pytree_fn(x)
            if exp is not None:
                _refuse_repeated_keys(exp, p)
                return Node(
                    "pytree",
                    keys=list(exp.keys),
                    children=[self.walk(c, p + (k,)) for k, c in zip(exp.keys, exp.children)],
                    type_name=exp.type_name,
                )
        if self.fallback_fn is not None:
            node = self.fallback_fn(p, x)
            if node is not None:
                return node
        raise UnsupportedTypeError(
            f"cannot save value of type {type_name(x)} at key path '{format_keypath(p)}': "
            "supported leaves are numpy/torch/jax arrays, None, bool, int, float, str, "
            "bytes and objects with state_dict()/load_state_dict(); to store it anyway, "
            f"pass pickle_paths=['{format_keypath(p)}'] to save() (loading then needs "
            "allow_pickle=True)"
        )

def _refuse_repeated_keys(exp: PytreeExpansion, p: KeyPath) -> None:
    """Two children of a pytree node under one key (their path keys differ only in
    type, ``DictKey(1)`` and ``DictKey("1")``, both named ``"1"``): a load would
    refuse the checkpoint (a tree node's keys are unique), so the save does."""
    seen: set[str] = set()
    for k in exp.keys:
        if k in seen:
            raise UnsupportedTypeError(
                f"the {exp.type_name} at key path '{format_keypath(p)}' has two children "
                f"named {k!r} (their pytree keys differ only in type); rename one, or "
                "make the node a dict before saving")
        seen.add(k)


def rebuild_container(node_kind: str, like: Any, keys: Sequence[Key], values: list[Any],
                      path: KeyPath) -> Any:
    """Build a container of ``like``'s type holding ``values`` under ``keys``.

    ``like`` is the target container (``None`` means plain Python types:
    dicts for mappings, namedtuples, dataclasses and pytrees).
    """
    if like is None:
        if node_kind == "list":
            return list(values)
        if node_kind == "tuple":
            return tuple(values)
        return dict(zip(keys, values))
    if isinstance(like, dict):
        out = dict(zip(keys, values))
        if type(like) is dict:
            return out
        if isinstance(like, collections.defaultdict):  # its first argument is the factory
            return type(like)(like.default_factory, out)
        try:
            return type(like)(out)
        except Exception:  # not built from a dict: a copy of the target, emptied and filled
            pass
        try:
            again = copy.copy(like)
            again.clear()
            again.update(out)
            return again
        except Exception:  # noqa: BLE001 - a mapping type that allows neither: a plain dict
            return out
    if _is_namedtuple(like):
        return type(like)(**{str(k): v for k, v in zip(keys, values)})
    if isinstance(like, list):
        return list(values)
    if isinstance(like, tuple):
        return tuple(values) if type(like) is tuple else type(like)(values)
    if dataclasses.is_dataclass(like) and not isinstance(like, type):
        fields = {f.name: f for f in dataclasses.fields(like)}
        init_kwargs = {str(k): v for k, v in zip(keys, values) if fields[str(k)].init}
        obj = dataclasses.replace(like, **init_kwargs)
        for k, v in zip(keys, values):
            if not fields[str(k)].init:
                object.__setattr__(obj, str(k), v)
        return obj
    raise TargetMismatchError(
        f"target at key path '{format_keypath(path)}' is a {type_name(like)}, which cannot be "
        f"rebuilt from a saved {node_kind}"
    )
