"""``load``'s ``items=``: restrict the saved tree (and the target) to the selected key paths."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from statestream.errors import MissingKeyError, TargetMismatchError
from statestream.format import Manifest
from statestream.providers import adapter_for, expand_pytree, providers, target_provider_for
from statestream.tree import (
    Key,
    KeyPath,
    Node,
    format_keypath,
    is_stateful,
    parse_keypath,
    state_fields,
    type_name,
)


class _NoTarget:
    def __repr__(self) -> str:
        return "<no target>"


NO_TARGET: Any = _NoTarget()


class PartialTarget:
    """A module in the target of which ``items=`` selects some entries: ``load`` loads
    them into ``module`` (``load_state_dict(..., strict=False)``, the rest untouched)
    and returns ``returned`` there (the target as given: a compiled module, say)."""

    __slots__ = ("module", "returned")

    def __init__(self, module: Any, returned: Any) -> None:
        self.module = module
        self.returned = returned


def _children(node: Node) -> list[tuple[Key, Node]]:
    kids = node.children or []
    if node.keys is None:
        return list(enumerate(kids))
    return list(zip(node.keys, kids))


def _unwrap(node: Node) -> Node:
    return node.children[0] if node.kind == "stateful" and node.children else node


def _saved_child(node: Node, seg: str, path: KeyPath, where: str,
                 typed: bool) -> tuple[Key, Node] | None:
    """The child of ``node`` (at ``path``) that the key-path segment ``seg`` names: its
    str key, or its int key written alike. Both (``{0: a, "0": b}``, both at key path
    ``0``, as ``metadata().leaves()`` and ``diff`` show them) is ambiguous: refused,
    saying how a target picks either (``typed``: a load, which takes one)."""
    kids = _children(node)
    named: list[tuple[Key, Node]] = [(k, c) for k, c in kids if type(k) is str and k == seg]
    named += [(k, c) for k, c in kids if type(k) is int and str(k) == seg]
    if len(named) > 1:
        raise MissingKeyError(_ambiguous(path, [k for k, _ in named], where, typed))
    return named[0] if named else None


def _ambiguous(path: KeyPath, keys: list[Key], where: str, typed: bool) -> str:
    """Why an items= key path names no one key of checkpoint ``where`` (``keys``, of
    different types, under ``path``), and the target that loads each (``typed``;
    else what holds both: ``convert`` takes no target)."""

    def target(key: Key) -> str:
        text = f"{{{key!r}: None}}"
        for k in reversed(path):
            text = f"{{{k!r}: {text}}}"
        return text

    keys_text = " and ".join(f"the {type(k).__name__} key {k!r}" for k in keys)
    how = "; ".join(f"target={target(k)} for the {type(k).__name__} key {k!r}" for k in keys)
    said = (f"items= names key path '{format_keypath(path + (keys[0],))}', which is "
            f"ambiguous: checkpoint {where} has {keys_text} there (a key path writes them "
            "alike)")
    if not typed:
        return (f"{said}; key paths cannot select one of them: name "
                + (f"the key path that holds both (items=[{format_keypath(path)!r}])" if path
                   else "no items= (the whole checkpoint)") + ", or select one with ss.load's "
                "target and save what it returns")
    return (
        f"{said}. To load one, pass " + (f"items=[{format_keypath(path)!r}] with " if path
                                         else "")
        + f"a target that holds its key with its type: {how} (None: whatever was saved)"
    )


def _target_child(like: Any, key: Key, path: KeyPath) -> Any:
    """The target's entry under ``key`` (at ``path``) on the way to a selected item
    (NO_TARGET if none)."""
    if like is NO_TARGET or like is None:
        return like  # None: the saved kind, all the way down
    if isinstance(like, dict):
        return like.get(key, NO_TARGET)
    if type(key) is str and _named(like):  # an optax state, a dataclass: by field name
        names = (type(like)._fields if isinstance(like, tuple)  # type: ignore[attr-defined]
                 else [f.name for f in state_fields(like)])
        return getattr(like, key) if key in names else NO_TARGET
    if isinstance(like, (list, tuple)) and type(key) is int:
        return like[key] if 0 <= key < len(like) else NO_TARGET
    # a JAX pytree node (an nnx.State, a registered class): by the keys it is saved
    # under; it was refused as having 'no entry' that it has
    exp = None if isinstance(like, (list, tuple)) else expand_pytree(like)
    if exp is not None:
        return next((c for k, c in zip(exp.keys, exp.children) if k == key), NO_TARGET)
    where = f"at '{format_keypath(path)}'" if path else "at the top"
    raise TargetMismatchError(
        f"with items=, the target must hold dicts, lists, named tuples, dataclasses, JAX "
        f"pytrees or objects with state_dict() along the selected key paths; {where} it "
        "has a "
        f"{type_name(like)}, which has no entry {key!r}"
    )


def _named(like: Any) -> bool:
    """A named tuple or a dataclass instance (containers keyed by field name)."""
    if isinstance(like, tuple):
        return hasattr(type(like), "_fields")
    return dataclasses.is_dataclass(like) and not isinstance(like, type)


def _select(root: Node, items: Sequence[str], like: Any, where: str,
            typed: bool = True) -> tuple[Node, Any]:
    """Restrict the tree (and the target) to the key paths named in ``items``.

    Each item is a key path (``a/b/0``, with ``~1`` for ``/`` inside a key): a
    top-level checkpointable, a subtree or a leaf; an item equal to a top-level
    key is that key, as it always was. Levels above a selected item come back
    as dicts holding only what was selected. A segment names a str key or an int
    key written alike, and is refused where a dict holds both (``typed``: the
    error says how a load's target picks each; ``convert`` has none).
    """
    wanted: dict[Any, Any] = {}
    top = {k for k, _ in _children(_unwrap(root)) if type(k) is str}
    for it in items:
        level = wanted
        # a top-level key spelled as it is (even with a '/') keeps meaning that key
        segs = (it,) if it in top else parse_keypath(it)
        if not segs:
            raise MissingKeyError(f"items= names an empty key path {it!r}; load the whole "
                                  "checkpoint instead")
        for seg in segs[:-1]:
            nxt = level.setdefault(seg, {})
            if nxt is None:  # an enclosing item already selects this subtree
                break
            level = nxt
        else:
            level[segs[-1]] = None
    return _select_level(root, wanted, like, (), where, typed)


def _a(kind: str) -> str:
    """``kind`` with its article: "an array", "a list"."""
    return f"{'an' if kind[:1] in 'aeiou' else 'a'} {kind}"


def _selected_child(node: Node, seg: str, path: KeyPath, where: str,
                    typed: bool) -> tuple[Key, Node]:
    found = _saved_child(node, seg, path, where, typed)
    if found is None:
        have = ", ".join(repr(k) for k, _ in _children(node)[:20])
        raise MissingKeyError(
            f"checkpoint {where} has no item '{format_keypath(path + (seg,))}'; "
            + (f"at '{format_keypath(path)}' it has: {have}" if have
               else f"'{format_keypath(path)}' holds {_a(node.kind)} without keys")
        )
    return found


def _select_level(node: Node, wanted: dict[str, Any], like: Any, path: KeyPath,
                  where: str, typed: bool) -> tuple[Node, Any]:
    node = _unwrap(node)
    if (like is not NO_TARGET and like is not None and is_stateful(like)
            and target_provider_for(like) is None):
        return _select_in_module(node, wanted, like, path, where, typed)
    keys: list[Key] = []
    kids: list[Node] = []
    targets: dict[Key, Any] = {}
    for seg, sub in wanted.items():
        key, child = _selected_child(node, seg, path, where, typed)
        t = _target_child(like, key, path)
        if sub is not None:
            child, t = _select_level(child, sub, t, path + (key,), where, typed)
        keys.append(key)
        kids.append(child)
        targets[key] = t
    return Node("dict", keys=keys, children=kids), targets


def _select_in_module(node: Node, wanted: dict[str, Any], like: Any, path: KeyPath,
                      where: str, typed: bool) -> tuple[Node, PartialTarget]:
    """Entries of a stateful target's saved state selected by ``items=``: loaded into a
    module, whole entries of its ``state_dict()``; refused for anything else, whose
    ``load_state_dict`` takes the whole state (an optimizer's: its parameter groups
    and every parameter's state together), before anything is read."""
    adapter = adapter_for(like)
    obj = (adapter.wrapped(like) if adapter is not None else None) or like
    hints = [prov for prov in providers() if prov.capabilities.state_hints]
    at = format_keypath(path)
    if not any(prov.is_module(obj) for prov in hints):
        what = ("an optimizer, whose state loads whole (its parameter groups and every "
                "parameter's state together)"
                if any(prov.is_optimizer(obj) for prov in hints)
                else "an object whose load_state_dict() takes its whole state")
        raise TargetMismatchError(
            f"items= selects entries of the {type_name(obj)} at key path '{at}' in the "
            f"target, {what}: a part of it cannot be loaded into it; nothing was loaded. "
            f"Select '{at}' whole, or pass None there in the target to get the selected "
            "entries back as saved")
    state = obj.state_dict()
    keys: list[Key] = []
    kids: list[Node] = []
    for seg, sub in wanted.items():
        key, child = _selected_child(node, seg, path, where, typed)
        if key not in state:
            raise TargetMismatchError(
                f"items= selects key path '{format_keypath(path + (key,))}', which the "
                f"target's {type_name(obj)} at '{at}' has no place for (no {key!r} in its "
                "state_dict()); nothing was loaded. Pass None there in the target to get "
                "it back as saved")
        if sub is not None:
            raise TargetMismatchError(
                f"items= selects a part of the entry '{format_keypath(path + (key,))}' of "
                f"the target's {type_name(obj)} at '{at}': a module loads whole entries of "
                f"its state_dict(); nothing was loaded. Select "
                f"'{format_keypath(path + (key,))}'")
        keys.append(key)
        kids.append(child)
    return Node("dict", keys=keys, children=kids), PartialTarget(obj, like)


def selected(m: Manifest, target: Any, items: Sequence[str] | None,
              where: str) -> tuple[Node, Any]:
    """The saved tree and the target the walk matches: cut down to ``items``."""
    like = NO_TARGET if target is None else target
    if items is None:
        return m.tree, like
    if like is not NO_TARGET and not isinstance(like, dict):
        raise TargetMismatchError(
            "with items=, the target must be a dict like the saved state (keyed by "
            "the items' first keys)"
        )
    # items without a target entry load with defaults
    return _select(m.tree, list(items), like, where)
