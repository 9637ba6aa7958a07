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

