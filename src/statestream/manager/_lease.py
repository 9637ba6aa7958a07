"""The manager's hold on its directory: a storage lease, renewed in the background,
and its release at the end of a ``with`` block (:func:`close_after`)."""

from __future__ import annotations

import atexit
import dataclasses
import errno
import os
import threading
import time
import warnings
import weakref
from collections.abc import Callable

from statestream.distributed import Collective, agree, forget_left, note_left
from statestream.distributed._base import seconds_option
from statestream.errors import CheckpointError, ManagerLockedError, StorageError, storage_error
from statestream.manager._steps import StepDirectory
from statestream.storage import Lease, LocalStorage, Storage

__all__ = ["DirectoryHold", "DirectoryLease", "LeaseNotRenewedError", "OpenedLease",
           "close_after", "holder_name", "open_lease", "release_after_failed_open", "take_lease",
           "warn_deferred"]

#: OS errors that mean "this location cannot be written": open read-only instead.
_READ_ONLY_ERRNOS = frozenset({errno.EROFS, errno.EACCES, errno.EPERM})
#: How long interpreter exit waits for a renewal in flight.
EXIT_JOIN_S = 10.0
#: A save commits only under a lease a renewal confirmed within this part of its ttl.
COMMIT_WITHIN = 0.5

_HELD: weakref.WeakSet[DirectoryLease] = weakref.WeakSet()


class LeaseNotRenewedError(StorageError):
    """A manager's lease on an object store was not renewed for longer than its ttl
    (the store did not answer): another manager may hold the directory now."""


def _how_long(since: float, ttl_s: float) -> str:
    """Why a lease not renewed for ``since`` seconds may not be written under."""
    if since > ttl_s:
        return (f"longer than its ttl ({ttl_s:g} s), so another manager may hold the "
                "directory by now")
    return (f"over half its ttl ({ttl_s:g} s), so another manager could take the directory "
            "over before a commit of this one reached the store")


def holder_name() -> str:
    return f"pid {os.getpid()} on {os.uname().nodename}"


