"""State providers: one per kind of array state, same shape for each framework.

``array_provider_for(obj)`` finds the provider of a value to save,
``target_provider_for(like)`` the provider a target leaf asks for, and
``provider_by_kind(kind)`` the one a checkpoint recorded.
"""

from __future__ import annotations

from typing import Any

from statestream.providers._base import (
    ArrayProvider,
    Destination,
    PreparedArray,
    box_slices,
    chunk_of_host_array,
    find_box,
)
from statestream.providers.jax import JaxProvider, expand_pytree, rebuild_pytree
from statestream.providers.numpy import NumpyProvider
from statestream.providers.torch import TorchProvider

__all__ = [
    "ArrayProvider",
    "Destination",
    "JaxProvider",
    "NumpyProvider",
    "PreparedArray",
    "TorchProvider",
    "array_provider_for",
    "box_slices",
    "chunk_of_host_array",
    "expand_pytree",
    "find_box",
    "provider_by_kind",
    "rebuild_pytree",
    "target_provider_for",
]

_NUMPY = NumpyProvider()
_PROVIDERS: tuple[Any, ...] = (_NUMPY, TorchProvider(), JaxProvider())
_BY_KIND = {p.kind: p for p in _PROVIDERS}


_BY_TYPE: dict[type, Any] = {}


def array_provider_for(obj: Any) -> Any:
    """Provider that can save ``obj``, or None if it is not an array."""
    t = type(obj)
    p = _BY_TYPE.get(t)
    if p is not None:
        return p
    for p in _PROVIDERS:
        if p.handles(obj):
            _BY_TYPE[t] = p
            return p
    return None


_TARGET_BY_TYPE: dict[type, Any] = {}


def target_provider_for(like: Any) -> Any:
    """Provider whose type the target leaf ``like`` asks for, or None."""
    t = type(like)
    if t in _TARGET_BY_TYPE:
        return _TARGET_BY_TYPE[t]
    found = None
    for p in _PROVIDERS:
        if p.is_target(like):
            found = p
            break
    if found is not None or t in (dict, list, tuple, int, float, str, bool, type(None)):
        _TARGET_BY_TYPE[t] = found
    return found


def provider_by_kind(kind: str) -> Any:
    """Provider recorded as ``kind`` in a manifest; NumPy if unknown or unavailable."""
    p = _BY_KIND.get(kind)
    if p is None or (kind != "numpy" and not _framework_loaded(kind)):
        return _NUMPY
    return p


def _framework_loaded(kind: str) -> bool:
    import sys

    return kind in sys.modules
