"""A KeyboardInterrupt inside save_async's thread starts, and a fork() while a save
is in flight, leave no save that never settles.

A save that never settles hangs the next ``save_async`` (one save at a time) and
the interpreter's exit (pending saves are completed then); one that never resumes
the cyclic collector it paused leaves the process without it. Found by an exploratory
run with real SIGINTs: the interrupt landed in ``Thread.start()`` of a writer, the
abort then joined a thread that never started (``RuntimeError: cannot join thread
before it is started`` in place of the KeyboardInterrupt), and the handle stayed
pending. Timeouts only guard against hangs.
"""

from __future__ import annotations

import gc
import multiprocessing
import os
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

import statestream as ss
from statestream import _hooks

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="fork")

_WAIT_S = 120


@pytest.fixture(autouse=True)
def _collector_resumed() -> Iterator[None]:
    """Every test ends with the cyclic collector as it began (statestream._gc)."""
    was = gc.isenabled()
    yield
    assert gc.isenabled() == was, "a save left the cyclic collector paused"


def _interrupt_start(monkeypatch: pytest.MonkeyPatch, prefix: str, *, after: bool) -> None:
    """The first start() of a thread named ``prefix...`` raises KeyboardInterrupt,
    before the thread exists or (``after``) once it runs, as a SIGINT can."""
    real = threading.Thread.start
    fired: list[bool] = []

    def start(self: threading.Thread) -> None:
        if self.name.startswith(prefix) and not fired:
            fired.append(True)
            if after:
                real(self)
            raise KeyboardInterrupt
        real(self)

    monkeypatch.setattr(threading.Thread, "start", start)


def _state() -> dict[str, np.ndarray]:
    return {"w": np.arange(1 << 18, dtype=np.float64), "b": np.ones(7)}