class DirectoryLease:
    """Takes the lease ``path`` of ``directory``, or records why it is read-only.

    A lease with a ttl is renewed every ``ttl_s / 3`` seconds by a daemon
    thread; if a renewal finds it taken over, :meth:`check` raises. So does a
    check when no renewal has gone through for longer than the ttl (the store
    did not answer): another manager may have taken the directory over by then,
    so the check renews first, and raises unless that goes through.

    Raises:
        ManagerLockedError: another manager holds the directory.
    """

    def __init__(self, storage: Storage, directory: str, path: str, ttl_s: float) -> None:
        self.directory = directory
        #: Why the directory is read-only (None: we hold the lease).
        self.read_only: str | None = None
        self._read_only_errno: int | None = None
        self._lease: Lease | None = None
        self._lost: BaseException | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        #: when the last renewal that went through (or the acquisition) began: the
        #: store's expiry of the lease is at least a ttl after it
        self._confirmed_at = time.monotonic()
        self._renewing = threading.Lock()  # one renewal at a time (thread or check)
        try:
            self._lease = storage.acquire_lease(path, holder=holder_name(), ttl_s=ttl_s)
        except ManagerLockedError as exc:
            raise ManagerLockedError(
                f"{directory} is already managed by another CheckpointManager ({exc}); close "
                "it first"
            ) from None
        except StorageError as exc:
            if exc.errno not in _READ_ONLY_ERRNOS:
                raise
            self.read_only = str(exc)
            self._read_only_errno = exc.errno
            return
        ttl = self._lease.ttl_s
        if ttl is not None:
            self._thread = threading.Thread(target=self._renew_loop, args=(ttl / 3,),
                                            name="statestream-lease", daemon=True)
            self._thread.start()
        _HELD.add(self)

    def _renew_loop(self, every: float) -> None:
        lease = self._lease
        assert lease is not None
        while not self._stop.wait(every):
            try:
                self._renew(lease)
            except ManagerLockedError as exc:
                self._lost = exc
                return
            except CheckpointError:
                continue  # a transient store failure: try again before the lease expires
            except Exception as exc:  # a bug, not the store: we can no longer vouch for it
                self._lost = exc
                return

    def _renew(self, lease: Lease) -> None:
        started = time.monotonic()
        with self._renewing:
            lease.renew()
        self._confirmed_at = max(self._confirmed_at, started)

    def check(self, *, confirm: bool = True, within: float = 1.0) -> None:
        """Raise unless this manager may write (holds a live lease).

        A lease without a ttl (an ``flock``) is checked here and now: its lock
        file must still be the one locked (not removed with its directory). One
        with a ttl that no renewal has confirmed for longer than ``within`` times
        the ttl is renewed here first (``confirm``; False: a save to a local tier,
        which must not wait for the store, checks only what is known). A save about
        to commit asks for half (:data:`COMMIT_WITHIN`): its commit then has at least half
        a ttl to reach the store before another manager could take the lease over.

        Raises:
            ManagerLockedError: the lease expired and another manager took it, or
                the lock file was removed.
            StorageError: the directory is read-only (``errno`` EROFS/EACCES), or
                the lease could not be renewed for longer than its ttl (another
                manager may hold it: nothing is written or deleted until a renewal
                goes through).
        """
        lease = self._lease
        if self._lost is None and lease is not None and (
                lease.ttl_s is None
                or confirm and time.monotonic() - self._confirmed_at > lease.ttl_s * within):
            since = time.monotonic() - self._confirmed_at
            try:
                self._renew(lease)
            except ManagerLockedError as exc:
                self._lost = exc
            except CheckpointError as exc:
                if lease.ttl_s is None:
                    raise
                raise LeaseNotRenewedError(
                    f"{self.directory}: this CheckpointManager could not renew its lease for "
                    f"{since:.0f} s, {_how_long(since, lease.ttl_s)}; it saves and deletes "
                    "nothing there until a renewal goes through (renewing now: "
                    f"{type(exc).__name__}: {exc})"
                ) from exc
        if self._lost is not None:
            raise ManagerLockedError(
                f"{self.directory}: this CheckpointManager lost its lease ({self._lost}); "
                "it saves and deletes nothing there any more (another manager may hold it)"
            ) from self._lost
        if self.read_only is not None:
            raise storage_error(
                f"{self.directory} is read-only for this CheckpointManager ({self.read_only}); "
                "it can list and load steps but not save or delete them", self._read_only_errno
            )

    def release(self, join_s: float | None = None) -> None:
        """Stop renewing and give the lease up (idempotent); ``join_s`` bounds the
        wait for a renewal in flight."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(join_s)
            self._thread = None
        lease, self._lease = self._lease, None
        # a lost lease object is someone else's now; a lost flock is only our fd
        if lease is not None and (self._lost is None or lease.ttl_s is None):
            lease.release()


@dataclasses.dataclass
class OpenedLease:
    """How a manager's directory opened, the same on every rank."""

    #: rank 0's lease (None on the other ranks, and when not taken)
    lease: DirectoryLease | None
    #: why the directory is read-only (None: it is not)
    read_only: str | None
    #: why the lease could not be taken yet (its store could not be reached): it is
    #: taken before the first persistence of a local tier (None: not deferred)
    deferred: str | None


def open_lease(coll: Collective, directory: StepDirectory, ttl_s: float, *,
               may_defer: bool) -> OpenedLease:
    """Rank 0 takes the lease of ``directory`` and cleans it up; every rank learns
    the outcome (collective).

    ``may_defer`` (a manager with a local tier): when an object store cannot be
    reached, the manager opens without the lease, so saves commit to the local
    tier during the outage; :func:`take_lease` takes it later. A lease held by
    another manager, or any other error, raises as always.

    Raises:
        ManagerLockedError: another manager holds the directory (on every rank).
        CheckpointError: opening failed (on every rank).
    """
    ttl_s = seconds_option(ttl_s, "lease_ttl_s")  # (-1 or NaN: a lease that never holds)
    forget_left(coll)  # this rank's record of leaving an earlier manager is stale now
    lease: DirectoryLease | None = None
    err: BaseException | None = None
    read_only: str | None = None
    deferred: str | None = None
    if coll.rank == 0:
        try:
            directory.refuse_checkpoint()
            lease = DirectoryLease(directory.storage, directory.directory,
                                   directory.lease_path(), ttl_s)
            read_only = lease.read_only
            if read_only is None:
                directory.remove_leftovers()
        except StorageError as exc:
            # only taking the lease itself is deferred (once it is held, the store was
            # there a moment ago: an error cleaning up is raised, as without a tier)
            if (may_defer and lease is None and not isinstance(exc, ManagerLockedError)
                    and not isinstance(directory.storage, LocalStorage)):
                deferred = f"{type(exc).__name__}: {exc}"
            else:
                err = exc
        except BaseException as exc:
            err = exc
    try:
        agree(coll, "opening the checkpoint manager", err)
    except BaseException:
        if lease is not None:
            lease.release()
        raise
    if coll.world_size > 1:
        read_only, deferred = coll.broadcast_object([read_only, deferred], src=0)
    return OpenedLease(lease, read_only, deferred)


