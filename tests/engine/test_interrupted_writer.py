"""Ctrl-C while ``ss.save`` waits for its writer threads: no writer outlives the save.

Found with an object store (each part slow): the interrupt landed in ``close()``'s
``Thread.join()``; on Python 3.11 CPython's bpo-45274 workaround then marked the
still-running writer stopped, so the abort's join returned at once, the save deleted
its (still empty) root and raised, and the writer completed its multipart upload
right after: an orphan data object, and a thread outliving the save. Here a local
file writer is held inside ``finish()`` instead; the transaction's abort must come
only after every writer is out of its file.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from types import FrameType

import numpy as np
import pytest

import statestream as ss
from statestream.storage import _local, _local_write

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals"),
]


@pytest.fixture(autouse=True)
def _sigint_raises() -> Iterator[None]:
    # Ctrl-C must raise KeyboardInterrupt here whatever ran before in this process
    handler = signal.signal(signal.SIGINT, signal.default_int_handler)
    mask = signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGINT])
    yield
    signal.pthread_sigmask(signal.SIG_SETMASK, mask)
    signal.signal(signal.SIGINT, handler)


def _main_stack() -> list[str]:
    frame: FrameType | None = sys._current_frames().get(threading.main_thread().ident or 0)
    names = []
    while frame is not None:
        names.append(frame.f_code.co_name)
        frame = frame.f_back
    return names


def _writers_alive() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("statestream-write")]


def test_ctrl_c_while_a_writer_finishes_waits_for_it_before_the_cleanup(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    in_finish = threading.Event()  # a writer is inside finish()
    gate = threading.Event()       # lets it go on
    finishing = [0]                # writers inside finish() right now
    seen_at_abort: list[int] = []  # finishing, when the save's transaction aborted
    real_finish = _local_write._LocalFileWriter.finish
    real_abort = _local._LocalWriteTransaction.abort

    def finish(self: _local_write._LocalFileWriter) -> None:
        finishing[0] += 1
        try:
            in_finish.set()
            assert gate.wait(60)
            real_finish(self)
        finally:
            finishing[0] -= 1

    def abort(self: _local._LocalWriteTransaction) -> None:
        seen_at_abort.append(finishing[0])
        gate.set()  # (before the fix: the writer was still held here)
        real_abort(self)

    monkeypatch.setattr(_local_write._LocalFileWriter, "finish", finish)
    monkeypatch.setattr(_local._LocalWriteTransaction, "abort", abort)

    def interrupt() -> None:
        assert in_finish.wait(60)
        while "_join" not in _main_stack():  # close() waits for the held writer
            if gate.wait(0.005):
                return
        os.kill(os.getpid(), signal.SIGINT)
        # Fixed, the abort waits for the writer (an Event's wait, in _join, in
        # abort): let it finish then. Unfixed, the abort's Thread.join() returned
        # at once and the transaction's abort lets it go.
        while not gate.wait(0.005):
            stack = _main_stack()
            if "abort" in stack and "_join" in stack and stack[0] == "wait":
                gate.set()

    helper = threading.Thread(target=interrupt, daemon=True)
    helper.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            ss.save(tmp_path / "a", {"w": np.arange(1 << 16, dtype=np.float64)})
        # the cleanup ran only once the writer was out of its file, and no writer
        # thread is left running
        assert seen_at_abort == [0]
        assert _writers_alive() == []
    finally:
        gate.set()
        helper.join()
    monkeypatch.undo()
    assert sorted(os.listdir(tmp_path)) == []  # nothing of the save left
    ss.save(tmp_path / "b", {"w": np.ones(3)})  # and the next save runs
    assert ss.load(tmp_path / "b")["w"].tolist() == [1.0] * 3