@pytest.mark.parametrize("lazy", [False, True])
def test_an_interrupted_writer_start_aborts_the_save(tmp_path: Path, lazy: bool,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    _interrupt_start(monkeypatch, "statestream-write", after=False)
    if lazy:  # the writers start on the save's own thread: its error, not an interrupt
        h = ss.save_async(tmp_path / "a", _state(), lazy=True)
        with pytest.raises(KeyboardInterrupt):  # the writer start's, raised by result()
            h.result(timeout=_WAIT_S)
    else:
        with pytest.raises(KeyboardInterrupt):
            ss.save_async(tmp_path / "a", _state())
    monkeypatch.undo()
    ss.save_async(tmp_path / "b", _state()).result(timeout=_WAIT_S)  # not stuck behind it
    assert not (tmp_path / "a").exists()
    assert sorted(os.listdir(tmp_path)) == ["b"]  # no staging directory left
    assert ss.load(tmp_path / "b")["w"][-1] == (1 << 18) - 1


@pytest.mark.parametrize("after", [False, True], ids=["never-started", "started"])
def test_an_interrupted_save_thread_start_settles_the_save(
        tmp_path: Path, after: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    _interrupt_start(monkeypatch, "statestream-save", after=after)
    with pytest.raises(KeyboardInterrupt):
        ss.save_async(tmp_path / "a", _state())
    monkeypatch.undo()
    ss.save_async(tmp_path / "b", _state()).result(timeout=_WAIT_S)
    if after:  # the thread ran: the save went on and committed
        assert ss.load(tmp_path / "a")["b"].tolist() == [1.0] * 7
    else:  # it never ran: abandoned, nothing committed, nothing left
        assert sorted(os.listdir(tmp_path)) == ["b"]


def _child_saves(path: str, out: multiprocessing.SimpleQueue) -> None:  # type: ignore[type-arg]
    ss.save_async(path, {"x": np.ones(3)}).result(timeout=_WAIT_S)
    out.put("saved")
    sys.exit(0)  # the exit drain must not wait for the parent's save


def test_a_child_forked_during_a_save_does_not_wait_for_it(tmp_path: Path) -> None:
    gate = threading.Event()
    _hooks.register("save.chunk_written", lambda: gate.wait(_WAIT_S))
    try:
        h = ss.save_async(tmp_path / "parent", _state())  # in flight, held by the hook
        ctx = multiprocessing.get_context("fork")
        out = ctx.SimpleQueue()
        child = ctx.Process(target=_child_saves, args=(str(tmp_path / "child"), out))
        _hooks.clear()  # the child's own save is not held
        child.start()
        child.join(_WAIT_S)
        alive = child.is_alive()
        if alive:
            child.kill()
        assert not alive and child.exitcode == 0 and out.get() == "saved"
    finally:
        _hooks.clear()
        gate.set()
    h.result(timeout=_WAIT_S)
    assert ss.load(tmp_path / "child")["x"].tolist() == [1.0] * 3
    assert ss.load(tmp_path / "parent")["b"].tolist() == [1.0] * 7


def test_save_async_from_a_progress_callback_is_refused_not_a_deadlock(
        tmp_path: Path) -> None:
    # the callback runs on the save's writer thread: a save_async there waited for the
    # save in flight, which waited for that thread
    seen: list[BaseException] = []

    def progress(done: int, total: int) -> None:
        if not seen:
            try:
                ss.save_async(tmp_path / "inner", {"x": np.ones(2)})
            except ss.CheckpointError as exc:
                seen.append(exc)
            ss.save(tmp_path / "sync", {"x": np.ones(2)})  # a sync save there is fine

    ss.save_async(tmp_path / "outer", _state(), progress=progress).result(timeout=_WAIT_S)
    assert seen and "thread of the save in flight" in str(seen[0]), seen
    assert ss.load(tmp_path / "sync")["x"].tolist() == [1.0, 1.0]
    assert not (tmp_path / "inner").exists()


@pytest.mark.parametrize("lazy", [False, True])
def test_waiting_for_the_save_from_its_progress_callback_is_refused_not_a_hang(
        tmp_path: Path, lazy: bool) -> None:
    # the callback runs on the save's writer thread: handle.result() there waited for
    # the writers to finish, which waited for the callback (forever without a timeout).
    # The first call that gets past `started` holds its writer, so the save is unfinished.
    handle: list[ss.SaveHandle] = []
    started = threading.Event()
    seen: list[BaseException] = []

    def progress(done: int, total: int) -> None:
        if seen or not started.wait(_WAIT_S):
            return
        try:
            handle[0].result(timeout=_WAIT_S)
            seen.append(AssertionError("result() returned on the save's own thread"))
        except ss.CheckpointError as exc:
            seen.append(exc)

    h = ss.save_async(tmp_path / "ck", _state(), progress=progress, lazy=lazy)
    handle.append(h)
    started.set()
    h.result(timeout=_WAIT_S)
    assert seen and "called on a thread of a save in flight" in str(seen[0]), seen
    assert ss.verify(tmp_path / "ck").ok


@pytest.mark.parametrize("lazy", [False, True])
def test_an_interrupt_between_queueing_and_the_thread_settles_the_save(
        tmp_path: Path, lazy: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    # the window after the handle is queued and before its thread is made (where the
    # snapshot of a non-lazy save runs): the next save_async and the exit waited for
    # a handle nothing would settle
    import statestream.engine._start as start

    def interrupted(job: object, *, run_snapshot: bool) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(start, "_spawn", interrupted)
    with pytest.raises(KeyboardInterrupt):
        ss.save_async(tmp_path / "a", _state(), lazy=lazy)
    monkeypatch.undo()
    ss.save_async(tmp_path / "b", _state()).result(timeout=_WAIT_S)  # hung here
    with pytest.raises(ss.CheckpointError):
        ss.load(tmp_path / "a")
    assert ss.load(tmp_path / "b")["b"].tolist() == [1.0] * 7


def test_save_async_from_two_threads_runs_one_save_at_a_time(tmp_path: Path) -> None:
    # both callers waited for the same save in flight, then both saves ran at once
    # (and the exit drain joined only the last one's thread)
    gate = threading.Event()
    held = threading.Event()
    lock = threading.Lock()
    running: list[int] = []
    most: list[int] = [0]

    def hold_first() -> None:  # the first save stays in flight until both threads wait
        if not gate.is_set():
            held.set()
            gate.wait(_WAIT_S)

    def planned() -> None:
        with lock:
            running.append(1)
            most[0] = max(most[0], len(running))

    def committed() -> None:
        with lock:
            running.pop()

    _hooks.register("commit.marker_written", hold_first)
    _hooks.register("save.planned", planned)
    _hooks.register("commit.renamed", committed)
    try:
        first = ss.save_async(tmp_path / "first", _state())
        assert held.wait(_WAIT_S)
        handles: list[ss.SaveHandle] = []
        callers = [threading.Thread(target=lambda i=i: handles.append(
            ss.save_async(tmp_path / f"t{i}", {"x": np.full(1 << 16, i)})))
            for i in range(2)]
        for t in callers:
            t.start()
        threading.Event().wait(0.3)  # both callers reach the wait for the first save
        gate.set()
        for t in callers:
            t.join(_WAIT_S)
        first.result(timeout=_WAIT_S)
        for h in handles:
            h.result(timeout=_WAIT_S)
    finally:
        gate.set()
        _hooks.clear()
    assert len(handles) == 2 and most[0] == 1, most
    for i in range(2):
        assert ss.load(tmp_path / f"t{i}")["x"][0] == i
