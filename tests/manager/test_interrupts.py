"""Ctrl-C (KeyboardInterrupt) while a CheckpointManager waits for its background work.

The interrupt stops the wait, not the work: the save (or the persistence)
still runs, and the manager must keep waiting for it on its next ``save``,
``wait`` or ``close`` instead of forgetting it.
"""

from __future__ import annotations

import os
import signal
import sys
import threading

import numpy as np
import pytest

import statestream as ss
from statestream.testing import faults

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals"),
]


@pytest.fixture(autouse=True)
def _no_faults():
    # Ctrl-C must raise KeyboardInterrupt here whatever ran before in this process (a
    # library may have replaced Python's SIGINT handler or blocked the signal)
    handler = signal.signal(signal.SIGINT, signal.default_int_handler)
    mask = signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGINT])
    faults.clear()
    yield
    faults.clear()
    signal.pthread_sigmask(signal.SIG_SETMASK, mask)
    signal.signal(signal.SIGINT, handler)


def state_at(step: int) -> dict:
    return {"step": step, "w": np.arange(64, dtype=np.float32) + step}


def _main_thread_waits_in(name: str) -> bool:
    frame = sys._current_frames().get(threading.main_thread().ident or 0)
    while frame is not None:
        if frame.f_code.co_name == name:
            return True
        frame = frame.f_back
    return False


def interrupt_main_thread_in(name: str) -> threading.Thread:
    """SIGINT this process once the main thread is inside a function called ``name``."""
    stop = threading.Event()

    def run() -> None:
        while not stop.wait(0.01):
            if _main_thread_waits_in(name):
                os.kill(os.getpid(), signal.SIGINT)
                return

    t = threading.Thread(target=run, daemon=True)
    t.stop = stop  # type: ignore[attr-defined]
    t.start()
    return t


def hold_at(point: str) -> threading.Event:
    """Block the background thread at ``point`` until the returned event is set."""
    gate = threading.Event()
    faults.on(point, lambda: gate.wait(60), nth=1)
    return gate


def test_an_interrupted_wait_keeps_the_save_in_flight(tmp_path):
    gate = hold_at("save.data_synced")
    mgr = ss.CheckpointManager(tmp_path, keep_policy=ss.KeepLatest(1))
    try:
        assert mgr.save(1, state_at(1))
        interrupt_main_thread_in("result")
        with pytest.raises(KeyboardInterrupt):
            mgr.wait()
        # the save is still running: the manager still knows it
        assert mgr.in_flight is not None and not mgr.in_flight.done()
        gate.set()
        # the same step is not saved again (it would collide with the running save)
        assert not mgr.save(1, state_at(1))
        mgr.wait()
        assert mgr.steps() == [1]
    finally:
        gate.set()
        mgr.close()
    assert sorted(os.listdir(tmp_path)) == [".statestream.lock", "step_0000000001"]


def test_close_after_an_interrupted_wait_waits_for_the_save(tmp_path):
    gate = hold_at("save.data_synced")
    mgr = ss.CheckpointManager(tmp_path)
    try:
        assert mgr.save(1, state_at(1))
        interrupt_main_thread_in("result")
        with pytest.raises(KeyboardInterrupt):
            mgr.wait()
        gate.set()
    finally:
        gate.set()
        mgr.close()
    # close() returned only after the save committed
    assert sorted(os.listdir(tmp_path)) == [".statestream.lock", "step_0000000001"]
    with ss.CheckpointManager(tmp_path) as again:
        assert again.steps() == [1]


