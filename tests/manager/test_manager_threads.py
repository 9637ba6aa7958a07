"""One CheckpointManager shared by threads: save on one, wait/close/load on another.

``save``, ``wait``, ``close`` and ``load`` run one at a time. Before 2026-12-06 a
``close`` (or ``wait``) on another thread returned while ``save`` was still
starting its save: that save then ran on a closed manager that had released the
directory (a second manager could open it mid-save), and the keep policy never
saw its step.
"""

from __future__ import annotations

import os
import threading
from typing import Any

import numpy as np
import pytest

import statestream as ss
from statestream.testing import faults


class _Watched:
    """The manager's call lock, telling when a call has to wait for it."""

    def __init__(self, lock: Any, waiting: threading.Event) -> None:
        self._lock = lock
        self._waiting = waiting

    def __enter__(self) -> None:
        if not self._lock.acquire(blocking=False):
            self._waiting.set()
            self._lock.acquire()

    def __exit__(self, *exc: object) -> None:
        self._lock.release()


@pytest.mark.parametrize("call", ["close", "wait"])
def test_a_call_on_another_thread_waits_for_the_save_being_started(
        tmp_path: os.PathLike[str], call: str) -> None:
    state = {"w": np.arange(1 << 18, dtype=np.float32)}
    mgr = ss.CheckpointManager(os.fspath(tmp_path), keep_policy=ss.KeepLatest(1))
    mgr.save(0, state)
    mgr.wait()
    # the other thread's call either waits for the manager (now) or returns (before)
    progressed = threading.Event()
    returned = threading.Event()
    seen: list[bool] = []
    mgr._calls = _Watched(getattr(mgr, "_calls", threading.RLock()),  # type: ignore[assignment]
                          progressed)

    def in_blocking_phase() -> None:  # save(1) is copying its snapshot
        other.start()
        assert progressed.wait(60)
        seen.append(returned.is_set())

    def other_call() -> None:
        getattr(mgr, call)()
        returned.set()
        progressed.set()

    other = threading.Thread(target=other_call)
    faults.on("async.snapshot_chunk", in_blocking_phase)
    try:
        assert mgr.save(1, state)
    finally:
        faults.clear()
    other.join(60)
    assert seen == [False]  # it had not returned while save(1) was starting
    assert returned.is_set()
    assert mgr.in_flight is None  # it waited for step 1 to commit ...
    assert mgr.steps() == [1]  # ... and applied the keep policy to it
    if call == "close":
        with pytest.raises(ss.CheckpointError, match="closed"):
            mgr.save(2, state)
        ss.CheckpointManager(os.fspath(tmp_path)).close()  # the directory is free
    else:
        mgr.close()
    np.testing.assert_array_equal(ss.load(os.path.join(os.fspath(tmp_path),
                                                       "step_0000000001"))["w"], state["w"])


# ------------------------------------------------- preemption=True off the main thread
def _on_thread(fn: Any) -> Any:
    out: list[Any] = []

    def run() -> None:
        try:
            out.append(fn())
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            out.append(exc)

    t = threading.Thread(target=run)
    t.start()
    t.join(60)
    return out[0]


def test_opened_on_a_thread_it_refuses_and_holds_nothing(tmp_path: os.PathLike[str]) -> None:
    # Python lets only the main thread install a signal handler; before 2026-12-06
    # signal.signal's ValueError came out of the manager, which kept the lease
    got = _on_thread(lambda: ss.CheckpointManager(os.fspath(tmp_path), preemption=True))
    assert isinstance(got, ss.InvalidOptionError)
    assert "main thread" in str(got)
    ss.CheckpointManager(os.fspath(tmp_path)).close()  # the directory is free


def test_opened_on_a_thread_beside_one_on_the_main_thread_it_arms(
        tmp_path: os.PathLike[str]) -> None:
    first = ss.CheckpointManager(os.path.join(os.fspath(tmp_path), "a"), preemption=True)
    try:
        second = _on_thread(lambda: ss.CheckpointManager(
            os.path.join(os.fspath(tmp_path), "b"), preemption=True))
        assert isinstance(second, ss.CheckpointManager)
        assert _on_thread(second.close) is None
    finally:
        first.close()


