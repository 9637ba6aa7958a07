"""Fault injection: kill the process at a named point of a save, or fail storage calls.

Example (in a child process)::

    from statestream.testing import faults
    faults.kill_at("commit.manifest_written")      # SIGKILL there
    ss.save(path, state)                           # never returns

:class:`FaultyStorage` wraps any Storage backend and fails the k-th write-side
call with ENOSPC or EIO, or stalls it and then fails it as timed out
(:class:`StorageFault`); :func:`faulty_backend` routes ``ss.save`` through it.
The storage conformance suite runs every backend under it.
"""

from __future__ import annotations

import builtins
import contextlib
import dataclasses
import errno
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator, Sequence

from statestream import _hooks
from statestream.errors import InvalidOptionError, storage_error
from statestream.storage import (
    Buffer,
    CheckpointReader,
    FileWriter,
    Lease,
    Leftover,
    Storage,
    WriteTransaction,
)

__all__ = [
    "FAULT_KINDS",
    "FAULT_OPS",
    "POINTS",
    "FaultyStorage",
    "StorageFault",
    "clear",
    "faulty_backend",
    "kill_at",
    "on",
]

#: Every point where a fault can be injected, in the order a save reaches them.
POINTS = (
    "save.planned",
    "async.snapshot_chunk",
    "save.chunk_written",
    "save.data_synced",
    "commit.manifest_written",
    "commit.marker_written",
    "commit.renamed",
    "delete.uncommitted",
    "manager.step_deleted",
    "tier.persist",
    "tier.persisted",
    "tier.caught_up",
)


def on(point: str, callback: Callable[[], None], *, nth: int = 1) -> None:
    """Run ``callback`` the ``nth`` time ``point`` is reached."""
    if point not in POINTS:
        raise InvalidOptionError(f"unknown fault point {point!r}; known: {', '.join(POINTS)}")
    count = [0]

    def cb() -> None:
        count[0] += 1
        if count[0] == nth:
            callback()

    _hooks.register(point, cb)


def kill_at(point: str, *, nth: int = 1) -> None:
    """SIGKILL this process the ``nth`` time ``point`` is reached."""
    on(point, lambda: os.kill(os.getpid(), signal.SIGKILL), nth=nth)


def clear() -> None:
    """Remove all injected faults."""
    _hooks.clear()


# ----------------------------------------------------------------------------- storage faults
#: What an injected storage fault does: fail with ENOSPC or EIO, or hang for a
#: while and then fail as a request that timed out (ETIMEDOUT).
FAULT_KINDS = ("enospc", "eio", "stall")
#: The storage operations a fault can hit (the write side of a save).
FAULT_OPS = frozenset({"begin_write", "create_file", "write_at", "finish", "write_bytes",
                       "commit"})
_ERRNO = {"enospc": errno.ENOSPC, "eio": errno.EIO, "stall": errno.ETIMEDOUT}


@dataclasses.dataclass
class StorageFault:
    """Fail the ``at``-th storage call among ``ops`` (1-based; 0: never, only count).

    After a run, :attr:`calls` is how many such calls were made, so a first
    run with ``at=0`` tells how many points a save has to fail at.
    """

    kind: str = "eio"
    at: int = 0
    ops: frozenset[str] = FAULT_OPS
    stall_s: float = 0.2
    calls: int = 0
    #: What the fault hit, as ``"op where"``, once it fired.
    fired: str | None = None
    _lock: threading.Lock = dataclasses.field(default_factory=threading.Lock, repr=False)

    def __post_init__(self) -> None:
        if self.kind not in FAULT_KINDS:
            raise InvalidOptionError(f"unknown fault kind {self.kind!r}; known: {FAULT_KINDS}")

    def tick(self, op: str, where: str) -> None:
        """Count a call; raise the injected error if it is the chosen one."""
        if op not in self.ops:
            return
        with self._lock:
            self.calls += 1
            hit = self.calls == self.at
            if hit:
                self.fired = f"{op} {where}"
        if not hit:
            return
        if self.kind == "stall":
            time.sleep(self.stall_s)
        raise storage_error(f"injected {self.kind} at storage call {self.at} ({op} {where})",
                            _ERRNO[self.kind])