def test_an_interrupted_close_keeps_the_directory_while_the_save_runs(tmp_path):
    # Ctrl-C in close() while the save still writes: the manager stays open (its lease
    # held, so no second manager opens mid-save), and the next close waits for the save
    gate = hold_at("save.data_synced")
    mgr = ss.CheckpointManager(tmp_path)
    try:
        assert mgr.save(1, state_at(1))
        interrupt_main_thread_in("result")
        with pytest.raises(KeyboardInterrupt):
            mgr.close()
        assert mgr.in_flight is not None and not mgr.in_flight.done()
        with pytest.raises(ss.ManagerLockedError):
            ss.CheckpointManager(tmp_path)
        gate.set()
    finally:
        gate.set()
        mgr.close()
    assert mgr.in_flight is None
    assert sorted(os.listdir(tmp_path)) == [".statestream.lock", "step_0000000001"]
    with ss.CheckpointManager(tmp_path) as again:
        assert again.steps() == [1]


def test_an_interrupted_wait_for_persistence_is_an_interrupt(tmp_path):
    gate = hold_at("tier.persist")
    mgr = ss.CheckpointManager(str(tmp_path / "persist"), local_tier=str(tmp_path / "local"))
    try:
        assert mgr.save(1, state_at(1))
        interrupt_main_thread_in("result")
        # a Ctrl-C is not a failed persistence (CheckpointError)
        with pytest.raises(KeyboardInterrupt):
            mgr.wait()
        gate.set()
        mgr.wait()
        assert mgr.persisted_steps() == [1]
    finally:
        gate.set()
        mgr.close()


def test_an_interrupted_close_keeps_the_directory_while_persistence_runs(tmp_path):
    # Ctrl-C in close() while the local tier still copies a step to the persistent
    # directory: the manager stays open (a second manager opened it mid-copy), and
    # the next close waits for the copy
    gate = hold_at("tier.persist")
    persist, local = str(tmp_path / "persist"), str(tmp_path / "local")
    mgr = ss.CheckpointManager(persist, local_tier=local)
    try:
        assert mgr.save(1, state_at(1))
        interrupt_main_thread_in("result")
        with pytest.raises(KeyboardInterrupt):
            mgr.close()
        with pytest.raises(ss.ManagerLockedError):
            ss.CheckpointManager(persist, local_tier=local)
        gate.set()
    finally:
        gate.set()
        mgr.close()
    with ss.CheckpointManager(persist) as again:
        assert again.steps() == [1]


def test_a_close_interrupted_as_the_save_ends_stays_open_until_its_commit_is_recorded(tmp_path):
    # The Ctrl-C lands just as the save commits (a CI run hit it under load): the
    # save is done, but its commit was neither recorded nor queued for the local
    # tier. The manager closed then (lease released, the step never persisted by it);
    # it stays open now, and the next close records the commit and persists the step
    persist, local = str(tmp_path / "persist"), str(tmp_path / "local")
    mgr = ss.CheckpointManager(persist, local_tier=local)
    try:
        assert mgr.save(1, state_at(1))
        h = mgr.in_flight
        assert h is not None
        real = h.result

        def result(timeout=None):
            real(timeout)
            raise KeyboardInterrupt  # after the save ended, before the wait returned

        h.result = result  # type: ignore[method-assign]
        with pytest.raises(KeyboardInterrupt):
            mgr.close()
        del h.result
        with pytest.raises(ss.ManagerLockedError):
            ss.CheckpointManager(persist, local_tier=local)
    finally:
        mgr.close()
    assert mgr.persisted_steps() == [1]
    with ss.CheckpointManager(persist) as again:
        assert again.steps() == [1]


@pytest.mark.parametrize("point", ["save.planned", "save.data_synced"])
def test_a_sync_save_interrupted_after_planning_leaves_no_staging_directory(tmp_path, point):
    # Ctrl-C right after the save job began (its staging directory exists): the save
    # is aborted and its directory removed, and the same path saves afterwards
    faults.on(point, lambda: os.kill(os.getpid(), signal.SIGINT))
    with pytest.raises(KeyboardInterrupt):
        ss.save(tmp_path / "c", state_at(1))
    faults.clear()
    assert sorted(p.name for p in tmp_path.iterdir()) == []
    ss.save(tmp_path / "c", state_at(2))
    assert ss.load(tmp_path / "c")["step"] == 2
