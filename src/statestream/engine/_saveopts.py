"""What a save is asked besides what and where (:class:`SaveOptions`), and the check
of the caller's metadata."""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Callable, Collection, Mapping
from typing import Any

from statestream.distributed import Collective, SingleProcess
from statestream.engine._codec import CompressionPolicy
from statestream.engine._core import IOOptions, MemoryOptions, Progress
from statestream.errors import UnsupportedTypeError

__all__ = ["SaveOptions", "check_user_meta"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class SaveOptions:
    """Everything a save is asked besides what and where (see ``ss.save``)."""

    overwrite: bool = False
    pickle_paths: Collection[str] = ()
    io: IOOptions = dataclasses.field(default_factory=IOOptions)
    memory: MemoryOptions = dataclasses.field(default_factory=MemoryOptions)
    collective: Collective = dataclasses.field(default_factory=SingleProcess)
    progress: Progress | None = None
    #: the caller's metadata, checked when the save begins (:func:`check_user_meta`)
    user_meta: Mapping[str, Any] | None = None
    #: which arrays are compressed, with what (default: none)
    compression: CompressionPolicy = dataclasses.field(
        default_factory=lambda: CompressionPolicy(None))
    #: an incremental save's base: a committed sibling checkpoint (path or URL)
    base: str | os.PathLike[str] | None = None
    #: record each chunk's XXH3-128 (so a later save can use this one as its base)
    hashes: bool = False
    #: the path is on each node's own disk: every node commits its own copy
    #: (the manifest and its processes' data files; see engine/_nodelocal.py)
    node_local: bool = False
    #: called by the process that commits, last before the commit makes the save
    #: visible (its manifest and marker staged); raising fails the save with nothing
    #: committed. A manager's check that it still holds its directory's lease.
    before_commit: Callable[[], None] | None = None


def check_user_meta(meta: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """Validate user metadata: a JSON-able mapping of at most 1 MiB, nested at most
    :data:`MAX_META_DEPTH` levels (a copy of it).

    Raises:
        UnsupportedTypeError: not JSON (NaN and infinities included), or too large.
    """
    if meta is None:
        return None
    try:
        text = json.dumps(dict(meta), allow_nan=False)
    except (TypeError, ValueError, RecursionError) as exc:
        where = _not_json(dict(meta), "meta")
        raise UnsupportedTypeError(
            f"{where or 'meta'}: metadata must be JSON (str keys; finite numbers, strings, "
            f"booleans, None, lists, dicts){'' if where else f' ({exc})'}") from exc
    if len(text) > 1 << 20:
        raise UnsupportedTypeError(f"meta is {len(text)} bytes of JSON; keep it under 1 MiB")
    out: dict[str, Any] = json.loads(text)
    depth = _depth(out)
    if depth > MAX_META_DEPTH:
        raise UnsupportedTypeError(
            f"meta nests {depth} levels of lists and dicts; keep it within {MAX_META_DEPTH}")
    return out


#: How deep the caller's metadata may nest (the mapping itself is level 1). JSON
#: takes nearly a thousand, but a manifest's meta is copied and printed by code that
#: recurses (a save of meta 600 deep committed, then raised RecursionError).
MAX_META_DEPTH = 64


def _depth(value: Any) -> int:
    """Levels of lists and dicts in the JSON value ``value`` (without recursion)."""
    deepest, todo = 0, [(value, 1)]
    while todo:
        v, d = todo.pop()
        if isinstance(v, dict):
            v = list(v.values())
        if isinstance(v, list):
            deepest = max(deepest, d)
            todo.extend((x, d + 1) for x in v)
    return deepest


def _not_json(value: Any, path: str, depth: int = 0) -> str | None:
    """Where in ``value`` (a path from ``path``) the first value JSON cannot hold is,
    and what it is; None if nothing is found (too deep to look)."""
    if depth > 64:
        return None
    if isinstance(value, dict):
        for k, v in value.items():
            if type(k) is not str:
                return f"{path} has the key {k!r:.40} ({type(k).__name__}, not str)"
            found = _not_json(v, f"{path}[{k!r:.40}]", depth + 1)
            if found:
                return found
        return None
    if isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            found = _not_json(v, f"{path}[{i}]", depth + 1)
            if found:
                return found
        return None
    if isinstance(value, float) and not math.isfinite(value):
        return f"{path} is {value!r}"
    if value is None or isinstance(value, (str, int, float)):
        return None
    t = type(value)
    return f"{path} is a {'' if t.__module__ == 'builtins' else t.__module__ + '.'}{t.__qualname__}"
