"""State adapters: values whose state is a small tree, saved and restored without pickle.

An array provider turns one array into bytes. A *state adapter* turns an
object that is not an array and has no ``state_dict()`` -- a random number
generator, a typed JAX key, a ``torch.compile``'d module -- into a tree of
plain values and arrays (its *state*), and puts a loaded state back. The
walk saves the state as a ``stateful`` node whose type name is the
adapter's :attr:`StateAdapter.name`; loading into a target of the same
kind calls :meth:`StateAdapter.set_state`, and loading with ``None`` in the
target builds a fresh object with :meth:`StateAdapter.new` (only for
adapters that have a name and whose module is loaded; a checkpoint never
imports anything).

A new kind of stateful value is one subclass passed to
:func:`register_adapter`; nothing else changes.
"""

from __future__ import annotations

import abc
import sys
import threading
from collections.abc import Callable
from typing import Any

from statestream.errors import UnsupportedTypeError
from statestream.providers._lookup import first_by_type
from statestream.tree import KeyPath

__all__ = ["StateAdapter", "adapter_by_name", "adapter_for", "adapters", "register_adapter"]


class StateAdapter(abc.ABC):
    """Saves one kind of stateful value as a tree and restores it."""

    #: recorded as the ``stateful`` node's type name; values saved under it are
    #: rebuilt by :meth:`new` when loaded with ``None`` in the target. Empty: the
    #: node takes :meth:`node_name` and is never rebuilt by name.
    name: str = ""
    #: a module that must already be imported before :meth:`new` is used
    module: str | None = None
    #: a wrapper's prefix to the keys of the ``state_dict()`` it wraps (a
    #: ``torch.compile``'d module's ``_orig_mod.``): a saved state whose keys all
    #: carry it loads into a stateful target whose keys carry none, without it
    key_prefix: str = ""
    #: a saved plain tree (what :meth:`get_state` returns, saved as it is) loads into a
    #: target of this kind too, as its state
    plain_state: bool = False

    @abc.abstractmethod
    def handles(self, obj: Any) -> bool:
        """True if ``obj`` is a value of this kind (decided by its type alone:
        the answer is cached per type)."""

    @abc.abstractmethod
    def get_state(self, obj: Any) -> Any:
        """The state of ``obj``: a tree of plain values and arrays."""

    @abc.abstractmethod
    def set_state(self, obj: Any, state: Any, path: KeyPath) -> Any:
        """Put a loaded ``state`` into the target ``obj``; return the restored value
        (``obj`` itself, or a new value for immutable kinds)."""

    def new(self, state: Any, path: KeyPath) -> Any:
        """A fresh value holding ``state`` (loading with ``None`` in the target)."""
        return state

    def staged(self, obj: Any, state: Any, path: KeyPath) -> Callable[[], Any] | None:
        """Check that :meth:`set_state` would take ``state`` into target ``obj``, without
        changing ``obj``, and return the call that puts it in (raising as
        :meth:`set_state` does). A load makes it with the ``load_state_dict`` calls, once
        every value is built, so that a value that fails to build leaves ``obj`` as it
        was. None (the default): :meth:`set_state` is called as the value is built (an
        adapter whose set_state returns a new value must keep the default)."""
        return None

    def target_state(self, obj: Any) -> Any:
        """The target tree a load matches the saved state against (default:
        :meth:`get_state`). Parts of the state that older checkpoints lack are
        left out here, so that those still load (the saved ones load anyway)."""
        return self.get_state(obj)

    def abstract_state(self, like: Any) -> Any:
        """The target tree of the state of a value that ``like`` describes without
        being one (a typed JAX key as a ``jax.ShapeDtypeStruct``, from
        ``jax.eval_shape``); the loaded state becomes a value through :meth:`new`.
        None (the default) when ``like`` is no such description."""
        return None

    def refuse_saved(self, saved: dict[str, Any], like: Any, path: KeyPath) -> None:
        """Raise TargetMismatchError where the saved state's plain top-level entries
        (``saved``: its str, int, float, bool and None values by key) show that target
        ``like`` (a value or what :meth:`abstract_state` takes) cannot take it; called
        before any saved array is matched against the target. Default: nothing."""
        return None

    def wrapped(self, obj: Any) -> Any:
        """The stateful object (``state_dict()``/``load_state_dict()``) that ``obj``
        wraps and whose state is ``obj``'s, or None (the default): a saved plain
        state (a ``state_dict()`` saved as a dict) then loads into ``obj`` as
        into that object."""
        return None

    def node_name(self, obj: Any) -> str:
        """The type name recorded for ``obj`` (default: :attr:`name`)."""
        return self.name


_LOCK = threading.Lock()
_ADAPTERS: list[StateAdapter] = []
_BY_NAME: dict[str, StateAdapter] = {}
_BY_TYPE: dict[type, StateAdapter | None] = {}


def register_adapter(adapter: StateAdapter) -> None:
    """Add an adapter for a new kind of stateful value.

    Raises:
        UnsupportedTypeError: not a StateAdapter, or its name is taken.
    """
    if not isinstance(adapter, StateAdapter):
        raise UnsupportedTypeError(
            f"{type(adapter).__qualname__} is not a statestream.providers.StateAdapter")
    with _LOCK:
        if adapter.name and adapter.name in _BY_NAME:
            raise UnsupportedTypeError(
                f"a state adapter named {adapter.name!r} is already registered")
        _ADAPTERS.append(adapter)
        if adapter.name:
            _BY_NAME[adapter.name] = adapter
        _BY_TYPE.clear()


def adapters() -> tuple[StateAdapter, ...]:
    """Every registered adapter, in the order they are asked."""
    return tuple(_ADAPTERS)


def adapter_for(obj: Any) -> StateAdapter | None:
    """The adapter for ``obj``, or None (cached per type)."""
    return first_by_type(_BY_TYPE, obj, _ADAPTERS, lambda a, x: a.handles(x), cache_miss=True)


def adapter_by_name(name: str | None) -> StateAdapter | None:
    """The adapter recorded as ``name`` in a manifest, if its module is loaded."""
    a = _BY_NAME.get(name or "")
    if a is None or (a.module is not None and a.module not in sys.modules):
        return None
    return a
