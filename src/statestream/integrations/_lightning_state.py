"""What the Lightning plugin saves and the target it loads into.

Lightning hands its checkpoint dict to ``torch.save`` by default, and
``torch.load`` gives every value back as it was. Statestream stores a
namedtuple, a dataclass or another pytree node as its fields, and an object
with ``state_dict()`` as that state; a load without a target gives those back
as dicts. Generators and JAX keys are different: statestream rebuilds them.

:func:`inexact_values` finds, before a save, the values that would not come
back as they were (the plugin refuses them, or pickles them when built with
``pickle=True``); :func:`load_target` builds the load target from the
manifest, with ``None`` where a generator or key was saved, so that it comes
back as one.
"""

from __future__ import annotations

import dataclasses
from pickle import dumps, loads
from typing import Any

import torch

from statestream.errors import UnsupportedTypeError
from statestream.format import Manifest
from statestream.providers import adapter_by_name, adapter_for, array_provider_for, expand_pytree
from statestream.tree import (
    CONTAINER_KINDS,
    MAX_TREE_DEPTH,
    KeyPath,
    Node,
    format_keypath,
    is_stateful,
    type_name,
)

__all__ = ["inexact_values", "load_target"]

_PLAIN = frozenset({type(None), bool, int, float, str, bytes})
_CONTAINERS = (dict, list, tuple)
#: what the walk passes over without asking (a checkpoint is mostly tensors)
_LEAVES = _PLAIN | {torch.Tensor, torch.nn.Parameter}


