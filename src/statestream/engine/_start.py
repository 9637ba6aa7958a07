"""Entry points of a save: synchronous, or started in the background.

Saves run one at a time in a process: a new one waits for the previous
asynchronous one (which stops warming staging buffers for it); an asynchronous
one then snapshots and hands the rest to a thread of its own. The start holds a
lock (a synchronous save holds it to the end), so that two threads saving at
once run one after the other, never two saves' buffers at once; and a start
interrupted anywhere (a KeyboardInterrupt) settles its handle, which the next
save and the interpreter's exit wait for.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator
from typing import Any

from statestream._gc import gc_paused
from statestream._gc import pause as pause_gc
from statestream.engine._core import thread_started
from statestream.engine._handle import (
    SAVE_THREADS,
    SaveHandle,
    enqueue,
    previous_save,
    start_lock,
)
from statestream.engine._job import SaveJob
from statestream.engine._saveopts import SaveOptions
from statestream.errors import CheckpointError

__all__ = ["holding_start", "run_save", "start_save"]


class _Holding(threading.local):
    #: this thread holds the start lock: its ss.save runs, or its save_async starts
    #: (a state_dict() it walks is called with the lock held)
    active = False


_HOLDING = _Holding()


def holding_start() -> bool:
    """Whether this thread holds the start lock (its ``ss.save`` runs, or its
    ``save_async`` starts): a ``state_dict()`` that save walks runs here."""
    return _HOLDING.active


@contextlib.contextmanager
def _start_held() -> Iterator[None]:
    with start_lock():
        _HOLDING.active = True
        try:
            yield
        finally:
            _HOLDING.active = False


def run_save(path: str | os.PathLike[str], state: Any, options: SaveOptions) -> None:
    """A synchronous save (the caller blocks until it is committed).

    It queues with the asynchronous saves: it first waits for the one in flight
    (which stops warming staging buffers for a next save), and holds the start lock
    while it runs, so a ``save_async`` (or another ``save``) from another thread
    waits for it. On a thread of a save in flight (a progress callback) it cannot
    wait for that save, which waits for the thread: it runs at once there.
    """
    if threading.current_thread().name.startswith(SAVE_THREADS) or _HOLDING.active:
        # a save's thread, or a state_dict() that this thread's own save walks: the
        # start lock is not this save's to wait for
        _run_sync(path, state, options)
        return
    with _start_held():
        previous = previous_save()
        if previous is not None:
            previous.superseded.set()
            previous.settled.wait()
        _run_sync(path, state, options)


def _run_sync(path: str | os.PathLike[str], state: Any, options: SaveOptions) -> None:
    with gc_paused():
        SaveJob(path, state, options, snapshot=False).run()


def start_save(path: str | os.PathLike[str], state: Any, options: SaveOptions, *,
               lazy: bool) -> SaveHandle:
    """An asynchronous save: return after the snapshot (at once when ``lazy``)."""
    previous = previous_save()
    # On a thread of a save (a progress callback), a save in flight is that save: an
    # asynchronous one not settled, or a synchronous one, which holds the start lock
    # while it runs; so is this thread's own save (a state_dict() it walks).
    # Waiting for it would wait for this thread.
    in_flight = previous is not None and not previous.settled.is_set()
    if _HOLDING.active or (threading.current_thread().name.startswith(SAVE_THREADS)
                           and (in_flight or start_lock().locked())):
        to = f" to {previous.path}" if previous is not None and in_flight else ""
        raise CheckpointError(
            f"save_async({os.fspath(path)!r}) was called on a thread of the save in flight"
            f"{to} (from a progress callback, or a state_dict() that a save walks?): it "
            "would wait for that save, which waits for this thread. Call ss.save there, "
            "or save after it returns")
    with _start_held():
        previous = previous_save()
        if previous is not None:
            # One save at a time. The previous one's error stays on its handle (and is
            # reported at exit unless its caller asks for it). If it is still warming
            # staging buffers for this save, it stops: waiting for the rest to be
            # faulted in would take longer than racing the writers for it.
            previous.superseded.set()
            previous.settled.wait()
        job = SaveJob(path, state, options, snapshot=True, lazy=lazy)
        if job.multi:
            job.finish_coll = job.coll.fork("statestream-async")
        # The collector stays paused until the save's outcome is known (its
        # background thread resumes it): what the walk made lives until then, and
        # collections would traverse it again and again (statestream._gc).
        resume = job.resume_gc = pause_gc()
        try:
            job.begin()
            handle = job.make_handle()
        except BaseException:
            resume()
            raise
        try:
            enqueue(handle)
            if not lazy:
                job.snapshot()
            _spawn(job, run_snapshot=lazy)
        except BaseException as exc:
            # the snapshot failed, or an interrupt landed anywhere before the thread
            # ran: nothing else will settle the handle
            if handle._thread is None and not handle._settled.is_set():
                _abandon(job, exc)
            raise
        return handle


def _abandon(job: SaveJob, exc: BaseException) -> None:
    """The save failed before its background thread ran: abort it and settle its
    handle (whatever the abort raises: a handle never settled hangs the next save
    and the interpreter's exit)."""
    handle = job.handle
    assert handle is not None
    try:
        if job.multi:  # still agree with the other ranks, then report
            job.background(False, exc)
            handle.result()
        job._abort_local()
    finally:
        job.release_values()  # (before 2026-12-07 a failed start's job kept the state)
        job.resume_gc()
        handle.fail(exc, raised_here=True)
        handle._settled.set()
        handle._reported()  # raised to the caller right here


def _spawn(job: SaveJob, *, run_snapshot: bool) -> None:
    t = threading.Thread(target=job.background, args=(run_snapshot,), name="statestream-save",
                         daemon=True)
    assert job.handle is not None
    job.handle._thread = t
    try:
        t.start()
    except BaseException as exc:  # a KeyboardInterrupt inside start()
        # Started, it runs the save (and settles it); not started, nothing will:
        # abandon the save here.
        if not thread_started(t):
            job.handle._thread = None
            _abandon(job, exc)
        raise
