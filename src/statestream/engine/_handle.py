"""Save handles and the process's queue of saves in flight.

Saves are serialised: a new asynchronous save first waits for the previous
one to finish, so an in-flight save is never disturbed. Pending saves are
completed at interpreter exit, and failures nobody asked about are printed
then -- never silently dropped.

A failed save keeps nothing of the state: its error's traceback keeps no locals of
the save's frames that returned (``drop_locals``), each ``result()`` raises the
error with the traceback it failed with (the frames of earlier callers are not
added to it), and the queue keeps the last save's :class:`QueuedSave`, not its
handle (the error's traceback holds the frames of whoever asked for it last). Until
2026-12-07 a failed save's state stayed alive in the module's last handle until the
next ``save_async``, and each ``result()`` added its caller's frames to the error's
traceback, which kept them (and their locals) alive.
"""

from __future__ import annotations

import atexit
import inspect
import os
import sys
import threading
from collections.abc import Iterable, Sequence
from types import TracebackType
from typing import Any

from statestream.engine._core import wait_seconds
from statestream.errors import CheckpointError
from statestream.providers import array_provider_for

__all__ = ["SAVE_THREADS", "QueuedSave", "SaveHandle", "drop_locals", "enqueue",
           "previous_save", "start_lock"]

#: Names of the threads a save runs on (its writers and its background thread).
SAVE_THREADS = ("statestream-write-", "statestream-save")

_LOCK = threading.Lock()
#: Held while an asynchronous save waits for the previous one and starts: two
#: threads' save_async calls start one after the other, never both at once.
_START = threading.Lock()
_LAST: QueuedSave | None = None
_PENDING: set[SaveHandle] = set()
_ATEXIT = False
#: Set when the interpreter exits: a finished save's thread stops warming staging
#: buffers for a next save that will not come (see ``_drain_at_exit``).
EXITING = threading.Event()


