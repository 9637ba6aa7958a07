"""Local storage: the ``flock`` lease and the names of staging directories."""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import time
import uuid

from statestream.errors import ManagerLockedError, storage_error
from statestream.format import DATA_DIR
from statestream.storage._leftovers import this_writer

#: Staging directories: ``.<name>.tmp-<12 hex>[-w<host>-<pid>-<start>][.old]``.
_STAGING_RE = re.compile(
    r"^\.(?P<target>.+)\.tmp-[0-9a-f]{12}"
    r"(?:-w(?P<host>[0-9a-f]{16})-(?P<pid>[0-9]{1,10})-(?P<start>[0-9]{1,20}))?(?:\.old)?$"
)


def _staging_name(name: str) -> str:
    """A fresh staging directory name for checkpoint ``name``, recording its writer."""
    w = this_writer()
    tag = f"-w{w.host}-{w.pid}-{w.start}" if w is not None else ""
    return f".{name}.tmp-{uuid.uuid4().hex[:12]}{tag}"


def staging_dir(final: str) -> str:
    """Make a fresh staging directory beside the local path ``final`` and return it.

    For writers outside the save transaction (``convert`` to other formats): it
    is made as any directory is (mode from the umask, so a directory published
    from it reads like one ``mkdir`` made) and named as a save's staging area
    recording its writer, so ``leftovers`` lists it and ``collect_garbage``
    (``statestream gc``) removes it once its writer is provably dead.

    Example:
        >>> import tempfile, os
        >>> d = staging_dir(os.path.join(tempfile.mkdtemp(), "model.safetensors"))
        >>> os.path.basename(d).startswith(".model.safetensors.tmp-")
        True
    """
    parent, name = os.path.split(os.path.abspath(final))
    path = os.path.join(parent, _staging_name(name))
    os.mkdir(path)
    return path


def _last_change(path: str) -> float | None:
    """Newest mtime of a staging dir, its entries and its data files (None if gone)."""
    try:
        newest = os.lstat(path).st_mtime
        for sub in (path, os.path.join(path, DATA_DIR)):
            with contextlib.suppress(FileNotFoundError, NotADirectoryError), os.scandir(sub) as it:
                for e in it:
                    newest = max(newest, e.stat(follow_symlinks=False).st_mtime)
    except FileNotFoundError:
        return None
    return newest


#: The fds of this process's held locks (see :func:`_forget_in_child`).
_HELD_FDS: set[int] = set()


def _forget_in_child() -> None:
    """In a forked child: close the copies of the parent's lock fds.

    ``fork`` copies every fd, and a copy shares the lock (an ``flock`` belongs to
    the open file description): a child forked while a manager ran (a DataLoader
    worker, any ``multiprocessing`` "fork" process) kept the directory locked after
    the manager's ``close()``, and after its process died. The child does not hold
    the lock; its copies of the manager's leases know that by their pid.
    """
    for fd in list(_HELD_FDS):
        with contextlib.suppress(OSError):
            os.close(fd)
    _HELD_FDS.clear()


os.register_at_fork(after_in_child=_forget_in_child)


class _LocalLease:
    """A lease by ``flock``: the kernel ends it when the holder dies, so it needs no ttl.

    The lock holds only while ``path`` still names the locked file: once the
    file (or its directory) is removed or replaced, another manager locks a new
    file there. :meth:`renew` checks that. A child forked while it is held does
    not hold it (:func:`_forget_in_child`).
    """

    ttl_s: float | None = None

    def __init__(self, fd: int, holder: str, path: str) -> None:
        self._fd = fd
        self._pid = os.getpid()
        self.holder = holder
        self.path = path

    def renew(self) -> None:
        """Raise ManagerLockedError if ``path`` is no longer the file this lease locked."""
        if self._fd < 0:
            return
        if os.getpid() != self._pid:
            raise ManagerLockedError(
                f"the lock {self.path} is held by the process this one was forked from "
                f"(pid {self._pid}), not by this one")
        held = os.fstat(self._fd)
        try:
            now = os.stat(self.path)
        except OSError as exc:
            raise ManagerLockedError(
                f"the lock {self.path} is gone ({exc.strerror}): its directory was removed "
                "or moved while this manager held it") from None
        if (now.st_dev, now.st_ino) != (held.st_dev, held.st_ino):
            raise ManagerLockedError(
                f"the lock {self.path} was replaced (its directory was removed or moved "
                "while this manager held it); another manager may hold the new one")

    def release(self) -> None:
        """Unlock, then close: the unlock frees the lock even where a copy of the fd
        lives on (one made by a fork, before :func:`_forget_in_child` runs)."""
        if self._fd < 0 or os.getpid() != self._pid:
            return  # released, or a forked child's copy: its fd was closed at the fork
        with contextlib.suppress(OSError):
            os.ftruncate(self._fd, 0)  # no stale name for the next holder's refusals
        with contextlib.suppress(OSError):
            fcntl.flock(self._fd, fcntl.LOCK_UN)
        _HELD_FDS.discard(self._fd)
        os.close(self._fd)
        self._fd = -1


#: How often a refused opener reads a lock file found empty (see :func:`_holder_of`).
_NAME_TRIES = 50


def _pause() -> None:
    time.sleep(0.01)


def _holder_of(fd: int) -> str:
    """The holder's name in the lock file ``fd``.

    A holder writes its name right after it locks, and a released lock is left
    empty: an opener refused in between finds the file empty, and reads it again
    (for up to half a second) rather than report "an unknown process".
    """
    for _ in range(_NAME_TRIES):
        name = os.pread(fd, 200, 0).decode(errors="replace").strip()
        if name:
            return name
        _pause()
    return "an unknown process"


def _lock_file(path: str, holder: str) -> _LocalLease:
    try:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError as exc:
        raise storage_error(f"cannot create the lock {path}: {exc}", exc) from exc
    _HELD_FDS.add(fd)  # before the lock: a fork meanwhile must not keep it
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        _HELD_FDS.discard(fd)
        try:
            owner = _holder_of(fd)
        finally:
            os.close(fd)
        raise ManagerLockedError(
            f"{path} is held by {owner} (a local lock: it ends when its holder's process "
            "ends, however it ends, so that process is still running)") from None
    except OSError as exc:
        _HELD_FDS.discard(fd)
        os.close(fd)
        raise storage_error(f"cannot lock {path}: {exc}", exc) from exc
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, holder.encode(), 0)
    except OSError as exc:
        _HELD_FDS.discard(fd)
        os.close(fd)
        raise storage_error(f"cannot write the lock {path}: {exc}", exc) from exc
    return _LocalLease(fd, holder, path)
