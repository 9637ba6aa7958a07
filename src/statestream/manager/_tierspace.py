"""Room in a full local tier: persisted local copies leave before a save that
would not fit (docs/manager.md, "The local tier").

A local tier sized for fewer steps than its keep policy keeps plus one new step
failed every save with ENOSPC, although the steps it would have had to drop were
persisted (the directory holds them). Before each save, a node's leader (on the
path where the tier applies its keep policy) drops the oldest persisted local
copies until the tier has room for the next save (:func:`next_save_bytes`); a save
that fails for lack of room anyway says the tier is full.

A tier sized for its keep policy's steps but not one more drops a copy before every
save: that is warned once when it starts, and again only when it gets worse (the
tier holds fewer steps with the next save than when it last warned) or starts again
after the tier had room for two saves; otherwise it is logged at debug level
(:class:`TierRoom`).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import sys
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING

from statestream.distributed import agree, gather_each
from statestream.engine import SaveHandle, TaskHandle
from statestream.errors import DistributedError, StorageError, storage_error

if TYPE_CHECKING:
    from statestream.distributed import Collective
    from statestream.manager._tier import LocalTier

__all__ = ["CATCH_UP_WAIT_S", "TierRoom", "copy_bytes", "fetch_shortage", "free_bytes",
           "lacks_room", "make_room", "next_save_bytes", "persist_waiting", "raise_if_full",
           "retry_together", "retry_when_full", "room_before_async", "started", "tier_full_error",
           "went_through", "write_making_room"]

#: room asked past the estimate of the next save (the manifest, the markers, the records)
_MARGIN = 64 * 1024

#: how long a save that does not fit waits for the local steps waiting to be persisted
#: (:func:`persist_waiting`): a store that hangs fails that save once this has passed
CATCH_UP_WAIT_S = 60.0

_log = logging.getLogger("statestream.manager")


class TierRoom:
    """What a node's leader last said about its local tier running short of room.

    ``warned``: how many steps the tier held with the next save (the steps left
    after making room, plus that save) when it last warned; None once the tier had
    room for the next save and as much again (or it never ran short). A shortage
    warns when it starts and when the tier holds fewer steps than that; otherwise
    it is logged at debug level.
    """

    def __init__(self) -> None:
        self.warned: int | None = None

    def had_room(self, root: str, free: int, need: int) -> None:
        """A check found ``free`` bytes, ``need`` for the next save: once that is
        room for it and as much again, a later shortage warns again. (Room for the
        next save alone is what making room leaves, and what a step whose files are
        still coming, a peer's with ``replicate_to_peers``, seems to leave.)"""
        if self.warned is not None and free >= 2 * need:
            _log.debug("the local tier %s has room again (%d bytes free)", root, free)
            self.warned = None

    def report(self, message: str, held: int) -> None:
        """Warn ``message`` when the shortage starts or gets worse (``held``: the steps
        the tier holds with the next save); log it at debug level otherwise."""
        if self.warned is not None and held >= self.warned:
            _log.debug("%s", message)
            return
        self.warned = held
        warnings.warn(f"{message} (warned once while this lasts, and again if the tier "
                      "holds fewer steps; logged at debug level, logger "
                      "'statestream.manager', otherwise)", RuntimeWarning, stacklevel=7)


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


def _kind(tier: LocalTier, step: int) -> bool:
    """Whether ``step`` refers to other steps (an incremental save); unreadable: False."""
    return bool(tier.retention.bases_of(step))


def next_save_bytes(tier: LocalTier, steps: list[int]) -> int:
    """The room the next save is expected to take in the tier holding ``steps``: the
    largest of them (a full save after incremental ones takes what the last full one
    did), plus what the newest grew by over the step before it of the same kind (full
    or incremental: a state that grows keeps growing), plus a margin."""
    sizes = {s: _disk_bytes(tier.path(s)) for s in steps}
    newest = steps[-1]
    kind = _kind(tier, newest)
    before = next((s for s in reversed(steps[:-1]) if _kind(tier, s) == kind), None)
    growth = 0 if before is None else max(0, sizes[newest] - sizes[before])
    return max(sizes.values()) + growth + _MARGIN


def fetch_shortage(tier: LocalTier, sizes: dict[int, int]) -> str | None:
    """Why a copy of steps of ``sizes`` bytes (each step's files that the copy takes)
    into the tier would leave it without room for the next save, or None: it has
    room for them and for the next save as it is expected to be once they are there
    (:func:`next_save_bytes`, at least the largest of them plus the margin: the
    next save is like the step loaded). A copy that takes that room would make the
    next save drop persisted steps, or fail (a resume's copy of the step it loaded,
    made so the next save can refer to it, is not worth that). Local disk only."""
    free = free_bytes(tier.root)
    if free is None or not sizes:
        return None
    steps = tier.steps()
    after = max(max(sizes.values()) + _MARGIN, next_save_bytes(tier, steps) if steps else 0)
    need = sum(sizes.values()) + after
    if free >= need:
        return None
    return (f"the local tier {tier.root} has {free} bytes free, less than the copy takes "
            f"({sum(sizes.values())} bytes) plus what the next save is expected to take "
            f"(about {after} bytes)")


def copy_bytes(files: list[tuple[str, int]], take: Callable[[str], bool] | None) -> int:
    """The disk a copy of ``files`` (name, size) takes, those ``take`` selects (None:
    all), each rounded up to a 4 KiB block."""
    return sum(-(-size // 4096) * 4096 for name, size in files if take is None or take(name))


def make_room(tier: LocalTier, protected: set[int], failed: int | None = None) -> list[int]:
    """Drop the oldest persisted local steps while the tier has less room than the
    next save is expected to take (:func:`next_save_bytes`); returns the steps
    dropped, oldest first. ``failed``: a save of that step just failed for lack of
    room: every step that can leave does.

    Never dropped: a step not recorded as persisted, a ``protected`` one (being
    persisted, the base of a queued save), a step a step still in the tier refers
    to (an incremental base), and nothing at all while a step's manifest cannot be
    read (what it refers to is unknown). Local disk only (the leader).

    Warns:
        RuntimeWarning: naming the steps dropped, the room there was and why, when
            the tier starts running short or holds fewer steps than when it last
            warned (:class:`TierRoom`; logged at debug level otherwise).
    """
    steps = tier.steps()
    free = free_bytes(tier.root)
    if not steps or free is None:
        return []
    need = sys.maxsize if failed is not None else next_save_bytes(tier, steps)
    if free >= need:
        tier.room.had_room(tier.root, free, need)
        return []
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
        _report(tier, steps, dropped, had, need, failed)
    return dropped


def _report(tier: LocalTier, steps: list[int], dropped: list[int], had: int, need: int,
            failed: int | None) -> None:
    """Warn (or log, :class:`TierRoom`) that ``dropped`` left the tier to make room."""
    held = len(steps) - len(dropped) + 1  # with the next save
    why = (f"less than the next save is expected to take (about {need} bytes: the largest "
           "local step, plus what the newest grew by)" if failed is None
           else f"and the save of step {failed} did not fit")
    was = tier.room.warned
    fewer = (f"; with the next save it holds {held} step(s), fewer than the {was} it held "
             "when this was last warned" if was is not None and held < was
             else f"; with the next save it holds {held} step(s)")
    tier.room.report(
        f"the local tier {tier.root} had {had} bytes free, {why}: the persisted local "
        f"steps {dropped} were removed from it to make room (they load from "
        f"{tier.persistent.directory} while its keep policy keeps them){fewer}; give the "
        "local tier more room or keep fewer steps there (local_keep_policy)", held)


def write_making_room(tier: LocalTier | None, coll: Collective, step: int,
                      base: int | None, agreed: bool, write: Callable[[], None]) -> None:
    """``write()`` (a save of ``step`` against ``base``), tried once more in a full
    local ``tier``: :func:`retry_when_full` with one process; with several, when
    ``agreed`` (a synchronous save: a failed ``write`` raises on every process
    together), :func:`retry_together`. Otherwise a failure that was a lack of room
    in this process's tier raises as a full tier's error (:func:`raise_if_full`).

    An asynchronous save with one process, whose write may fail in the background
    (not tried again), first makes room as :func:`room_before_async` says."""
    if tier is not None and not agreed and coll.world_size == 1:
        room_before_async(tier, step, base)
    try:
        write()
    except (StorageError, DistributedError) as exc:
        if tier is None:
            raise
        if coll.world_size == 1:
            return retry_when_full(tier, coll, step, exc, base, write)
        if agreed and getattr(exc, "failed_types", None) is not None:
            return retry_together(tier, coll, step, exc, base, write)
        raise_if_full(tier, step, exc)
        raise


def started(coll: Collective, path: str, start: Callable[[], SaveHandle]) -> SaveHandle:
    """``start()`` (a ``save_async`` to ``path``), agreed: with several processes one
    process's ``save_async`` may fail (its snapshot's write failed: the engine
    agrees on that in the background) while the others' return, their saves failing
    later; raised there alone, that process's next collective would meet another
    one. Every process says whether its own failed (one all-reduce when none did);
    if one did, those whose save started wait for it to end and every process
    raises, here.

    Raises:
        DistributedError: on every process, naming the ranks whose ``save_async``
            failed (chained, on those, to their own error).
    """
    if coll.world_size == 1:
        return start()
    handle: SaveHandle | None = None
    err: BaseException | None = None
    try:
        handle = start()
    except Exception as exc:  # noqa: BLE001 - agreed just below, raised on every rank
        err = exc
    try:
        agree(coll, f"starting the save to {path}", err, outcome="nothing was saved",
              check_as=f"starting the save of {path.rstrip('/').rsplit('/', 1)[-1]}")
    except DistributedError:
        if handle is not None:
            with contextlib.suppress(Exception):
                handle.result()  # it fails too (the failed rank agreed on it): seen here
        raise
    assert handle is not None
    return handle


def went_through(save: SaveHandle) -> bool:
    """Whether ``save`` committed (waited for; a failure is its own handle's to report)."""
    return _error_of(save) is None


def persist_waiting(tier: LocalTier, step: int) -> BaseException | None:
    """Persist the local steps that wait to be persisted now, so that the save of
    ``step``, which did not fit, finds persisted steps to drop: a catch-up queued on
    the persistence worker behind the persistence running there (every process
    queues one: they copy together), waited for at most :data:`CATCH_UP_WAIT_S`.
    Returns why it did not go through (its error, or that it is still running: it goes
    on in the background), None if it did. A Ctrl-C interrupts the wait (raised)."""
    h = tier.catch_up_now(f" to make room for step {step}")
    try:
        h.result(CATCH_UP_WAIT_S)
    except BaseException as exc:
        if h.done():
            return _error_of(h)
        if not isinstance(exc, TimeoutError):
            raise  # interrupted: the catch-up goes on in the background
        return TimeoutError(f"{h.what} was still running after {CATCH_UP_WAIT_S:g} s (it goes "
                            "on in the background)")
    return None


def room_before_async(tier: LocalTier, step: int, base: int | None) -> None:
    """Before the asynchronous save of ``step`` (one process): when the room made
    before it (:func:`make_room`) is still less than the save is expected to take and
    local steps wait to be persisted, or are being persisted, they are persisted
    first (:func:`persist_waiting`, the store may be back; a persistence of the step
    before may still be running), and then leave. A write that fails in the background
    is not tried again. Nothing is raised here: the save then fits, or fails as the
    full tier's error."""
    steps = tier.steps()
    free = free_bytes(tier.root)
    if not steps or free is None or free >= next_save_bytes(tier, steps):
        return
    if (tier.unpersisted() or tier.pending_steps()) and persist_waiting(tier, step) is None:
        make_room(tier, _kept(tier, base))


def _error_of(h: TaskHandle | SaveHandle) -> BaseException | None:
    """What ``h`` failed with (waited for), None if it went through."""
    try:
        h.result()
    except BaseException as exc:
        return exc
    return None


def _room_for(tier: LocalTier, step: int, base: int | None) -> list[int]:
    """:func:`make_room` after the save of ``step`` against ``base`` failed for room."""
    return make_room(tier, _kept(tier, base), failed=step)


def _kept(tier: LocalTier, base: int | None) -> set[int]:
    """The local steps no room is made by dropping: those being persisted, and ``base``."""
    return tier.pending_steps() | ({base} if base is not None else set())


def retry_when_full(tier: LocalTier, coll: Collective, step: int, exc: BaseException,
                    base: int | None, write: Callable[[], None]) -> None:
    """After ``write`` (a save of ``step`` against ``base``) failed with ``exc``: when
    that was a lack of room in a single process's tier, every persisted local step
    that can leave (:func:`make_room`; not ``base``, nor a step being persisted)
    does, and ``write`` is tried once more. When none can leave but local steps wait
    to be persisted, or are being persisted, they are persisted first
    (:func:`persist_waiting`) and then leave. Raises ``exc`` otherwise (as a full
    tier's error, :func:`raise_if_full`, naming why they could not be persisted), or
    the retry's error."""
    why: BaseException | None = None
    if coll.world_size == 1 and _is_full(exc):
        room = _room_for(tier, step, base)
        if not room and (tier.unpersisted() or tier.pending_steps()):
            why = persist_waiting(tier, step)
            room = [] if why is not None else _room_for(tier, step, base)
        if room:
            try:
                return write()
            except StorageError as again:
                exc = again
    raise_if_full(tier, step, exc, why)
    raise exc


def retry_together(tier: LocalTier, coll: Collective, step: int, exc: BaseException,
                   base: int | None, write: Callable[[], None]) -> None:
    """After a synchronous save of ``step`` failed on every process with ``exc`` (an
    agreed ``DistributedError``): when a process's part did not fit in its node's
    local tier, the leader of each such node drops every persisted local step that
    can leave (:func:`make_room`), and if each of them dropped one, every process
    tries ``write`` once more, together. If one of them could drop none, every
    process first persists the local steps that wait to be persisted
    (:func:`persist_waiting`, together) and those leaders try again. Each decision is
    gathered from every process, so none waits alone in a collective.

    Raises:
        StorageError: (errno ENOSPC) on every process, naming each rank whose local
            tier is full and what could leave it (or why its waiting steps could not
            be persisted), when nothing could leave one of them or the save failed for
            room again.
        DistributedError: ``exc``, or the retry's error, when that was not a lack
            of room.
    """
    texts = _full_texts(tier, coll, step, exc)
    full = {tier.groups.leader(r) for r, t in enumerate(texts) if t is not None}
    if not full:
        raise exc
    why: BaseException | None = None
    dropped = _rooms(tier, coll, step, base, full, why)
    if not all(dropped[r] for r in full):  # every process, together: the catch-up is agreed
        why = persist_waiting(tier, step)
        dropped = _rooms(tier, coll, step, base, full, why)
    if all(dropped[r] for r in full):
        try:
            return write()
        except DistributedError as again:
            if getattr(again, "failed_types", None) is None:
                raise
            exc = again
        texts = _full_texts(tier, coll, step, exc)
        if all(t is None for t in texts):
            raise exc
    else:  # with why the steps that wait could not be persisted (agreed: on every process)
        texts = _full_texts(tier, coll, step, exc, why)
    named = "; ".join(f"rank {r}: {t}" for r, t in enumerate(texts) if t is not None)
    raise storage_error(f"{named}; step {step} was saved on no rank", errno.ENOSPC) from exc


def _rooms(tier: LocalTier, coll: Collective, step: int, base: int | None, full: set[int],
           why: BaseException | None) -> list[list[int]]:
    """What the leader of each ``full`` node dropped to make room (:func:`make_room`;
    nothing where persisting its waiting steps failed: ``why``), gathered."""
    return gather_each(
        coll, f"making room for step {step} in the full local tiers",
        lambda: _room_for(tier, step, base) if coll.rank in full and why is None else [],
        outcome=f"step {step} was not saved")


def _full_texts(tier: LocalTier, coll: Collective, step: int, exc: BaseException,
                why: BaseException | None = None) -> list[str | None]:
    """Every process's full tier error (:func:`tier_full_error`) as text, None where
    ``exc`` was not a lack of room in its node's local tier."""

    def mine() -> str | None:
        full = tier_full_error(tier, step, exc, why)
        return None if full is exc else str(full)

    return gather_each(coll, f"finding which local tiers step {step} did not fit in", mine,
                       outcome=f"step {step} was not saved")


def raise_if_full(tier: LocalTier, step: int, exc: BaseException,
                  why: BaseException | None = None) -> None:
    """Raise a full tier's error (:func:`tier_full_error`) if ``exc`` is one."""
    full = tier_full_error(tier, step, exc, why)
    if full is not exc:
        raise full from exc


def lacks_room(exc: BaseException) -> bool:
    """``exc`` is a lack of room (ENOSPC), or was raised from one (an agreed
    ``DistributedError`` on the process that had it)."""
    return _enospc(exc) is not None


_is_full = lacks_room


def _enospc(exc: BaseException | None) -> OSError | None:
    """The lack of room (ENOSPC) ``exc`` is, or was raised from (an agreed
    ``DistributedError`` on the process that had it); None if neither."""
    for _ in range(8):
        if exc is None:
            return None
        if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
            return exc
        exc = exc.__cause__
    return None


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


def tier_full_error(tier: LocalTier, step: int, exc: BaseException,
                    failed: BaseException | None = None) -> BaseException:
    """``exc``, or, when it is a lack of room (ENOSPC), an error that says the local
    tier is full, naming it, its free space, ``step`` and what could leave it
    (also when ``exc`` was raised from one: an agreed ``DistributedError``), or why
    the steps waiting to be persisted could not be (``failed``: that persistence's
    error, :func:`persist_waiting`)."""
    cause = _enospc(exc)
    if cause is None:
        return exc
    free = free_bytes(tier.root)
    try:
        could = _all_droppable(tier, tier.pending_steps())
        waiting = tier.unpersisted()
    except OSError:
        could, waiting = [], []
    why = (f"this save needed more room than was made before it (the largest local step "
           f"and the newest one's growth); the persisted local steps {could} could leave it"
           if could else _none_can_leave(waiting, failed))
    return storage_error(
        f"saving step {step} failed: the local tier {tier.root} is full "
        f"({'unknown' if free is None else free} bytes free); {why}; give it more room "
        f"or keep fewer steps there ({exc})", cause)


def _none_can_leave(waiting: list[int], failed: BaseException | None) -> str:
    """Why no local step can leave a full tier (``waiting``: those not persisted)."""
    if failed is not None:
        return (f"it holds no persisted step that can leave it, and persisting the local "
                f"steps that wait to be ({waiting}) to make room failed ({failed}; they are "
                "tried again with each save, and by wait() and close())")
    if waiting:
        return (f"it holds no persisted step that can leave it (the steps {waiting} wait to "
                "be persisted, in the background; or a kept step refers to the others)")
    return "it holds no persisted step that can leave it (a kept step refers to each)"


def _all_droppable(tier: LocalTier, protected: set[int]) -> list[int]:
    """What :func:`make_room` would drop if it needed all the room it could get."""
    steps, out = tier.steps(), []
    while (s := _droppable(tier, [s for s in steps if s not in out], protected)) is not None:
        out.append(s)
    return sorted(out)
