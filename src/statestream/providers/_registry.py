"""The provider registry: which provider saves a value, serves a target, reads a kind.

Built-in providers (NumPy, torch, JAX) are registered at import; a new
framework registers one :class:`~statestream.providers.ArrayProvider` with
:func:`register_provider`. Lookups by value type are cached (the cache is
cleared whenever the registry changes).
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np

from statestream.errors import UnsupportedTypeError
from statestream.providers._base import ArrayProvider
from statestream.providers._lookup import first_by_type

__all__ = [
    "array_provider_for",
    "module_provider_for",
    "optimizer_provider_for",
    "pinned_alloc",
    "provider_by_kind",
    "providers",
    "register_provider",
    "target_provider_for",
]

_LOCK = threading.Lock()
_PROVIDERS: list[ArrayProvider] = []
_BY_KIND: dict[str, ArrayProvider] = {}
#: value type -> provider (None: a plain type no provider handles)
_BY_TYPE: dict[type, ArrayProvider | None] = {}
_TARGET_BY_TYPE: dict[type, ArrayProvider | None] = {}
_PLAIN = (dict, list, tuple, int, float, str, bool, bytes, type(None))
#: modules a kind needs loaded before its provider builds values (else NumPy)
_NEEDS_MODULE: dict[str, str] = {}


def register_provider(provider: ArrayProvider, *, first: bool = False,
                      module: str | None = None) -> None:
    """Add a provider for a new kind of array (a framework).

    Args:
        provider: an :class:`~statestream.providers.ArrayProvider`; its
            ``kind`` names it in manifests and must be new.
        first: ask it before the built-in providers (to take over a type
            another provider also handles).
        module: loading a checkpoint without a target builds this kind's
            values only when this module is already imported (otherwise
            NumPy arrays), so a checkpoint never imports a framework.

    Raises:
        UnsupportedTypeError: not an ArrayProvider, or its kind is taken.

    Example:
        >>> import statestream as ss
        >>> from statestream.providers import NumpyProvider
        >>> class Mine(NumpyProvider):
        ...     kind = "mine-doctest"
        ...     def handles(self, obj): return False
        >>> ss.register_provider(Mine())
    """
    if not isinstance(provider, ArrayProvider):
        raise UnsupportedTypeError(
            f"{type(provider).__qualname__} is not a statestream.providers.ArrayProvider")
    with _LOCK:
        if not provider.kind or provider.kind in _BY_KIND:
            raise UnsupportedTypeError(
                f"a provider of kind {provider.kind!r} is already registered (or the kind is "
                "empty); choose another kind")
        if first:
            _PROVIDERS.insert(0, provider)
        else:
            _PROVIDERS.append(provider)
        _BY_KIND[provider.kind] = provider
        if module is not None:
            _NEEDS_MODULE[provider.kind] = module
        _BY_TYPE.clear()
        _TARGET_BY_TYPE.clear()


def providers() -> tuple[ArrayProvider, ...]:
    """Every registered provider, in the order they are asked."""
    return tuple(_PROVIDERS)


def array_provider_for(obj: Any) -> ArrayProvider | None:
    """Provider that can save ``obj``, or None if it is not an array."""
    return first_by_type(_BY_TYPE, obj, _PROVIDERS, lambda p, x: p.handles(x),
                         cache_miss=type(obj) in _PLAIN)


def target_provider_for(like: Any) -> ArrayProvider | None:
    """Provider whose type the target leaf ``like`` asks for, or None."""
    return first_by_type(_TARGET_BY_TYPE, like, _PROVIDERS, lambda p, x: p.is_target(x),
                         cache_miss=type(like) in _PLAIN)


def provider_by_kind(kind: str) -> ArrayProvider:
    """Provider recorded as ``kind`` in a manifest; NumPy if unknown or not loaded."""
    p = _BY_KIND.get(kind)
    module = _NEEDS_MODULE.get(kind)
    if p is None or (module is not None and module not in sys.modules):
        return _BY_KIND["numpy"]
    return p


def optimizer_provider_for(obj: Any) -> ArrayProvider | None:
    """Provider that can guard ``obj``'s steps (capability ``step_guards``), or None."""
    for p in _with("step_guards"):
        if p.is_optimizer(obj):
            return p
    return None


def module_provider_for(obj: Any) -> ArrayProvider | None:
    """Provider that can guard ``obj``'s forward passes (capability ``step_guards``), or None."""
    for p in _with("step_guards"):
        if p.is_module(obj):
            return p
    return None


def pinned_alloc(nbytes: int) -> np.ndarray | None:
    """Page-locked host memory from the first provider that can give it, else None."""
    for p in _with("pinned_memory"):
        buf = p.pinned_alloc(nbytes)
        if buf is not None:
            return buf
    return None


def _with(capability: str) -> Iterator[ArrayProvider]:
    return (p for p in _PROVIDERS if getattr(p.capabilities, capability))

