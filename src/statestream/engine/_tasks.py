"""A background worker that runs tasks in order (the manager's persistence of local steps).

One thread per worker, started on the first task, niced like an asynchronous
save's writers. Tasks run one after another in submission order; each has a
:class:`TaskHandle`. Tasks still pending at interpreter exit are completed
then (a process that returns normally still persists what it saved), and a
failure nobody asked about is printed, never dropped. :meth:`BackgroundTasks.close`
ends the thread once the tasks queued run (a closed manager leaves none behind,
nor anything its tasks referred to).
"""

from __future__ import annotations

import atexit
import os
import queue
import sys
import threading
import weakref
from collections.abc import Callable
from types import TracebackType
from typing import Any

from statestream.engine._core import lower_thread_priority, wait_seconds
from statestream.errors import CheckpointError

__all__ = ["BackgroundTasks", "TaskHandle"]

_WORKERS: weakref.WeakSet[BackgroundTasks] = weakref.WeakSet()
_ATEXIT = threading.Lock()
_REGISTERED = [False]


class TaskHandle:
    """One submitted task: :meth:`result` waits for it and raises its error."""

    def __init__(self, what: str) -> None:
        self.what = what
        self._done = threading.Event()
        self._error: BaseException | None = None
        #: the traceback the task failed with: each result() raises the error with it
        #: (raising the object again added every caller's frames to it, alive)
        self._error_tb: TracebackType | None = None
        self._seen = False

    def done(self) -> bool:
        return self._done.is_set()

    def wait(self) -> None:
        """Wait for the task to end, whatever its outcome (its error stays for
        :meth:`result`)."""
        self._done.wait()

    def result(self, timeout: float | None = None) -> None:
        """Wait for the task; raise its error (once reported, it is not printed at exit).

        Raises:
            TimeoutError: not done within ``timeout`` seconds.
        """
        if not self._done.wait(wait_seconds(timeout, "result()")):
            raise TimeoutError(f"{self.what} not finished after {timeout}s")
        self._seen = True
        if self._error is not None:
            raise self._error.with_traceback(self._error_tb)


class BackgroundTasks:
    """Runs submitted callables on one background thread, in order.

    Example:
        >>> w = BackgroundTasks("example")
        >>> h = w.submit(lambda: None, "nothing")
        >>> h.result(); h.done()
        True
    """

    def __init__(self, name: str, *, nice: int = 0) -> None:
        self.name = name
        self._nice = nice
        self._queue: queue.Queue[tuple[Callable[[], Any], TaskHandle] | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._handles: list[TaskHandle] = []
        self._closed = False
        with _ATEXIT:
            _WORKERS.add(self)
            if not _REGISTERED[0]:
                atexit.register(_drain_at_exit)
                _REGISTERED[0] = True

    def submit(self, fn: Callable[[], Any], what: str) -> TaskHandle:
        """Queue ``fn``; ``what`` names it in messages.

        Raises:
            CheckpointError: the worker is closed.
        """
        h = TaskHandle(what)
        with self._lock:
            if self._closed:
                raise CheckpointError(f"cannot run {what}: its worker ({self.name}) is closed")
            self._handles.append(h)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
                self._thread.start()
            self._queue.put((fn, h))  # under the lock: never after close()'s sentinel
        return h

    def close(self, wait: bool = True) -> None:
        """End the thread once the tasks queued so far have run; ``wait``: wait for
        that (not on the worker's own thread). Idempotent; later submits raise."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            t = self._thread
            if t is not None:
                self._queue.put(None)  # under the lock: after every queued task
        if wait and t is not None and t is not threading.current_thread():
            t.join()

    @property
    def closed(self) -> bool:
        return self._closed

    def pending(self) -> list[TaskHandle]:
        """Handles of the tasks not finished yet, in order."""
        with self._lock:
            self._handles = [h for h in self._handles if not h.done() or not h._seen]
            return [h for h in self._handles if not h.done()]

    def handles(self) -> list[TaskHandle]:
        """Every handle whose outcome nobody has asked for yet."""
        with self._lock:
            self._handles = [h for h in self._handles if not h._seen]
            return list(self._handles)

    def _forget_parent(self) -> None:
        """In a child after ``fork()``: the thread and its tasks are the parent's (the
        thread did not come along). A fresh queue and lock; the next task starts a
        thread of the child's own."""
        self._lock = threading.Lock()
        self._queue = queue.Queue()
        self._thread = None
        self._handles = []

    def _run(self) -> None:
        lower_thread_priority(self._nice)
        while True:
            job = self._queue.get()
            if job is None:
                return
            fn, h = job
            try:
                fn()
            except BaseException as exc:  # kept on the handle; raised to whoever waits
                h._error, h._error_tb = exc, exc.__traceback__
            h._done.set()
            # the task's closure (a tier, its manager, their state) is not kept alive
            # while the thread waits for the next one
            del job, fn, h


def _forget_in_child() -> None:
    """After fork(): the exit drain waited for the parent's tasks, whose thread is not
    in the child, forever (and a child's own task queued behind them)."""
    global _ATEXIT
    _ATEXIT = threading.Lock()
    for w in list(_WORKERS):
        w._forget_parent()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)


def _drain_at_exit() -> None:
    for w in list(_WORKERS):
        for h in w.handles():
            try:
                h.result()
            except BaseException as exc:  # report, never drop silently
                print(f"statestream: {h.what} failed: {type(exc).__name__}: {exc}",
                      file=sys.stderr)