class QueuedSave:
    """What the queue of saves keeps of the last save started: its path, the events
    the next save waits for, its thread (joined at exit); not its outcome."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.finished = threading.Event()
        #: set when the save's thread is done, after warming the staging pool
        self.settled = threading.Event()
        #: set when the next save starts: it stops warming (what is mapped by then
        #: is used; the next save races the writers for the rest)
        self.superseded = threading.Event()
        #: the save's background thread, joined at interpreter exit
        self.thread: threading.Thread | None = None

    def done(self) -> bool:
        """True once the save is committed (or has failed)."""
        return self.finished.is_set()


class SaveHandle:
    """A save in flight. ``result()`` waits for the commit and raises its error.

    Example:
        >>> import numpy as np, tempfile, os, statestream as ss
        >>> d = os.path.join(tempfile.mkdtemp(), "ckpt")
        >>> h = ss.save_async(d, {"w": np.ones(3)})
        >>> h.result(); h.done()
        True
    """

    def __init__(self, path: str, n_arrays: int) -> None:
        self.path = path
        self._queued = QueuedSave(path)
        self._snapshot = threading.Event()
        self._finished = self._queued.finished
        self._settled = self._queued.settled
        self._superseded = self._queued.superseded
        #: 1 where an array is copied; one condition for all (an Event per array took
        #: 0.3-0.5 s of the blocking phase of a save of 20,000 arrays until 2026-12-07)
        self._ready = bytearray(n_arrays)
        self._ready_cv = threading.Condition(threading.Lock())
        self._error: BaseException | None = None
        #: the traceback the save failed with: each result() raises the error with it
        self._error_tb: TracebackType | None = None
        self._snapshot_failed = False
        #: memory id -> indices of the arrays that use it (see ``wait_for``)
        self._memory: dict[int, list[int]] = {}
        self.bytes_total = 0
        self.bytes_written = 0

    @property
    def _thread(self) -> threading.Thread | None:
        """The save's background thread (None until it is started)."""
        return self._queued.thread

    @_thread.setter
    def _thread(self, thread: threading.Thread | None) -> None:
        self._queued.thread = thread

    # -- progress ---------------------------------------------------------------
    def done(self) -> bool:
        """True once the save is committed (or has failed)."""
        return self._finished.is_set()

    def failed(self) -> bool:
        """True once the save has failed (``result()`` raises its error); False while
        it runs and once it is committed. Does not count as having seen the error."""
        return self._finished.is_set() and self._error is not None

    def error(self) -> BaseException | None:
        """The save's error once it has failed (what ``result()`` raises), else None.
        Does not count as having seen it."""
        return self._error if self._finished.is_set() else None

    def snapshot_done(self) -> bool:
        """True once every byte has been copied out of the state."""
        return self._snapshot.is_set()

    def progress(self) -> tuple[int, int]:
        """(bytes written, bytes total) so far."""
        return self.bytes_written, self.bytes_total

    # -- waiting ----------------------------------------------------------------
    def wait_snapshot(self, timeout: float | None = None) -> None:
        """Block until the state may be mutated (every chunk copied); ``timeout`` in
        seconds (None or ``inf``: no limit).

        Raises:
            TimeoutError: the snapshot did not finish within ``timeout`` seconds.
            CheckpointError: the snapshot failed (the save is abandoned), or this
                was called on a thread of the save (it would wait for itself).
        """
        if not self._snapshot.is_set():
            self._not_on_its_thread("wait_snapshot()")
        if not self._snapshot.wait(wait_seconds(timeout, "wait_snapshot()")):
            raise TimeoutError(f"snapshot of {self.path} not done after {timeout}s")
        if self._snapshot_failed and self._error is not None:
            self._reported()
            self._raise()

    def wait_for(self, values: Iterable[Any]) -> None:
        """Block until the arrays backed by these values' memory are copied.

        A value whose memory cannot be told (no provider knows it) waits for
        the whole snapshot: never too little.
        """
        if self._snapshot.is_set():
            return
        self._not_on_its_thread("waiting for its arrays")
        ids: set[int] = set()
        for v in values:
            p = array_provider_for(v)
            mid = p.memory_id(v) if p is not None and p.capabilities.mutable_values else None
            if mid is None:
                self._snapshot.wait()
                return
            ids.add(mid)
        with self._ready_cv:
            for mid in ids:
                for ai in self._memory.get(mid, ()):
                    while not self._ready[ai]:  # each array looked at once, not per wake
                        self._ready_cv.wait()

    def result(self, timeout: float | None = None) -> None:
        """Wait until the checkpoint is durable and committed; raise any error.
        ``timeout`` in seconds (None or ``inf``: no limit).

        Raises:
            TimeoutError: not finished within ``timeout`` seconds.
            InvalidOptionError: ``timeout`` is NaN.
            CheckpointError (or the original error): the background phase failed;
                nothing was committed. Also: called on a thread of the save (a
                progress callback), which it would wait for forever.
        """
        if not self._finished.is_set():
            self._not_on_its_thread("result()")
        if not self._finished.wait(wait_seconds(timeout, "result()")):
            raise TimeoutError(f"save to {self.path} not finished after {timeout}s")
        if self._error is not None:
            self._reported()
            self._raise()

    def _raise(self) -> None:
        """Raise the save's error with the traceback it failed with: raising the same
        object again would add this caller's frames to the traceback it keeps (and
        each earlier caller's, alive with their locals)."""
        assert self._error is not None
        error = self._error.with_traceback(self._error_tb)
        drop_locals(error)  # the save's frames that have returned since it failed
        raise error

    def _not_on_its_thread(self, what: str) -> None:
        """Refuse to wait on a thread of a save in flight (a progress callback runs on
        its writers): it would wait for itself, and hang (only one save runs at a
        time, so an unfinished save's wait there is always this one's)."""
        if threading.current_thread().name.startswith(SAVE_THREADS):
            raise CheckpointError(
                f"{what} of the save to {self.path} was called on a thread of a save in "
                "flight (from a progress callback?): it would wait for that thread, and "
                "never return. Wait for the save after save_async returns")

    # -- the job's side -----------------------------------------------------------
    def arrays_ready(self, indices: Sequence[int]) -> None:
        """These arrays are copied or written: waits for them may return (one lock
        for many: the copy threads and writers of a snapshot of many small arrays
        contended for it, once per array)."""
        if not indices:
            return
        with self._ready_cv:
            for i in indices:
                self._ready[i] = 1
            self._ready_cv.notify_all()

    def snapshot_finished(self) -> None:
        self._snapshot.set()
        self._memory = {}  # waits return at once from now on (the walk's, let go of)

    def fail(self, exc: BaseException, *, raised_here: bool = False) -> None:
        """The save failed with ``exc``. Kept for ``result()`` without the locals of
        the frames it passed (the state), unless ``raised_here``: the caller raises it
        at once, and the queue does not keep this handle."""
        if self._error is None:
            self._error, self._error_tb = exc, exc.__traceback__
            if not raised_here:
                drop_locals(exc)
        if not self._snapshot.is_set():
            self._snapshot_failed = True
        with self._ready_cv:
            self._ready[:] = b"\x01" * len(self._ready)
            self._ready_cv.notify_all()
        self._snapshot.set()
        self._memory = {}
        # A failed save stays pending until the caller has seen its error, so one
        # that nobody asked about is still reported at interpreter exit.
        self._finished.set()

    def finish(self) -> None:
        self._finished.set()
        self._reported()

    def _reported(self) -> None:
        with _LOCK:
            _PENDING.discard(self)


