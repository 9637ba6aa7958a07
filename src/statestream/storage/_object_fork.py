"""Object stores: a forked child of a process that ran the client refuses to use it.

obstore's requests run on a tokio runtime, one per process, started by the first request;
its threads are not copied into a child made by ``fork()``, but the runtime is, with its
epoll instance (shared with the parent: a kernel object) and its connection pool.
Measured (obstore 0.12.1, moto on loopback, 2026-12-08): in such a child every request
hangs -- through an inherited client or a new one, past every timeout and retry limit --
and after it the parent's own requests may hang too (with plain obstore they did, and
once the parent died of a segmentation fault instead; presumably the child's runtime
takes or changes events of the epoll instance they share). A child that does not touch
the client leaves the parent unharmed, as does one that only drops it or ends normally;
a child of a process that built clients but never ran a request works normally.

So :func:`mark` records the store the first time this process takes a client, a fork
hook carries that into the child (and a grandchild), and :func:`check` -- called where
every client is taken (``ObjectStorage._store``), by the listing loop and by a writer --
raises a :class:`StorageError` there at once instead. A process that ran obstore's client
outside statestream is recognised at the fork by the runtime's threads (Linux: their
names in ``/proc/self/task``), looked for only when obstore was imported and statestream
took no client itself.
"""

from __future__ import annotations

import os
import sys

from statestream.errors import StorageError

__all__ = ["check", "mark"]

#: The thread name of obstore's runtime workers (``tokio-rt-worker``).
_RUNTIME_THREAD = "tokio-rt-worker"

#: The first store this process took a client for (``s3://bucket``).
_used: str | None = None
#: What the process this one was forked from (or one before it) had used; None when
#: there was none, or this process was not forked.
_forked_from: str | None = None


def mark(store: str) -> None:
    """Note that this process takes a client for ``store`` (``s3://bucket``)."""
    global _used
    if _used is None:
        _used = store


def check() -> None:
    """Raise a StorageError if this process was forked from one that ran the client."""
    if _forked_from is not None:
        raise StorageError(
            "object-store clients do not survive fork(): this process was forked from one "
            f"that used {_forked_from}, and the client's requests here would hang (and "
            "could hang the parent's); start worker processes with the 'spawn' or "
            "'forkserver' method (multiprocessing.get_context('spawn'), a DataLoader's "
            "multiprocessing_context='spawn'), or use the store only in the parent")


def _runtime_threads() -> bool:
    """Whether obstore's runtime runs in this process (its threads are there)."""
    try:
        for tid in os.listdir("/proc/self/task"):
            with open(f"/proc/self/task/{tid}/comm") as f:
                if f.read().strip() == _RUNTIME_THREAD:
                    return True
    except OSError:
        pass  # no /proc (not Linux), or a thread that just ended: not seen
    return False


_pending: str | None = None


def _before_fork() -> None:
    global _pending
    _pending = _forked_from or _used
    if _pending is None and "obstore" in sys.modules and _runtime_threads():
        _pending = "an object store (obstore's client ran in it)"


def _after_in_child() -> None:
    global _forked_from
    _forked_from = _pending


if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_before_fork, after_in_child=_after_in_child)
