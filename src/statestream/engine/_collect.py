"""Walking a state: leaves to manifest nodes, arrays to their providers."""

from __future__ import annotations

import pickle
from collections.abc import Callable, Collection, Hashable
from typing import Any

import numpy as np

from statestream.errors import UnsupportedTypeError
from statestream.plan import ArrayDecl
from statestream.providers import (
    ArrayProvider,
    PreparedArray,
    StateAdapter,
    adapter_for,
    array_provider_for,
    expand_pytree,
)
from statestream.providers.numpy import prepare_host_array
from statestream.tree import KeyPath, Node, flatten, format_keypath, parse_keypath, type_name

__all__ = ["Collector"]

_CONTAINER_TYPES = frozenset({dict, list, tuple})


#: the attrs of an array node that has none but its kind, shared
_KIND_ATTRS: dict[str, dict[str, Any]] = {}


class Collector:
    """Turns leaves into manifest nodes and remembers the arrays to write.

    Args:
        pickle_paths: key paths whose unsupported values may be pickled.
        track: remember, per array, which memory it uses (for guarded
            optimizer steps).
        versions: remember how to read each array's modification counter and
            its value now (to detect a change before a lazy snapshot copied it).
        private_copies: snapshot providers' private copies of values that
            need one (a lazy snapshot must not read donated JAX buffers).
    """

    def __init__(self, pickle_paths: Collection[str], *, track: bool = False,
                 versions: bool = False, private_copies: bool = False) -> None:
        self.arrays: list[PreparedArray] = []
        self.paths: list[KeyPath] = []
        self._pickle = {parse_keypath(p) for p in pickle_paths}
        self._track = track
        self._versions = versions
        self._private = private_copies
        #: called with each new array's index as the walk finds it
        self.on_array: Callable[[int, PreparedArray], None] | None = None
        #: memory id -> indices of the arrays using that memory (``track``)
        self.memory: dict[int, list[int]] = {}
        #: array index -> (read the modification counter, its value when prepared)
        self.versions: dict[int, tuple[Callable[[], int], int]] = {}
        #: (provider kind, alias key) -> index of the array first found in that memory
        self._aliases: dict[tuple[str, Hashable], int] = {}

    def walk(self, state: Any) -> Node:
        """Flatten ``state`` (raises UnsupportedTypeError naming the key path)."""
        return self._flatten(state, ())

    def _flatten(self, state: Any, path: KeyPath) -> Node:
        return flatten(state, self.leaf, pytree_fn=expand_pytree, fallback_fn=self.fallback,
                       path=path)

    def release(self) -> None:
        """Forget what the walk found (once its save's outcome is known): the state's
        memory is let go of, and nothing of it is left for the collector to traverse."""
        self.arrays.clear()
        self.paths.clear()
        self.versions.clear()
        self._aliases.clear()
        self.memory = {}  # (a save handle's until its snapshot is over)

    def key(self, index: int) -> str:
        return format_keypath(self.paths[index])

    def decls(self) -> list[ArrayDecl]:
        """The arrays found, as the manifest builder sees them."""
        return [ArrayDecl.at(p, a.dtype, a.shape)
                for p, a in zip(self.paths, self.arrays)]

    def _add(self, prepared: PreparedArray, path: KeyPath) -> int:
        self.arrays.append(prepared)
        self.paths.append(path)
        index = len(self.arrays) - 1
        if self.on_array is not None:
            self.on_array(index, prepared)
        return index

    def leaf(self, path: KeyPath, x: Any) -> Node | None:
        t = type(x)
        if t in _CONTAINER_TYPES:
            return None
        adapter = adapter_for(x)
        if adapter is not None:  # generators, typed keys, compiled modules
            return self._adapted(adapter, path, x)
        p = array_provider_for(x)
        if p is not None:  # the common case first: an array of a known type
            return self._array(p, path, x)
        if x is None:
            return Node("none")
        if t is bool:
            return Node("bool", value=x)
        if t is int:
            return Node("int", value=x)
        if t is float:
            return Node("float", value=x)
        if t is str:
            return Node("str", value=x)
        if t is bytes:
            blob = np.frombuffer(x, dtype=np.uint8)
            return Node("bytes", array=self._add(prepare_host_array(blob, path, "bytes"), path))
        return None

    def _adapted(self, adapter: StateAdapter, path: KeyPath, x: Any) -> Node:
        try:
            state = adapter.get_state(x)
        except Exception as exc:  # report where it happened
            raise UnsupportedTypeError(
                f"reading the state of the {type_name(x)} at key path "
                f"'{format_keypath(path)}' raised {type(exc).__name__}: {exc}"
            ) from exc
        return Node("stateful", type_name=adapter.node_name(x),
                    children=[self._flatten(state, path)])

    def _array(self, p: ArrayProvider, path: KeyPath, x: Any) -> Node:
        caps = p.capabilities
        alias = None
        prepared = None
        private = self._private and caps.lazy_private_copy
        if caps.aliases:
            if private:  # the key is the original's; the copy is prepared below
                key = p.alias_key(x)
            else:
                key, prepared = p.alias_and_prepare(x, path)
            if key is not None:
                alias = (p.kind, key)
                first = self._aliases.get(alias)
                if first is not None:  # tied: the same memory, stored once
                    return Node("alias", array=first, attrs={"kind": p.kind})
        if prepared is None:
            if private:
                x = self._private_copy(p, path, x)
            prepared = p.prepare(x, path)
        if prepared.attrs:
            attrs = {"kind": prepared.kind, **prepared.attrs}
        else:  # one shared dict per kind (tree nodes' attrs are never modified)
            attrs = _KIND_ATTRS.get(prepared.kind) or _KIND_ATTRS.setdefault(
                prepared.kind, {"kind": prepared.kind})
        index = self._add(prepared, path)
        if alias is not None:
            self._aliases[alias] = index
        if self._track and caps.mutable_values:
            mid = p.memory_id(x)
            if mid is not None:
                self.memory.setdefault(mid, []).append(index)
            read = p.version(x) if self._versions else None
            if read is not None:
                self.versions[index] = (read, read())
        return Node("array", array=index, attrs=attrs)

    @staticmethod
    def _private_copy(p: ArrayProvider, path: KeyPath, x: Any) -> Any:
        try:
            return p.private_copy(x)
        except UnsupportedTypeError as exc:  # the provider says why; add where
            raise UnsupportedTypeError(f"at key path '{format_keypath(path)}': {exc}") from exc
        except Exception as exc:  # report where it happened
            raise UnsupportedTypeError(
                f"taking a private copy of the {type_name(x)} at key path "
                f"'{format_keypath(path)}' raised {type(exc).__name__}: {exc}"
            ) from exc

    def fallback(self, path: KeyPath, x: Any) -> Node | None:
        spath = tuple(str(k) for k in path)
        if not any(spath[: len(p)] == p for p in self._pickle):
            return None
        try:
            data = pickle.dumps(x, protocol=5)
        except Exception as exc:
            raise UnsupportedTypeError(
                f"pickling the value at key path '{format_keypath(path)}' failed: {exc}"
            ) from exc
        blob = np.frombuffer(data, dtype=np.uint8)
        return Node(
            "pickle", array=self._add(prepare_host_array(blob, path, "pickle"), path),
            attrs={"type": f"{type(x).__module__}.{type(x).__qualname__}"},
        )

    def changed(self, index: int) -> bool:
        """True if array ``index`` was modified in place since it was prepared."""
        v = self.versions.get(index)
        return v is not None and v[0]() != v[1]
