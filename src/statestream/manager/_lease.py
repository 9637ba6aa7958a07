"""The manager's hold on its directory: a storage lease, renewed in the background."""

from __future__ import annotations

import atexit
import errno
import os
import threading
import weakref

from statestream.errors import CheckpointError, ManagerLockedError, StorageError, storage_error
from statestream.storage import Lease, Storage

__all__ = ["DirectoryLease", "holder_name"]

#: OS errors that mean "this location cannot be written": open read-only instead.
_READ_ONLY_ERRNOS = frozenset({errno.EROFS, errno.EACCES, errno.EPERM})
#: How long interpreter exit waits for a renewal in flight.
EXIT_JOIN_S = 10.0

_HELD: weakref.WeakSet[DirectoryLease] = weakref.WeakSet()


def holder_name() -> str:
    return f"pid {os.getpid()} on {os.uname().nodename}"


class DirectoryLease:
    """Takes the lease ``path`` of ``directory``, or records why it is read-only.

    A lease with a ttl is renewed every ``ttl_s / 3`` seconds by a daemon
    thread; if a renewal finds it taken over, :meth:`check` raises.

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
        try:
            self._lease = storage.acquire_lease(path, holder=holder_name(), ttl_s=ttl_s)
        except ManagerLockedError as exc:
            raise ManagerLockedError(
                f"{directory} is already managed by another CheckpointManager ({exc}); close "
                "it first, or wait until its lease expires if it crashed"
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
                lease.renew()
            except ManagerLockedError as exc:
                self._lost = exc
                return
            except CheckpointError:
                continue  # a transient store failure: try again before the lease expires
            except Exception as exc:  # a bug, not the store: we can no longer vouch for it
                self._lost = exc
                return

    def check(self) -> None:
        """Raise unless this manager may write (holds a live lease).

        A lease without a ttl (an ``flock``) is checked here and now: its lock
        file must still be the one locked (not removed with its directory).

        Raises:
            ManagerLockedError: the lease expired and another manager took it, or
                the lock file was removed.
            StorageError: the directory is read-only (``errno`` EROFS/EACCES).
        """
        if self._lost is None and self._lease is not None and self._lease.ttl_s is None:
            try:
                self._lease.renew()
            except ManagerLockedError as exc:
                self._lost = exc
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
