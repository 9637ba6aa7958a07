"""Room in a full local tier: persisted local copies leave before a save that
would not fit (docs/manager.md, "The local tier").

A local tier sized for fewer steps than its keep policy keeps plus one new step
failed every save with ENOSPC, although the steps it would have had to drop were
persisted (the directory holds them). Before each save, a node's leader (on the
path where the tier applies its keep policy) drops the oldest persisted local
copies until the tier has the newest step's size free, the estimate of the next
save; a save that fails for lack of room anyway says the tier is full.
"""

from __future__ import annotations

import errno
import os
import sys
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING

from statestream.errors import StorageError, storage_error

if TYPE_CHECKING:
    from statestream.distributed import Collective
    from statestream.manager._tier import LocalTier

__all__ = ["free_bytes", "make_room", "raise_if_full", "retry_when_full", "tier_full_error",
           "write_making_room"]

#: room asked past the newest step's size (the manifest, the markers, the records)
_MARGIN = 64 * 1024


def free_bytes(root: str) -> int | None:
    """Bytes an unprivileged write can use on the filesystem of ``root`` (None: unknown)."""
    try:
        st = os.statvfs(root)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def _disk_bytes(path: str) -> int:
    """What the files under ``path`` take on disk."""
    total = 0
    for top, _, files in os.walk(path):
        for f in files:
            try:
                total += os.lstat(os.path.join(top, f)).st_blocks * 512
            except OSError:
                continue
    return total


def make_room(tier: LocalTier, protected: set[int], failed: int | None = None) -> list[int]:
    """Drop the oldest persisted local steps while the tier has less room than the
    newest step takes (plus a margin); returns the steps dropped, oldest first.
    ``failed``: a save of that step just failed for lack of room: every step that
    can leave does.

    Never dropped: a step not recorded as persisted, a ``protected`` one (being
    persisted, the base of a queued save), a step a step still in the tier refers
    to (an incremental base), and nothing at all while a step's manifest cannot be
    read (what it refers to is unknown). Local disk only (the leader).

    Warns:
        RuntimeWarning: naming the steps dropped, the room there was and why.
    """
    steps = tier.steps()
    free = free_bytes(tier.root)
    if not steps or free is None:
        return []
    need = (sys.maxsize if failed is not None
            else _disk_bytes(tier.path(steps[-1])) + _MARGIN)
    had = free
    dropped: list[int] = []
    while free is not None and free < need:
        s = _droppable(tier, [s for s in steps if s not in dropped], protected)
        if s is None:
            break
        try:
            tier.dir.delete(s)  # marker first, then data
        except OSError as exc:  # StorageError included: the save tells if room lacks
            warnings.warn(f"could not remove {tier.path(s)} from the full local tier "
                          f"({exc})", RuntimeWarning, stacklevel=5)
            break
        tier.records.forget(s)
        tier.retention.forget(s)
        dropped.append(s)
        free = free_bytes(tier.root)
    if dropped:
        why = (f"less than the next save needs (about {need} bytes, the size of its newest "
               "step)" if failed is None else f"and the save of step {failed} did not fit")
        warnings.warn(
            f"the local tier {tier.root} had {had} bytes free, {why}: the persisted local "
            f"steps {dropped} were removed from it to make room (they load from "
            f"{tier.persistent.directory} while its keep policy keeps them); give the local "
            "tier more room or keep fewer steps there (local_keep_policy)",
            RuntimeWarning, stacklevel=5)
    return dropped


def write_making_room(tier: LocalTier | None, coll: Collective, step: int,
                      base: int | None, write: Callable[[], None]) -> None:
    """``write()`` (a save of ``step`` against ``base``), tried once more in a full
    local ``tier`` (:func:`retry_when_full`)."""
    try:
        write()
    except StorageError as exc:
        if tier is None:
            raise
        retry_when_full(tier, coll, step, exc, base, write)


def retry_when_full(tier: LocalTier, coll: Collective, step: int, exc: StorageError,
                    base: int | None, write: Callable[[], None]) -> None:
    """After ``write`` (a save of ``step`` against ``base``) failed with ``exc``: when
    that was a lack of room in a single process's tier, every persisted local step
    that can leave (:func:`make_room`; not ``base``, nor a step being persisted)
    does, and ``write`` is tried once more. Raises ``exc`` otherwise (as a full
    tier's error, :func:`raise_if_full`), or the retry's error.

    With several processes the save is not retried (every process would have to
    agree to); it raises, and only the room made before each save applies."""
    if (coll.world_size == 1 and _is_full(exc)
            and make_room(tier, tier.pending_steps() | ({base} if base is not None else set()),
                          failed=step)):
        try:
            return write()
        except StorageError as again:
            exc = again
    raise_if_full(tier, step, exc)
    raise exc


def raise_if_full(tier: LocalTier, step: int, exc: BaseException) -> None:
    """Raise a full tier's error (:func:`tier_full_error`) if ``exc`` is one."""
    full = tier_full_error(tier, step, exc)
    if full is not exc:
        raise full from exc


def _is_full(exc: BaseException) -> bool:
    return isinstance(exc, OSError) and exc.errno == errno.ENOSPC


def _droppable(tier: LocalTier, steps: list[int], protected: set[int]) -> int | None:
    """The oldest of ``steps`` that can leave the tier (see :func:`make_room`)."""
    refs: set[int] = set()
    for s in steps:
        bases = tier.retention.bases_of(s)
        if bases is None:
            return None
        refs.update(bases)
    return next((s for s in steps if s not in protected and s not in refs
                 and tier.is_persisted(s)), None)


def tier_full_error(tier: LocalTier, step: int, exc: BaseException) -> BaseException:
    """``exc``, or, when it is a lack of room (ENOSPC), an error that says the local
    tier is full, naming it, its free space, ``step`` and what could leave it."""
    if not isinstance(exc, OSError) or not _is_full(exc):
        return exc
    free = free_bytes(tier.root)
    try:
        could = _all_droppable(tier, tier.pending_steps())
    except OSError:
        could = []
    why = (f"this save needed more room than the newest local step takes (the room made "
           f"before a save); the persisted local steps {could} could leave it" if could
           else "it holds no persisted step that can leave it (the others wait to be "
           "persisted, or a kept step refers to them)")
    return storage_error(
        f"saving step {step} failed: the local tier {tier.root} is full "
        f"({'unknown' if free is None else free} bytes free); {why}; give it more room "
        f"or keep fewer steps there ({exc})", exc)


def _all_droppable(tier: LocalTier, protected: set[int]) -> list[int]:
    """What :func:`make_room` would drop if it needed all the room it could get."""
    steps, out = tier.steps(), []
    while (s := _droppable(tier, [s for s in steps if s not in out], protected)) is not None:
        out.append(s)
    return sorted(out)