def take_lease(directory: StepDirectory, ttl_s: float) -> DirectoryLease:
    """The lease of ``directory`` that :func:`open_lease` deferred, taken now (rank 0),
    and the directory cleaned up.

    Raises:
        ManagerLockedError: another manager holds the directory.
        StorageError: the store still cannot be reached, or the directory is read-only.
    """
    lease = DirectoryLease(directory.storage, directory.directory, directory.lease_path(),
                           ttl_s)
    try:
        lease.check()  # read-only: a StorageError carrying its errno
        directory.remove_leftovers()
    except BaseException:
        lease.release()
        raise
    return lease


class DirectoryHold:
    """A manager's hold on its directory, as this rank sees it: rank 0's lease (taken
    when the manager opened, or late: after an outage at open, before the first
    persistence of a local tier), why the directory is read-only, and a refusal
    that stands for good once a late lease found another manager holding it."""

    def __init__(self, directory: StepDirectory, opened: OpenedLease, ttl_s: float) -> None:
        self._dir = directory
        self._ttl_s = ttl_s
        #: rank 0's lease (None on the other ranks, and while not taken)
        self.lease = opened.lease
        #: why the directory is read-only (None: it is not)
        self.read_only = opened.read_only
        #: why another manager's lease keeps this one from the directory (a lease
        #: taken late, after an outage at open, found it held)
        self.refused: ManagerLockedError | None = None

    @property
    def deletes(self) -> bool:
        """Whether this process deletes from the directory: it holds the lease of a
        writable one (a read-only directory or a lost lease deletes nothing)."""
        return self.lease is not None and self.read_only is None

    def ensure(self) -> None:
        """Rank 0, on the persistence worker, before each persistence (agreed by the
        tier) and last before each of its copies commits: the lease taken, if the
        manager opened while its store could not be reached, and still held (renewed
        first unless a renewal confirmed it within half its ttl: a persistence never
        writes, nor commits, where another manager may; see :meth:`check_to_commit`)."""
        if self.lease is None:
            if self.refused is not None:  # refused once: never again (as a lost lease)
                raise self.refused
            try:
                self.lease = take_lease(self._dir, self._ttl_s)
            except ManagerLockedError as exc:
                self.refused = exc  # the next save raises it on every rank
                raise
        self.lease.check(within=COMMIT_WITHIN)

    def check_to_commit(self) -> None:
        """Rank 0, as a save to the directory is about to commit (``before_commit``):
        raise unless the lease is still held, renewed first unless a renewal confirmed
        it within half its ttl (no store request then: renewals run every third).
        A manager whose renewals failed (dropped, or the process paused) for so long
        that another manager may have taken the directory over, and removed this
        save's staged data as a leftover, must not commit it there: until 2026-12-08
        it wrote its marker, and the other manager listed a step whose manifest was
        gone."""
        if self.lease is not None:
            self.lease.check(within=COMMIT_WITHIN)
        else:
            self.check_writable()

    def check_writable(self, *, confirm: bool = True) -> None:
        """Raise unless rank 0 still holds the lease (rank 0 alone decides); without
        ``confirm`` (a local tier's save) it does not wait for the store."""
        if self.refused is not None:
            raise ManagerLockedError(
                f"{self._dir.directory} is managed by another CheckpointManager, found "
                f"when this one took the directory's lease after the store came back "
                f"({self.refused}); it saves and deletes nothing any more; its steps since "
                "stay in its local tier") from self.refused
        if self.lease is not None:
            self.lease.check(confirm=confirm)
        elif self.read_only is not None:  # another rank's view: rank 0 found it read-only
            raise CheckpointError(f"{self._dir.directory} is read-only: {self.read_only}")

    def release(self) -> None:
        """Give the lease up (nothing without one)."""
        if self.lease is not None:
            self.lease.release()


