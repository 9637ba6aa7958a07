"""Whether a target can take the kind of value the checkpoint holds at its key path:
an array, a plain value, a container. ``load``'s walk (``api/_load.py``) refuses a
target that cannot, or, inside a stateful target, loads what was saved."""

from __future__ import annotations

import dataclasses
from typing import Any

from statestream.api._builds import scalar_fits
from statestream.format import Manifest
from statestream.providers import adapter_for, expand_pytree, target_provider_for
from statestream.tree import Node, is_stateful, type_name

__all__ = ["PLAIN_KINDS", "fits", "structured"]

#: saved leaves that hold a plain Python value
PLAIN_KINDS = ("none", "bool", "int", "float", "str")
_PLAIN_TYPES = (bool, int, float, complex, str, bytes)


def structured(like: Any) -> str | None:
    """What target ``like`` is when it takes more than a plain value: "an array", or
    "a <type>" for a stateful object, a generator, a container; None for a plain
    value (an int target for an int leaf, a string, any other object)."""
    if like is None or type(like) in _PLAIN_TYPES:  # (JAX sees None as an empty pytree)
        return None
    if target_provider_for(like) is not None:
        return "an array"
    if (is_stateful(like) or adapter_for(like) is not None
            or isinstance(like, (dict, list, tuple))
            or (dataclasses.is_dataclass(like) and not isinstance(like, type))
            or expand_pytree(like) is not None):
        return f"a {type_name(like)}"
    return None


def fits(node: Node, like: Any, m: Manifest) -> bool:
    """Whether target ``like`` takes the kind of value saved ``node`` holds as it is
    (its shape is checked where it loads): an array target or an exact Python
    number for an array, a plain target for a plain value or bytes, a sequence for
    a list or tuple, a keyed container for any other container, anything for a
    stateful node (its own walk decides)."""
    k = node.kind
    if k in ("array", "alias"):
        if target_provider_for(like) is not None:
            return True
        entry = m.arrays[node.array] if node.array is not None else None
        return (type(like) in (bool, int, float) and entry is not None
                and entry.shape == () and scalar_fits(entry.dtype, type(like), exact=True))
    if k in PLAIN_KINDS or k in ("bytes", "pickle"):
        return structured(like) is None
    if k == "stateful" or target_provider_for(like) is not None:
        return k == "stateful"
    if is_stateful(like) or adapter_for(like) is not None:
        return True  # a state saved as a plain dict, into the object
    sequence = isinstance(like, (list, tuple)) and not hasattr(type(like), "_fields")
    if k in ("list", "tuple"):
        return sequence
    return not sequence and structured(like) is not None
