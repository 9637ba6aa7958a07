"""At open, with several nodes: the nodes' copies of each local step are compared.

Each node's leader commits its node's copy of a step on its own, so a crash
(or a failed disk) between two nodes' commits leaves copies that are not one
save:

- **different saves** (their commit markers differ): a save again of the step
  (``force=True``) was interrupted after some nodes committed the new copy
  while the others still hold the old one. Completing one from the other, or
  persisting them together, would mix the two saves. Every node's copy is
  removed; the persistent directory's copy (if any) is the step.
- **committed on some nodes only, and not completable**: a save interrupted
  between the nodes' commits, whose files the other nodes never got. When the
  persistent directory does not hold the step either, every copy is removed:
  the step was never saved (listed, it would fail every load and be kept,
  unpersisted, forever).

A copy whose marker or manifest cannot be read is left alone (a load of it
falls back to the persisted copy or reports the damage).
"""

from __future__ import annotations

import warnings
from typing import Any

from statestream.distributed import Collective, agree, gather_each, share_from_0
from statestream.engine import describe_copy
from statestream.errors import CheckpointError
from statestream.manager._tier import LocalTier

__all__ = ["reconcile"]


def reconcile(tier: LocalTier, coll: Collective) -> list[int]:
    """Remove the local steps whose nodes' copies are not one whole save (see the
    module); collective. Returns the steps removed (the same on every process).

    Warns:
        RuntimeWarning: on every process, naming each step removed and why.
    """
    if len(tier.groups.leaders()) < 2:
        return []

    def mine() -> dict[str, Any] | None:
        if not tier.groups.is_leader:
            return None
        return {str(s): describe_copy(tier.path(s)) for s in tier.steps()}

    nodes = [n for n in gather_each(coll, "comparing the nodes' local copies", mine)
             if n is not None]
    mixed, partial = _judge(nodes)
    if partial:
        partial = share_from_0(coll, f"looking up {partial} in {tier.persistent.directory}",
                               lambda: [s for s in partial if not _held_there(tier, s)])
    for s in mixed:
        warnings.warn(
            f"the nodes' local copies of step {s} are different saves of it (a save of it "
            "was interrupted after some nodes committed their copy): removed from every "
            f"node's local tier; the step is what {tier.persistent.directory} holds, if "
            "anything", RuntimeWarning, stacklevel=3)
    for s in partial:
        warnings.warn(
            f"step {s} is committed on some nodes' local tiers only, no node holds some "
            f"of its files, and {tier.persistent.directory} does not hold it (a save of it "
            "was interrupted between the nodes' commits): removed as never saved",
            RuntimeWarning, stacklevel=3)
    drop = sorted(set(mixed) | set(partial))
    err: BaseException | None = None
    if drop and tier.groups.is_leader:
        try:
            for s in reversed(drop):  # newest first
                if tier.is_committed(s):
                    tier.dir.discard(s)
                tier.records.forget(s)
                tier.retention.forget(s)
        except BaseException as exc:
            err = exc
    agree(coll, f"removing the interrupted local steps {drop}", err)
    return drop


def _judge(nodes: list[dict[str, Any]]) -> tuple[list[int], list[int]]:
    """(steps whose committed copies are different saves, steps committed on some
    nodes only that no node can complete)."""
    mixed, partial = [], []
    for key in sorted({k for n in nodes for k in n}, key=int):
        copies = [n[key] for n in nodes if key in n and n[key]["committed"]]
        good = [c for c in copies if c["damage"] is None]
        if not good or len(good) < len(copies):
            continue  # damaged: a load falls back or reports it
        if len({c["marker"] for c in good}) > 1:
            mixed.append(int(key))
        elif len(copies) < len(nodes):
            held = {tuple(f) for c in good for f in c["files"]}
            if not {tuple(f) for f in good[0]["need"]} <= held:
                partial.append(int(key))
    return mixed, partial


def _held_there(tier: LocalTier, step: int) -> bool:
    """Whether the persistent directory holds ``step`` committed (True: cannot tell)."""
    try:
        return tier.persistent.is_committed(step)
    except CheckpointError:
        return True
