"""Leftovers of killed saves: who wrote a staging area, and whether it is provably dead.

A staging area records its writer (:class:`WriterId`: host, pid, process start
time). It is garbage when that writer is provably dead: same host (same kernel
boot and PID namespace), and no process with that pid and start time exists.
A live writer's staging area is never removed; one whose writer cannot be
checked (another host, an older statestream that recorded no writer) only once
nothing in it changed for ``max_age_s`` (default 24 hours).
"""

from __future__ import annotations

import functools
import hashlib
import math
import numbers
import os
import time
from collections.abc import Callable

from statestream.errors import (
    CheckpointError,
    InvalidOptionError,
    InvalidOptionTypeError,
    storage_error,
)
from statestream.storage._base import LeftoverKeptError, Storage, WriterId

__all__ = ["DEFAULT_MAX_AGE_S", "collect_garbage", "sweep", "sweep_error", "this_writer",
           "writer_alive"]

#: Staging areas whose writer cannot be checked are removed after this long unchanged.
DEFAULT_MAX_AGE_S = 24 * 3600.0


@functools.lru_cache(maxsize=1)
def _host_id() -> str | None:
    """This kernel boot as seen from this PID namespace (16 hex digits); None if unknown."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        pid_ns = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return None  # pids could not be told apart from another namespace's: prove nothing
    text = f"{os.uname().nodename}\0{boot}\0{pid_ns}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]


@functools.lru_cache(maxsize=1)
def _proc_hides_pids() -> bool:
    """/proc mounted with ``hidepid``: others' processes may look dead to a non-root user."""
    try:
        with open("/proc/self/mountinfo") as f:
            lines = f.read().splitlines()
    except OSError:  # cannot tell: assume hidden pids, so no writer is declared dead
        return True
    for line in lines:
        fields = line.split()
        if len(fields) > 4 and fields[4] == "/proc" and " - proc " in line:
            opts = line.rsplit(" ", 1)[-1]
            return any(o.startswith("hidepid=") and o not in ("hidepid=0", "hidepid=off")
                       for o in opts.split(","))
    return True


