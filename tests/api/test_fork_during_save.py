"""A process forked while a save's threads hold the library's locks (a DataLoader worker
forked mid-save) can save and load: the locks those threads held are not held in the
child, where the threads did not come along.

A save's copy and writer threads take the staging pools' locks and the fresh-memory
lock many times a second; a fork that landed while one was held left the child's
copy of it locked forever, and the child's first load or save hung. Here a thread
holds the locks, as a save's thread would at that instant, while the parent forks.
Timeouts only guard against hangs.
"""

from __future__ import annotations

import multiprocessing
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

import statestream as ss
from statestream import _memory
from statestream.engine import host_pool, pinned_pool

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="fork")

_WAIT_S = 60


def _child(path: str, out: multiprocessing.SimpleQueue) -> None:  # type: ignore[type-arg]
    big = np.arange(2 << 20, dtype=np.float32)  # 8 MiB: fresh (unadvised) memory on load
    ss.save_async(path, {"x": big}, lazy=True).result(timeout=_WAIT_S)
    got = ss.load(path, memory=ss.MemoryOptions(memory_budget_bytes=1 << 20))
    out.put(bool(np.array_equal(got["x"], big)))


@pytest.mark.filterwarnings("ignore:os.fork:RuntimeWarning")  # JAX, if another test loaded it
def test_a_child_forked_while_a_save_thread_holds_its_locks_can_save_and_load(
        tmp_path: Path) -> None:
    locks = [host_pool()._lock, pinned_pool()._lock, _memory._LOCK]
    held = threading.Event()
    done = threading.Event()

    def hold() -> None:  # what a save's thread does for a moment, many times a save
        for lock in locks:
            lock.acquire()
        held.set()
        done.wait(_WAIT_S)
        for lock in reversed(locks):
            lock.release()

    t = threading.Thread(target=hold, name="statestream-write-0")
    t.start()
    try:
        assert held.wait(_WAIT_S)
        ctx = multiprocessing.get_context("fork")
        out = ctx.SimpleQueue()
        child = ctx.Process(target=_child, args=(str(tmp_path / "child"), out))
        child.start()
        child.join(_WAIT_S)
        alive = child.is_alive()
        if alive:
            child.kill()
            child.join()
        assert not alive, "the child hung on a lock held by a thread it does not have"
        assert child.exitcode == 0 and out.get() is True
    finally:
        done.set()
        t.join()