class _Pickled:
    """A value the save pickles in its place. It has no form statestream stores
    without pickle, so a save with ``pickle_paths`` pickles it, as a call of
    ``pickle.loads`` on the value's own pickle: unpickling gives the value back, not
    this wrapper (the value's bytes are pickled twice, a small value's cost)."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value

    def __reduce_ex__(self, protocol: Any) -> Any:
        return (loads, (dumps(self.value, protocol=protocol),))


def _inexact(x: Any) -> str | None:
    """Why ``x`` (not a plain dict, list or tuple) would not load back as it was saved,
    in the order the save's walk tells values apart; None where it would (or where the
    save decides: values it pickles or refuses, containers it walks)."""
    adapter = adapter_for(x)
    if adapter is not None:  # a generator, key or compiled module: saved as its state
        if adapter_by_name(adapter.node_name(x)) is not None:
            return None  # rebuilt by the load
        return (f"is saved as its state, which the plugin would load back as a dict "
                f"(statestream rebuilds no {type_name(x)} without a target); store a "
                "value it rebuilds, or the state, instead")
    if type(x) in _PLAIN or array_provider_for(x) is not None:
        return None
    if is_stateful(x):
        return ("is saved as its state_dict(), which the plugin would load back as a "
                "dict; store its state_dict() instead")
    if isinstance(x, dict):
        return None
    if isinstance(x, tuple) and hasattr(type(x), "_fields"):
        return ("is a namedtuple, which the plugin would load back as a dict; store a "
                "dict or tuple instead")
    if isinstance(x, (list, tuple)):
        return None
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return ("is a dataclass, which the plugin would load back as a dict of its "
                "fields; store a dict (dataclasses.asdict) instead")
    if expand_pytree(x) is not None:
        return ("is a registered pytree node, which the plugin would load back as a dict "
                "of its children; store a dict instead")
    return None


class _Walk:
    """One pass over a checkpoint dict (one frame per level, as the save's walk)."""

    def __init__(self, plugin: str, pickle: bool) -> None:
        self.plugin, self.pickle = plugin, pickle
        self.done: dict[int, Any] = {}  # a container seen before: its result
        self.active: set[int] = set()

    def container(self, x: Any, path: KeyPath) -> Any:
        """``x``, or (``pickle``) a plain copy with the inexact values in it wrapped."""
        oid = id(x)
        if oid in self.done:
            return self.done[oid]
        if len(path) > MAX_TREE_DEPTH or oid in self.active:
            return x  # the save refuses it, naming where
        if isinstance(x, dict):
            if not all(type(k) is str or type(k) is int for k in x):
                return x  # the save refuses the key
            items: Any = x.items()
        else:
            items = enumerate(x)
        self.active.add(oid)
        changed: dict[Any, Any] = {}
        try:
            for k, v in items:
                if type(v) in _CONTAINERS or (
                        isinstance(v, _CONTAINERS) and _inexact(v) is None):
                    got = self.container(v, path + (k,))
                    if got is not v:
                        changed[k] = got
                elif type(v) not in _LEAVES:
                    why = _inexact(v)
                    if why is not None:
                        changed[k] = self.refuse(v, path + (k,), why)
        finally:
            self.active.discard(oid)
        out = x if not changed else _replaced(x, changed)
        self.done[oid] = out
        return out

    def refuse(self, x: Any, path: KeyPath, why: str) -> _Pickled:
        if self.pickle:
            return _Pickled(x)
        raise UnsupportedTypeError(
            f"the {type_name(x)} at key path '{format_keypath(path)}' {why}, or build "
            f"the plugin with {self.plugin}(pickle=True) to pickle it (loading it then "
            "needs allow_pickle=True, or the key paths trusted to hold pickles)")


def _replaced(x: Any, changed: dict[Any, Any]) -> Any:
    """A plain dict, list or tuple like ``x`` with ``changed``'s entries."""
    if isinstance(x, dict):
        return {k: changed[k] if k in changed else v for k, v in x.items()}
    out = [changed[i] if i in changed else v for i, v in enumerate(x)]
    return out if isinstance(x, list) else tuple(out)


def inexact_values(checkpoint: Any, plugin: str, *, pickle: bool) -> Any:
    """``checkpoint`` checked for values that a load would not give back as they were
    saved (a namedtuple, dataclass or pytree node as a dict, an object with
    ``state_dict()`` as its state, a stateful value statestream does not rebuild).

    Without ``pickle`` the first one raises :class:`UnsupportedTypeError` naming its
    key path; with it, the result is ``checkpoint`` with each such value wrapped so
    that the save pickles it (the containers above them copied; ``checkpoint`` itself
    is never changed).
    """
    if type(checkpoint) not in _CONTAINERS:
        return checkpoint
    return _Walk(plugin, pickle).container(checkpoint, ())


def _torch_dtype(name: str) -> torch.dtype | None:
    dt = getattr(torch, name, None)
    return dt if isinstance(dt, torch.dtype) else None


def load_target(node: Node, m: Manifest, device: torch.device) -> Any:
    """A load target from a checkpoint's manifest: torch tensors where torch ones were saved.

    Each target tensor is a zero-stride view of one element (nothing the size of
    the checkpoint is allocated for it). ``None`` elsewhere means "as saved": a
    saved generator or JAX key comes back as one (when statestream rebuilds its
    kind: its module is imported). A stateful value of another kind, a namedtuple, a
    dataclass or a pytree node loads as a dict (of the torch tensors its state holds).
    """
    while node.kind == "stateful" and node.children and adapter_by_name(node.type_name) is None:
        node = node.children[0]  # its state, as a dict
    kind = node.kind
    if kind in ("array", "alias"):
        if node.array is None or (node.attrs or {}).get("kind") != "torch":
            return None
        entry = m.arrays[node.array]
        dt = _torch_dtype(entry.dtype)
        if dt is None:
            return None
        return torch.empty((), dtype=dt, device=device).expand(entry.shape)
    if kind not in CONTAINER_KINDS:
        return None
    kids = [load_target(c, m, device) for c in node.children or []]
    if kind == "list":
        return kids
    if kind == "tuple":
        return tuple(kids)
    return dict(zip(node.keys or [], kids))
