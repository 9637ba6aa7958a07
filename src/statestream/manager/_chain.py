"""Chains of incremental steps: ``CheckpointManager(incremental=N)`` starts a new one
with a full save once a chain holds N incremental saves.

A step's *depth* is 0 when its manifest has no ``bases`` (a full save, or an
incremental one whose every chunk changed: it refers to nothing), else its
base's depth + 1, recorded in its manifest (``meta["user"]["chain"]``). A save
whose base already has depth N is a full one (with hashes: the next save's base).
So with N=3 saves 0, 4, 8, ... of a chain are full whatever the steps' numbers,
and a restarted manager (or one on a local tier) reads the same depths from
storage. A base whose depth is unknown (its manifest has ``bases`` but no
depth, e.g. written with ``incremental=True``, or cannot be read) counts as N:
a full save starts a new chain.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Any

import numpy as np

from statestream.distributed import Collective, share_from_0
from statestream.errors import (
    CheckpointError,
    InvalidOptionError,
    InvalidOptionTypeError,
    StorageError,
)
from statestream.manager._retention import recorded
from statestream.manager._tier import LocalTier
from statestream.manager._tierbase import base_for

__all__ = ["CHAIN_KEY", "chain_base", "chain_depth", "incremental_option"]

#: the key of the manager's ``meta["user"]`` recording a step's depth
CHAIN_KEY = "chain"


def incremental_option(value: Any) -> tuple[bool, int | None]:
    """``CheckpointManager``'s ``incremental``: (incremental, the longest chain or None
    for unbounded). False, True, or an int >= 1: incremental saves between full ones.

    Example:
        >>> incremental_option(True), incremental_option(3), incremental_option(False)
        ((True, None), (True, 3), (False, None))
    """
    if isinstance(value, (bool, np.bool_)):
        return bool(value), None
    if not isinstance(value, (int, np.integer)):
        raise InvalidOptionTypeError(
            "incremental must be True, False or an int >= 1 (incremental saves between "
            f"full ones), not {type(value).__name__} {value!r}"[:300])
    if value < 1:
        raise InvalidOptionError(
            f"incremental must be True, False or an int >= 1 (incremental saves between "
            f"full ones), not {int(value)}")
    return True, int(value)


def chain_depth(path: str) -> int | None:
    """The depth of the step at ``path`` (see the module); None if unknown.

    Raises:
        StorageError: the store failed (not the step).
    """
    try:
        # a step this process committed: no manifest decoded (until 2026-12-07 rank 0
        # read its base's whole manifest before each save: metadata of 100k arrays ~1 s)
        md = recorded(path)
    except StorageError:
        raise
    except CheckpointError:
        return None
    if not md.bases:
        return 0
    user = md.meta.get("user")
    depth = user.get(CHAIN_KEY) if isinstance(user, dict) else None
    ok = isinstance(depth, int) and not isinstance(depth, bool) and depth >= 0
    return depth if ok else None


def chain_base(step: int, limit: int | None, coll: Collective, tier: LocalTier | None,
               listed: Callable[[], list[int]], path: Callable[[int], str],
               damaged: Collection[int] = ()) -> tuple[int | None, int | None]:
    """(the base of an incremental save of ``step`` or None for a full one, the depth
    to record for it or None for none); ``limit``: ``incremental``'s N, None for an
    unbounded chain (no depth recorded). The same on every rank: rank 0 reads the
    base's depth (in the local tier with one, where the base is chosen); the other
    arguments are :func:`base_for`'s."""
    base = base_for(step, coll, tier, listed, path, damaged)
    if limit is None:
        return base, None
    if base is None:
        return None, 0
    where = path(base) if tier is None else tier.dir.path(base)
    depth = share_from_0(coll, f"reading the chain depth of step {base}",
                         lambda: chain_depth(where))
    if depth is None or depth >= limit:
        return None, 0
    return base, depth + 1