class FaultyStorage:
    """A Storage that passes every call to ``inner`` except the one ``fault`` fails.

    Example:
        >>> import tempfile, os
        >>> from statestream.storage import LocalStorage
        >>> st = FaultyStorage(LocalStorage(), StorageFault("enospc", at=1))
        >>> try:
        ...     st.begin_write(os.path.join(tempfile.mkdtemp(), "c"), overwrite=False)
        ... except OSError as exc:
        ...     print(exc.errno == errno.ENOSPC)
        True
    """

    def __init__(self, inner: Storage, fault: StorageFault) -> None:
        self.inner = inner
        self.fault = fault
        self.capabilities = inner.capabilities

    def begin_write(self, path: str, *, overwrite: bool) -> WriteTransaction:
        self.fault.tick("begin_write", path)
        return _FaultyTxn(self.inner.begin_write(path, overwrite=overwrite), self.fault)

    def join_write(self, path: str, token: str) -> WriteTransaction:
        return _FaultyTxn(self.inner.join_write(path, token), self.fault)

    def open_read(self, path: str, *, follow_links: bool = True) -> CheckpointReader:
        return self.inner.open_read(path, follow_links=follow_links)

    def is_committed(self, path: str) -> bool:
        return self.inner.is_committed(path)

    def list(self, path: str) -> list[str]:
        return self.inner.list(path)

    def delete(self, path: str) -> None:
        self.inner.delete(path)

    def acquire_lease(self, path: str, *, holder: str, ttl_s: float) -> Lease:
        return self.inner.acquire_lease(path, holder=holder, ttl_s=ttl_s)

    def leftovers(self, parent: str) -> builtins.list[Leftover]:
        return self.inner.leftovers(parent)

    def remove_leftover(self, leftover: Leftover) -> str | None:
        return self.inner.remove_leftover(leftover)


class _FaultyTxn:
    def __init__(self, inner: WriteTransaction, fault: StorageFault) -> None:
        self._inner = inner
        self._fault = fault
        self.location = inner.location

    @property
    def token(self) -> str:
        return self._inner.token

    def create_file(self, name: str, size_hint: int) -> FileWriter:
        self._fault.tick("create_file", name)
        return _FaultyWriter(self._inner.create_file(name, size_hint), self._fault, name)

    def write_bytes(self, name: str, data: bytes) -> None:
        self._fault.tick("write_bytes", name)
        self._inner.write_bytes(name, data)

    def commit(self) -> None:
        try:
            self._fault.tick("commit", self.location)
        except BaseException:
            self._inner.abort()  # a failed commit discards the save, as backends do
            raise
        self._inner.commit()

    def abort(self) -> None:
        self._inner.abort()


class _FaultyWriter:
    def __init__(self, inner: FileWriter, fault: StorageFault, name: str) -> None:
        self._inner = inner
        self._fault = fault
        self._name = name

    def write_at(self, buffers: Sequence[Buffer], offset: int) -> None:
        self._fault.tick("write_at", f"{self._name}@{offset}")
        self._inner.write_at(buffers, offset)

    def finish(self) -> None:
        self._fault.tick("finish", self._name)
        self._inner.finish()

    def abort(self) -> None:
        self._inner.abort()


@contextlib.contextmanager
def faulty_backend(url: str, fault: StorageFault) -> Iterator[FaultyStorage]:
    """Route saves and loads of ``url``'s scheme through a FaultyStorage for the block."""
    from statestream.storage._resolve import registered_backend, set_backend, storage_for

    scheme = url.partition("://")[0] if "://" in url else "file"
    previous = registered_backend(scheme)
    wrapped = FaultyStorage(storage_for(url)[0], fault)
    set_backend(scheme, wrapped)
    try:
        yield wrapped
    finally:
        set_backend(scheme, previous)