_GENERATOR_CODE = (inspect.CO_GENERATOR | inspect.CO_COROUTINE | inspect.CO_ASYNC_GENERATOR
                   | inspect.CO_ITERABLE_COROUTINE)


def drop_locals(error: BaseException) -> None:
    """Clear the locals of the frames in ``error``'s traceback that have returned, and
    in the tracebacks of the errors chained to it (``__cause__``, ``__context__``)
    that this library caught: the frames of a save below where it caught the error,
    which hold its state, its job, views of its memory. A frame still running (on
    any thread) and a generator's are left alone, and so is a chained error that
    was caught elsewhere (one the caller was handling when it called the save: its
    frames are the caller's). The error keeps its type, message, chain and where
    each frame was; a post-mortem debugger sees no locals in those frames.
    """
    seen: set[int] = set()
    todo: list[BaseException | None] = [error]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        tb = e.__traceback__
        if tb is None or not tb.tb_frame.f_globals.get("__name__", "").startswith(
                "statestream."):
            continue
        while tb is not None:
            if not tb.tb_frame.f_code.co_flags & _GENERATOR_CODE:
                try:
                    tb.tb_frame.clear()
                except RuntimeError:  # still running
                    pass
            tb = tb.tb_next
        todo += [e.__cause__, e.__context__]


def _forget_in_child() -> None:
    """After fork(): the parent's saves are not this process's (their threads did not
    come along); waiting for them hung the child's exit and its own first save."""
    global _LAST, _LOCK, _START
    _LOCK = threading.Lock()  # it may have been held by a thread that is gone
    _START = threading.Lock()
    _LAST = None
    _PENDING.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)


def _drain_at_exit() -> None:
    EXITING.set()
    with _LOCK:
        pending = list(_PENDING)
        last = _LAST
    for h in pending:
        try:
            h.result()
        except BaseException as exc:  # report, never drop silently
            print(f"statestream: background save to {h.path} failed: "
                  f"{type(exc).__name__}: {exc}", file=sys.stderr)
    # The save's thread is a daemon: it must be out of the library's code before the
    # interpreter finalizes. A daemon thread that lets go of a torch tensor while
    # the interpreter is finalizing is unwound from inside torch's C++ and aborts
    # the process ("terminate called without an active exception", exit 134).
    # One save runs at a time, so the last one is the only one that may be running.
    if last is not None:
        last.settled.wait()
        if last.thread is not None:
            # Until the thread has ended: threading.Thread.run() itself drops the
            # job (its target) after the target returns.
            last.thread.join()


def start_lock() -> threading.Lock:
    """The lock a save_async start holds (a fresh one after fork())."""
    return _START


def previous_save() -> QueuedSave | None:
    """The last save started (registering the exit drain on first use)."""
    global _ATEXIT
    with _LOCK:
        if not _ATEXIT:
            atexit.register(_drain_at_exit)
            _ATEXIT = True
        return _LAST


def enqueue(handle: SaveHandle) -> None:
    """Make ``handle`` the save the next one waits for, pending until reported."""
    global _LAST
    with _LOCK:
        _PENDING.add(handle)
        _LAST = handle._queued
