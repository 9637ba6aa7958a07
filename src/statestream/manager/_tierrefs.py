"""What a local tier's step refers to that its persistent directory lacks: the
steps a persistence copies there first (incremental steps, docs/manager.md)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from statestream.errors import CheckpointError

if TYPE_CHECKING:
    from statestream.manager._tier import LocalTier

__all__ = ["missing_bases", "unpersistable"]


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
