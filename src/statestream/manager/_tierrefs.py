"""What a local tier's step refers to that its persistent directory lacks: the
steps a persistence copies there first (incremental steps, docs/manager.md); and
which local copies a load found damaged, with the steps that refer to them."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from statestream.errors import CheckpointError

if TYPE_CHECKING:
    from statestream.manager._tier import LocalTier

__all__ = ["mark_damaged", "missing_bases", "refers_to_damage", "unpersistable"]


def missing_bases(tier: LocalTier, step: int) -> list[int]:
    """Steps that ``step`` of the local ``tier`` refers to, directly or through its
    bases, that are not committed in the persistent directory (to copy there first),
    ascending.

    Raises:
        CheckpointError: such a step is not in the local tier either, or a
            manifest on the way cannot be read.
    """
    need: set[int] = set()
    todo = [step]
    while todo:
        s = todo.pop()
        bases = tier.retention.bases_of(s)
        if bases is None:
            raise CheckpointError(
                f"cannot persist step {step}: the manifest of {tier.path(s)} cannot be "
                "read, so what it refers to is unknown")
        for b in bases:
            if b in need or tier.current_in_persistent(b):
                continue  # committed there: the directory keeps what it refers to
            if not tier.is_committed(b):
                raise CheckpointError(
                    f"cannot persist step {step}: it refers to chunks of step {b}, which "
                    f"is committed neither in {tier.persistent.directory} nor in the "
                    f"local tier {tier.root}")
            need.add(b)
            todo.append(b)
    return sorted(need)


def unpersistable(tier: LocalTier, step: int) -> str | None:
    """Why ``step`` of the local ``tier`` could not be persisted now (a step it refers
    to, directly or through its bases, is committed neither in the persistent directory
    nor in the tier, or cannot be read), or None if it could: a save against it would
    refer to that step too, and could never be persisted either. Asks the directory;
    a store that fails counts as a reason (a full save is always one that persists)."""
    try:
        missing_bases(tier, step)
    except (CheckpointError, OSError) as exc:  # StorageError included
        return str(exc)
    return None


def mark_damaged(tier: LocalTier, step: int, exc: BaseException) -> list[int]:
    """Record that a load of ``step`` from ``tier`` failed with the damage ``exc``, and
    return the steps recorded (ascending): ``step``, and the steps it refers to whose
    local copy holds the damage. That is each one whose directory ``exc`` names (the
    file of a chunk, a manifest: a load's errors name where the bytes are); where it
    names neither ``step`` nor one of them, every step ``step`` refers to, since which
    one holds the damage cannot be told. Until 2026-12-07 only ``step`` was recorded: the step that
    held the damaged bytes stayed the next save's base, and each new local copy
    referred to them (damaged from birth)."""
    bases = tier.retention.bases_of(step) or []
    said = str(exc)
    named = [b for b in bases
             if re.search(re.escape(tier.path(b)) + r"(?![0-9])", said) is not None]
    if not named and re.search(re.escape(tier.path(step)) + r"(?![0-9])", said) is None:
        named = list(bases)
    marked = sorted({step, *named})
    tier.damaged_copies.update(marked)
    return marked


def refers_to_damage(tier: LocalTier, step: int) -> bool:
    """Whether the local copy of ``step``, or of a step it refers to, was found damaged
    by a load (``tier.damaged_copies``): a save against it would refer to the damaged
    bytes. References are flattened, so ``step``'s own ``bases`` are all it reads."""
    damaged = tier.damaged_copies
    if not damaged:
        return False
    return step in damaged or not damaged.isdisjoint(tier.retention.bases_of(step) or ())
