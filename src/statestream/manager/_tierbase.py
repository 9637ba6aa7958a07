"""An incremental save's base: which step a manager's next save refers to.

Without a local tier, the newest listed step before it that can be a base; with
one, the newest such step of the local tier, whose chain must also be one that
can be persisted (see :func:`base_for`).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Collection

from statestream.distributed import Collective, gather_each, share_from_0
from statestream.engine import check_base
from statestream.errors import CheckpointError, StorageError
from statestream.manager._tier import LocalTier
from statestream.manager._tierrefs import refers_to_damage, unpersistable

__all__ = ["base_for"]


def base_for(step: int, coll: Collective, tier: LocalTier | None,
             listed: Callable[[], list[int]], path: Callable[[int], str],
             damaged: Collection[int] = ()) -> int | None:
    """An incremental save's base step: the newest kept step before ``step`` (never
    ``step`` itself, which an overwrite replaces) that can be a base, the same on every
    rank; ``listed`` gives the directory's kept steps (asked on rank 0), ``path`` a
    step's path there.

    With a local tier the save commits there, and references stay among
    siblings: the base is the newest step before ``step`` in the local tier
    (none: a full save, e.g. the first on a new machine); with several nodes,
    in every node's tier (each process reads the base's manifest there).

    A step whose manifest is damaged (or that is gone) is passed over with a
    ``RuntimeWarning``: a save against it fails, so every later save of the manager
    failed while it was the newest step. So is a step in ``damaged`` (a resume found
    its data damaged and went back past it): its manifest reads fine, but a chunk the
    new step left unchanged would refer to its damaged bytes, and the new step, reported
    saved, would not load. With a tier, so is a step whose local copy a load found
    damaged, or that refers to one (:func:`refers_to_damage`).
    """
    phase = f"finding the base of step {step}"
    if tier is not None and len(tier.groups.leaders()) > 1:
        def mine() -> list[int] | None:  # a leader's candidates (none: an overwrite)
            if not tier.groups.is_leader:
                return None
            if _overwrites(tier, step):
                return []
            older = [s for s in tier.steps() if s < step]
            good = [s for s in older if not refers_to_damage(tier, s) and s not in damaged]
            if not good or good[-1] == older[-1]:
                return good
            # past a newer step passed over: only steps whose chain can be persisted
            return [s for s in good if unpersistable(tier, s) is None]

        held = gather_each(coll, phase, mine)
        common = set.intersection(*(set(h) for h in held if h is not None))
        return max(common) if common else None

    def newest_older() -> int | None:
        if tier is not None and _overwrites(tier, step):
            return None
        older = [s for s in (listed() if tier is None else tier.steps()) if s < step]
        for s in reversed(older):
            where = path(s) if tier is None else tier.dir.path(s)
            own = s in damaged or (tier is not None and s in tier.damaged_copies)
            if own or (tier is not None and refers_to_damage(tier, s)):
                which = "it" if own else "a step it refers to"
                warnings.warn(f"step {s} ({where}) cannot be the base of step {step}: a load "
                              f"found {which} damaged; an older step is used instead, or "
                              "none (a full save)", RuntimeWarning, stacklevel=6)
                continue
            try:
                check_base(where)
            except StorageError:
                raise  # the store failed, not the step
            except CheckpointError as exc:
                why: str | None = str(exc)
            else:  # past a newer step: its chain may be gone from the directory
                why = unpersistable(tier, s) if tier is not None and s < older[-1] else None
            if why is None:
                return s
            warnings.warn(f"step {s} ({where}) cannot be the base of step {step} ({why}); "
                          "an older step is used instead, or none (a full save)",
                          RuntimeWarning, stacklevel=6)
        return None

    return share_from_0(coll, phase, newest_older)


def _overwrites(tier: LocalTier, step: int) -> bool:
    """Whether a save of ``step`` into ``tier`` replaces a copy there (``force=True``):
    it is then a full save. Its old copy no longer refers to the step before it, so the
    directory's keep policy may have deleted that one, and persisting the new copy
    would copy it back with every step it refers to; a retired step among them whose own
    base is gone cannot be committed there, so the new copy could never be persisted
    (until 2026-12-07 every ``wait`` and ``close`` then raised, and ``directory`` kept
    the old copy)."""
    return tier.is_committed(step)
