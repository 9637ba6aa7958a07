"""engine._tasks: the background worker (a manager's persistence thread) runs tasks in
order, ends its thread on close, and keeps no finished task alive."""

from __future__ import annotations

import gc
import os
import signal
import threading
import time
import weakref

import pytest

from statestream.engine import BackgroundTasks, _tasks
from statestream.errors import CheckpointError


def _threads(name: str) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == name]


def test_close_runs_the_queued_tasks_then_ends_the_thread() -> None:
    w = BackgroundTasks("test-tasks-close")
    gate = threading.Event()
    ran: list[int] = []
    w.submit(lambda: gate.wait(30), "waiting")
    handles = [w.submit(lambda i=i: ran.append(i), f"task {i}") for i in range(3)]
    assert len(_threads("test-tasks-close")) == 1
    gate.set()
    w.close()
    assert ran == [0, 1, 2] and all(h.done() for h in handles)
    assert _threads("test-tasks-close") == []
    w.close()  # idempotent
    with pytest.raises(CheckpointError, match="closed"):
        w.submit(lambda: None, "late")


def test_close_without_waiting_lets_the_running_task_finish() -> None:
    w = BackgroundTasks("test-tasks-nowait")
    gate = threading.Event()
    h = w.submit(lambda: gate.wait(30), "waiting")
    w.close(wait=False)
    assert not h.done() and len(_threads("test-tasks-nowait")) == 1
    gate.set()
    h.result(timeout=30)
    for t in _threads("test-tasks-nowait"):
        t.join(30)
    assert _threads("test-tasks-nowait") == []


def test_a_finished_task_is_not_kept_alive_by_the_thread() -> None:
    class Big:
        def run(self) -> None:
            pass

    w = BackgroundTasks("test-tasks-refs")
    obj = Big()
    ref = weakref.ref(obj)
    w.submit(obj.run, "a bound method").result(timeout=30)
    del obj
    gc.collect()
    assert ref() is None  # the idle thread (still running) held the last task
    assert len(_threads("test-tasks-refs")) == 1
    w.close()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork")
@pytest.mark.filterwarnings("ignore:os.fork:RuntimeWarning")  # JAX, if another test loaded it
def test_a_child_forked_while_a_task_runs_neither_waits_for_it_nor_loses_the_worker(
        ) -> None:
    # A process forked while a manager's persistence task ran (any os.fork(), a
    # DataLoader worker that exits normally) waited at its exit for the parent's task,
    # whose thread did not come along: forever. Its own tasks queued behind it too.
    w = BackgroundTasks("test-tasks-fork")
    gate = threading.Event()
    w.submit(lambda: gate.wait(60), "the parent's persistence")
    pid = os.fork()
    if pid == 0:  # the child: its exit drain, then a task of its own
        code = 1
        try:
            _tasks._drain_at_exit()  # what atexit runs
            ran: list[int] = []
            w.submit(lambda: ran.append(1), "the child's").result(timeout=30)
            code = 0 if ran == [1] else 2
        finally:
            os._exit(code)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            time.sleep(0.05)
        else:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            pytest.fail("the child waited for the parent's task")
        assert os.waitstatus_to_exitcode(status) == 0
    finally:
        gate.set()
        w.close()


def test_result_raises_the_error_without_gathering_its_callers_frames() -> None:
    """Raising the kept error object again appended each caller's frames to its
    traceback (alive, with their locals): a manager asking a failed tier task
    again and again kept them all."""
    tasks = BackgroundTasks("test")

    def fail() -> None:
        raise OSError("task failed")

    h = tasks.submit(fail, "failing")
    h.wait()

    def frames() -> int:
        try:
            h.result()
        except OSError as exc:
            n, tb = 0, exc.__traceback__
            while tb is not None:
                n, tb = n + 1, tb.tb_next
            return n
        raise AssertionError("no error")

    first = frames()
    assert [frames() for _ in range(5)] == [first] * 5
    tasks.close()