_CLOSED_ON_A_THREAD = """
import os, signal, sys, threading
import statestream as ss
if sys.argv[2] == "mine":
    signal.signal(signal.SIGTERM, lambda s, f: print("MINE", flush=True))
mgr = ss.CheckpointManager(sys.argv[1], preemption=True)
err = []
def close():
    try:
        mgr.close()
    except BaseException as exc:
        err.append(exc)
t = threading.Thread(target=close)
t.start()
t.join()
print("CLOSED", err, flush=True)
ss.CheckpointManager(sys.argv[1]).close()  # the directory is free
os.kill(os.getpid(), signal.SIGTERM)  # the handler the manager replaced has it
os.kill(os.getpid(), signal.SIGTERM)  # and is back in place
print("ALIVE", flush=True)
"""


@pytest.mark.parametrize("handler", ["default", "mine"])
def test_closed_on_a_thread_it_frees_the_directory_and_the_signal(
        tmp_path: os.PathLike[str], handler: str) -> None:
    import subprocess
    import sys
    import textwrap

    r = subprocess.run([sys.executable, "-c", textwrap.dedent(_CLOSED_ON_A_THREAD),
                        os.fspath(tmp_path), handler],
                       capture_output=True, text=True, timeout=120)
    assert r.stdout.startswith("CLOSED []\n"), r.stdout + r.stderr
    if handler == "default":  # SIGTERM ends the process, as without the manager
        assert r.returncode == -15 and "ALIVE" not in r.stdout, r.stdout + r.stderr
    else:
        assert r.returncode == 0, r.stderr
        assert r.stdout.splitlines()[1:] == ["MINE", "MINE", "ALIVE"]


# ------------------------------------------- steps() on a thread while a save deletes
@pytest.mark.parametrize("paused", ["after the names", "after the listing"])
def test_steps_on_another_thread_while_the_keep_policy_deletes_is_one_moment(
        tmp_path: os.PathLike[str], paused: str) -> None:
    # The other thread lists step 0 and is held there while save(1) commits step 1
    # and the keep policy deletes step 0. Before, its steps() then read a deleted
    # step: it listed it, warned that it was damaged ("after the listing"), or found
    # its marker gone and returned [] while a step was committed all along ("after
    # the names"). The hold is a test seam (the manager's own directory object).
    import warnings

    mgr = ss.CheckpointManager(os.fspath(tmp_path), keep_policy=ss.KeepLatest(1),
                               async_save=False)
    state = {"w": np.arange(1024, dtype=np.float32)}
    mgr.save(0, state)
    listed, deleted = threading.Event(), threading.Event()
    target: Any = mgr._dir.storage if paused == "after the names" else mgr._dir
    name = "list" if paused == "after the names" else "listing"
    real = getattr(target, name)

    def held(*args: Any) -> Any:
        out = real(*args)
        if threading.current_thread().name == "other" and not listed.is_set():
            listed.set()
            assert deleted.wait(60)
        return out

    setattr(target, name, held)
    got: list[Any] = []
    other = threading.Thread(target=lambda: got.append(mgr.steps()), name="other")
    faults.on("manager.step_deleted", deleted.set)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            other.start()
            assert listed.wait(60)
            mgr.save(1, state)  # commits step 1, then deletes step 0
            other.join(60)
    finally:
        faults.clear()
        deleted.set()
    assert got == [[1]]
    assert not [w for w in caught if "cannot read" in str(w.message)]
    mgr.close()


@pytest.mark.parametrize("call", ["should_save", "reached_preemption"])
def test_a_save_decision_on_another_thread_waits_for_the_save_being_started(
        tmp_path: os.PathLike[str], call: str) -> None:
    # Both read and change the decision save() records (which step was decided, a
    # preemption seen): before, another thread's should_save(7) in the middle of
    # save(1) replaced it, and reached_preemption(1) then disagreed with what save(1)
    # did. Now they take the manager's call lock as save does.
    state = {"w": np.arange(1 << 18, dtype=np.float32)}
    mgr = ss.CheckpointManager(os.fspath(tmp_path), save_policy=ss.EveryNSteps(1))
    progressed = threading.Event()
    returned = threading.Event()
    seen: list[bool] = []
    mgr._calls = _Watched(mgr._calls, progressed)  # type: ignore[assignment]

    def in_blocking_phase() -> None:  # save(1) is copying its snapshot
        other.start()
        assert progressed.wait(60)
        seen.append(returned.is_set())

    def other_call() -> None:
        getattr(mgr, call)(7)
        returned.set()
        progressed.set()

    other = threading.Thread(target=other_call)
    faults.on("async.snapshot_chunk", in_blocking_phase)
    try:
        assert mgr.save(1, state)
    finally:
        faults.clear()
    other.join(60)
    assert seen == [False]  # it had not returned while save(1) was starting
    assert returned.is_set()
    mgr.close()
