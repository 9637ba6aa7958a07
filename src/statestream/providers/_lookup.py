"""The per-type cache that provider and adapter lookups share."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

__all__ = ["first_by_type"]

T = TypeVar("T")


def first_by_type(cache: dict[type, T | None], obj: Any, candidates: Sequence[T],
                  accepts: Callable[[T, Any], bool], *, cache_miss: bool) -> T | None:
    """The first of ``candidates`` that ``accepts`` ``obj``, remembered per ``type(obj)``.

    A match is always cached; "no candidate" only when ``cache_miss`` (types
    that may later gain a provider, or whose instances differ, are asked again).
    """
    t = type(obj)
    try:
        return cache[t]
    except KeyError:  # not cached yet: ask the candidates
        pass
    found = next((c for c in candidates if accepts(c, obj)), None)
    if found is not None or cache_miss:
        cache[t] = found
    return found
