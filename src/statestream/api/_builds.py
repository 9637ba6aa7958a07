"""What ``load``'s walk (``api/_load.py``) builds once the reads are done: Python
numbers from 0-d arrays, containers like the target's, values a state adapter restores."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np

from statestream.api._job import Build
from statestream.api._select import NO_TARGET
from statestream.api._state_loads import StateLoad
from statestream.errors import CheckpointError, TargetMismatchError
from statestream.format import dtype_from_name
from statestream.providers import (
    Destination,
    NumpyProvider,
    StateAdapter,
    expand_pytree,
    rebuild_pytree,
)
from statestream.tree import (
    Key,
    KeyPath,
    format_keypath,
    rebuild_container,
    state_fields,
    type_name,
)

__all__ = ["adapted_build", "container_build", "finish_build", "keyed_items", "python_scalar",
           "scalar_fits", "value_of"]

_NUMPY = NumpyProvider()


def value_of(flat: tuple[Any]) -> Any:
    return flat[0]


def scalar_fits(dtype: str, want: type, exact: bool = False) -> bool:
    """Whether a saved 0-d ``dtype`` array loads into a Python ``want`` (bool, int or
    float) of its value: an integer or bool array into an int, a bool into a bool,
    any real number into a float. ``exact``: whatever value it holds (no integer of
    more than 32 bits into a float)."""
    dt = np.dtype(dtype_from_name(dtype))
    if dt.kind not in {bool: "b", int: "biu", float: "biuf"}[want]:
        return False
    return not (exact and want is float and dt.kind in "iu" and dt.itemsize > 4)


def python_scalar(dtype: str, like: Any, path: KeyPath) -> Destination:
    """A saved 0-d array into a Python number target (a fresh flax TrainState's ``step=0``).

    Only where no value changes: an integer or bool array into an int, a bool
    into a bool, any real number into a float. An integer a float cannot hold
    exactly (an int64 above 2**53) is refused once it is read.
    """
    want = type(like)
    kind = np.dtype(dtype_from_name(dtype)).kind
    if not scalar_fits(dtype, want):
        raise TargetMismatchError(
            f"the checkpoint holds a 0-d {dtype} array at key path '{format_keypath(path)}' "
            f"but the target has a Python {want.__name__}; pass an array there"
        )
    dest = _NUMPY.restore(dtype, (), None, path)

    def finish() -> Any:
        saved = dest.finish().item()
        value = want(saved)
        if kind in "iu" and value != saved:  # an int and a float compare exactly
            raise TargetMismatchError(
                f"the checkpoint holds {saved} (a 0-d {dtype} array) at key path "
                f"'{format_keypath(path)}', which a Python {want.__name__} target cannot "
                f"hold exactly ({value!r}); pass an array there, or an int"
            )
        return value

    return Destination(boxes=dest.boxes, finish=finish)


def adapted_build(adapter: StateAdapter, like: Any, inner: Build, path: KeyPath,
                  defer: Callable[[StateLoad], None] | None = None) -> Build:
    """Put the loaded state into ``like`` (or a new value when it is None); with
    ``defer``, an adapter that can stage it (:meth:`StateAdapter.staged`) checks it
    now and hands ``defer`` the call that puts it in, made once every value is built."""

    def build() -> Any:
        state = inner()
        try:
            if like is None:
                return adapter.new(state, path)
            call = adapter.staged(like, state, path) if defer is not None else None
            if call is None:
                return adapter.set_state(like, state, path)
            assert defer is not None
            defer(StateLoad(path, f"the {adapter.name or type_name(like)}", call, True))
            return like
        except CheckpointError:
            raise
        except Exception as exc:
            what = adapter.name or type_name(like)
            raise TargetMismatchError(
                f"restoring the {what} at key path '{format_keypath(path)}' from the "
                f"checkpoint's state failed: {type(exc).__name__}: {exc}"
            ) from exc

    return build


def keyed_items(like: Any, path: KeyPath, k: str) -> tuple[list[tuple[Key, Any]], Any]:
    """The target's (key, sub-target) pairs and how to rebuild it (``k``: the kind of
    container the checkpoint holds there)."""
    if isinstance(like, dict):
        return list(like.items()), ("container", like)
    if isinstance(like, tuple) and hasattr(type(like), "_fields"):
        fields: tuple[str, ...] = type(like)._fields  # type: ignore[attr-defined]
        return list(zip(fields, like)), ("container", like)
    if dataclasses.is_dataclass(like) and not isinstance(like, type):
        # static fields (flax's pytree_node=False) are not state: the target's stay
        return [(f.name, getattr(like, f.name)) for f in state_fields(like)], (
            "container", like)
    # a plain list or tuple matches only a saved list or tuple (_walk_sequence), whether
    # or not JAX, which would expand it as a pytree of keys 0, 1, ..., is imported
    exp = None if isinstance(like, (list, tuple)) else expand_pytree(like)
    if exp is not None:
        return list(zip(exp.keys, exp.children)), ("pytree", like)
    raise TargetMismatchError(
        f"the target at key path '{format_keypath(path)}' is a {type_name(like)}, but the "
        f"checkpoint holds a {k} there"
    )


def finish_build(rebuild: Any, builds: list[tuple[Key, Build]]) -> Build:
    how, like = rebuild

    def build() -> Any:
        keys = [k for k, _ in builds]
        values = [b() for _, b in builds]
        if how == "pytree":
            return rebuild_pytree(like, values)
        return rebuild_container("dict", like, keys, values, ())

    return build


def container_build(kind: str, like: Any, builds: list[tuple[Key, Build]],
                     path: KeyPath) -> Build:
    def build() -> Any:
        keys = [k for k, _ in builds]
        values = [b() for _, b in builds]
        return rebuild_container(kind, None if like is NO_TARGET else like, keys, values, path)

    return build
