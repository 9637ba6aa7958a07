"""What a save is asked besides what and where (:class:`SaveOptions`), and the check
of the caller's metadata."""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Collection, Mapping
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


def check_user_meta(meta: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """Validate user metadata: a JSON-able mapping of at most 1 MiB (a copy of it).

    Raises:
        UnsupportedTypeError: not JSON (NaN and infinities included), or too large.
    """
    if meta is None:
        return None
    try:
        text = json.dumps(dict(meta), allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise UnsupportedTypeError(
            f"meta must be a JSON-able mapping (str keys; numbers, strings, lists, dicts): {exc}"
        ) from exc
    if len(text) > 1 << 20:
        raise UnsupportedTypeError(f"meta is {len(text)} bytes of JSON; keep it under 1 MiB")
    out: dict[str, Any] = json.loads(text)
    return out