def release_after_failed_open(hold: DirectoryHold,
                              close_tier: Callable[[], None] | None) -> None:
    """Give up what a manager whose open failed took: its local tier (``close_tier``:
    its persistence thread and lease), then the directory's lease.
    Until 2026-12-07 a failure after the lease was taken (listing the steps: a store
    error, a keep policy that raised) left the directory locked by the half-opened
    manager, renewed for as long as the process ran on an object store: a retry in the
    same process was refused with ManagerLockedError naming its own pid."""
    try:
        if close_tier is not None:
            close_tier()
    finally:
        hold.release()


def release_at_close(hold: DirectoryHold, close_tier: Callable[[], None] | None) -> None:
    """Give up what a closing manager holds: the directory's lease, then its local
    tier (``close_tier``: its persistence thread and lease). ``CheckpointManager.close``
    calls it only once no save of the manager still runs (a Ctrl-C that ended its wait
    for one leaves the manager open: until 2026-12-07 the directory was released while
    the save wrote there, and a second manager could open it mid-save)."""
    hold.release()
    if close_tier is not None:
        close_tier()


def warn_deferred(directory: str, local_tier: str, why: str) -> None:
    """Warn (on every rank) that a manager opened without its directory's lease."""
    warnings.warn(
        f"{directory} cannot be reached ({why}): the CheckpointManager opens without its "
        f"lease. Saves commit to the local tier {local_tier} and are persisted once the "
        "store is back; the lease is taken first (should another manager hold it by "
        "then, saves raise ManagerLockedError)", RuntimeWarning, stacklevel=3)


def close_after(close: Callable[[], None], error: BaseException | None,
                coll: Collective | None = None, directory: str = "") -> None:
    """``close()`` at the end of a manager's ``with`` block; after ``error`` (raised in
    the block) a failure of the close does not replace it: ``error`` is raised as it
    was, with the close's failure in its notes (Python 3.10: warned about).

    A block that raised on one rank alone leaves that rank's close waiting, until
    the collective's timeout, in collectives the other ranks never enter: the
    timeout is a consequence, the block's error the cause. So first the rank
    records in ``coll``'s store that it left and why (``note_left``): the other
    ranks' collectives that fail name it. Nothing aborts early on it: the rank's
    close still runs its collectives (every rank may have left alike, e.g. Ctrl-C,
    and an async save in flight still commits).
    """
    if error is None:
        close()
        return
    if coll is not None:
        note_left(coll, error, f"its with CheckpointManager({directory!r}) block")
    try:
        close()
    except Exception as exc:  # noqa: BLE001 - reported with the error that caused it
        note = (f"closing the CheckpointManager after this error failed too: "
                f"{type(exc).__name__}: {exc}")
        add_note = getattr(error, "add_note", None)
        if add_note is not None:
            add_note(note)
        else:  # pragma: no cover - Python 3.10
            warnings.warn(note, RuntimeWarning, stacklevel=3)


def _release_at_exit() -> None:
    """Give up the leases of managers never closed when the interpreter exits normally.

    Registered when this module is imported, so it runs after the exit drains of
    saves and persistence (registered later; atexit runs last-in first-out). The
    renewal thread is stopped first: a daemon thread inside the object store's
    client while the interpreter finalizes can abort the process. A ttl lease
    left behind would lock the directory out until it expires (60 s by default)
    for the next run; a crashed process still leaves it to expire.
    """
    for lease in list(_HELD):
        try:
            lease.release(EXIT_JOIN_S)
        except Exception:  # noqa: BLE001 - best effort: the ttl ends it anyway
            pass


atexit.register(_release_at_exit)


def _forget_in_child() -> None:
    """After ``fork()``: the leases are the parent's, not the child's to give up. A plain
    child that ended normally ran :func:`_release_at_exit` on them: on an object store it
    hung at exit (the store's client does not survive a fork), or deleted the parent's
    lease object, so another manager could take the directory while the parent wrote."""
    _HELD.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)