def _start_time(pid: int) -> int | None:
    """Start time of ``pid`` in clock ticks since boot; None if no such live process,
    -1 if it exists but cannot be read."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            text = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return None
    except OSError:  # exists but unreadable: -1 as documented (alive, start unknown)
        return -1
    fields = text[text.rfind(b")") + 2 :].split()
    if len(fields) < 20 or fields[0] in (b"Z", b"X"):  # a zombie writes nothing more
        return None
    return int(fields[19])


def this_writer() -> WriterId | None:
    """The calling process as a writer; None where /proc cannot prove liveness later."""
    pid = os.getpid()
    start = _start_time(pid)
    host = _host_id()
    if start is None or start < 0 or host is None:
        return None
    return WriterId(host, pid, start)


def writer_alive(writer: WriterId | None) -> bool | None:
    """True: alive; False: provably dead; None: cannot tell (another host, unrecorded)."""
    if writer is None or writer.host != _host_id():
        return None
    if os.geteuid() != 0 and _proc_hides_pids():
        return None
    start = _start_time(writer.pid)
    if start is not None and start < 0:
        return None  # a process we may not inspect: not provably dead
    return start == writer.start


def _check_max_age(max_age_s: float) -> None:
    if isinstance(max_age_s, bool) or not isinstance(max_age_s, numbers.Real):
        raise InvalidOptionTypeError(
            f"max_age_s must be a number of seconds, not {type(max_age_s).__name__}")
    if math.isnan(max_age_s) or max_age_s < 0:
        raise InvalidOptionError(f"max_age_s must be a number of seconds >= 0, not {max_age_s}")


#: A leftover whose removal failed, and why.
Failure = tuple[str, Exception]


def sweep(
    storage: Storage,
    parent: str,
    *,
    max_age_s: float = DEFAULT_MAX_AGE_S,
    lease_held: Callable[[str], bool] | None = None,
) -> tuple[list[str], list[Failure]]:
    """:func:`collect_garbage`, reporting instead of raising: the paths removed, and
    the leftovers whose removal failed with their errors. A leftover the storage
    keeps on purpose (:class:`LeftoverKeptError`) is neither. A store that does not
    answer (a timeout) ends the sweep: the rest would wait as long, to fail as well.
    Listing the leftovers raises, as :meth:`Storage.leftovers` does."""
    _check_max_age(max_age_s)
    removed: list[str] = []
    failed: list[Failure] = []
    now = time.time()
    for item in storage.leftovers(parent):
        alive = writer_alive(item.writer)
        if alive:
            continue
        owned = lease_held is not None and lease_held(item.target)
        if alive is None and not owned and now - item.modified <= max_age_s:
            continue
        try:
            restored = storage.remove_leftover(item)
        except (LeftoverKeptError, FileNotFoundError):
            continue  # committed meanwhile, not a save's, gone already: left alone
        except (OSError, CheckpointError) as exc:
            failed.append((item.path, exc))
            if isinstance(exc, TimeoutError):
                break
            continue
        if restored is None:  # else put back (a RuntimeWarning says so), not removed
            removed.append(item.path)
    return removed, failed


def sweep_error(parent: str, removed: list[str], failed: list[Failure]) -> CheckpointError:
    """One error for the failures of a :func:`sweep`: the first one's class (a
    ``PermissionError`` stays one) and message, which names its leftover, and how
    many more failed and were removed."""
    path, first = failed[0]
    if (len(failed) == 1 and not removed and isinstance(first, CheckpointError)
            and path in str(first) and not isinstance(first, TimeoutError)):
        return first
    more = [p for p, _ in failed[1:]]
    notes = []
    if more:
        shown = ", ".join(more[:3]) + (", ..." if len(more) > 3 else "")
        notes.append(f"{len(more)} more leftover(s) under {parent} could not be removed "
                     f"either: {shown}")
    if removed:
        notes.append(f"{len(removed)} other(s) were removed")
    if isinstance(first, TimeoutError):
        notes.append("the store did not answer, so any others were not tried")
    text = f"{first}" + (f" ({'; '.join(notes)})" if notes else "")
    if path not in str(first):
        text = f"removing {path} failed: {text}"
    if isinstance(first, CheckpointError):
        err = type(first)(text)
        if isinstance(first, OSError) and isinstance(err, OSError):
            err.errno, err.strerror = first.errno, first.strerror
        return err
    return storage_error(text, first if isinstance(first, OSError) else None)


def collect_garbage(
    storage: Storage,
    parent: str,
    *,
    max_age_s: float = DEFAULT_MAX_AGE_S,
    lease_held: Callable[[str], bool] | None = None,
) -> list[str]:
    """Remove the staging areas under ``parent`` whose writers are gone; return their paths.

    ``lease_held(target)`` says the caller holds the lease over checkpoint
    ``target`` (a CheckpointManager over its steps): then every staging area of
    that target whose writer is not provably alive is garbage, since no one
    else may write there.

    ``max_age_s`` is a number of seconds >= 0 (``inf``: never by age). A NaN or a
    negative age raises :class:`InvalidOptionError`: either one made every staging
    area of an unverifiable writer (another host's save in progress) old enough to go.

    A staging area the storage keeps on purpose (committed meanwhile, gone already,
    beside a damaged commit marker or objects no save writes) is skipped. A removal
    that fails (permission denied, a store that refuses or does not answer) does not
    stop the others; once they were tried the first failure is raised.

    Raises:
        StorageError: a leftover could not be removed (a ``PermissionError``, a
            ``TimeoutError``, ... as the failure was); the message names it, and
            how many others failed or were removed. A store that does not answer
            stops the collection at once. Or listing ``parent`` failed.

    Example:
        >>> import tempfile
        >>> from statestream.storage import LocalStorage
        >>> collect_garbage(LocalStorage(), tempfile.mkdtemp())
        []
    """
    removed, failed = sweep(storage, parent, max_age_s=max_age_s, lease_held=lease_held)
    if failed:
        err = sweep_error(parent, removed, failed)
        if err is failed[0][1]:
            raise err
        raise err from failed[0][1]
    return removed
