"""What the manager does with its local tier: open it, list both tiers, load from the best."""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

from statestream.api import load
from statestream.api._pickles import AllowPickle
from statestream.distributed import Collective, SingleProcess, agree
from statestream.engine import IOOptions, MemoryOptions
from statestream.errors import CheckpointCorruptError, CheckpointError
from statestream.manager._policies import KeepLatest, KeepPolicy
from statestream.manager._steps import StepDirectory
from statestream.manager._tier import LocalTier

__all__ = ["open_tier", "tier_load", "tier_steps"]


def open_tier(root: str, persistent: StepDirectory, keep: KeepPolicy | None,
              coll: Collective, read_only: bool) -> LocalTier:
    """Open the local tier and queue the persistence of what the last manager left."""
    if read_only:
        raise CheckpointError(
            f"{persistent.directory} is read-only: a local tier in front of it could never "
            "be persisted; open the manager without local_tier to load from it")
    err: BaseException | None = None
    tier: LocalTier | None = None
    try:
        tier = LocalTier(root, persistent, keep or KeepLatest(2), coll)
    except BaseException as exc:
        err = exc
    agree(coll, "opening the local tier", err)
    assert tier is not None
    for step in tier.unpersisted():  # a crash after a local commit loses nothing
        tier.persist(step)
    return tier


def tier_steps(tier: LocalTier, coll: Collective) -> list[int]:
    """Steps committed in the local tier or in the persistent directory."""
    return sorted(set(tier.steps()) | set(tier.persistent.steps()))


def tier_load(tier: LocalTier, step: int, target: Any, *, items: Sequence[str] | None,
              allow_pickle: AllowPickle, io: IOOptions | None, memory: MemoryOptions | None,
              collective: Collective) -> Any:
    """Load ``step`` from the local tier if it holds a copy that verifies, else persistent.

    Each process reads on its own (``load`` agrees only on errors), so a
    process whose local copy is damaged falls back alone, with a warning.
    """
    one = SingleProcess()
    result: Any = None
    err: BaseException | None = None
    from_persistent = not tier.is_committed(step)
    if not from_persistent:
        try:
            result = load(tier.path(step), target, items=items, allow_pickle=allow_pickle,
                          io=io, memory=memory, collective=one)
        except CheckpointCorruptError as exc:
            if tier.persistent.is_committed(step):
                warnings.warn(
                    f"the local copy of step {step} ({tier.path(step)}) is damaged ({exc}); "
                    f"loading the persisted copy {tier.persistent.path(step)} instead",
                    RuntimeWarning, stacklevel=3)
                from_persistent = True
            else:
                err = exc
        except BaseException as exc:
            err = exc
    if from_persistent:
        try:
            result = load(tier.persistent.path(step), target, items=items,
                          allow_pickle=allow_pickle, io=io, memory=memory, collective=one)
        except BaseException as exc:
            err = exc
    agree(collective, "loading", err, outcome="no process returns a result")
    return result
