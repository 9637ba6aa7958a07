"""The manager's lease on a local directory, and what it cleans when it opens."""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import statestream as ss
from statestream import _hooks
from statestream.storage import LocalStorage, _local_lease, set_backend

_HOLDER = """
import sys, time
import statestream as ss
mgr = ss.CheckpointManager(sys.argv[1])
print("HOLDING", flush=True)
time.sleep(600)
"""

_WRITER = """
import sys, time
from statestream.storage import LocalStorage, set_backend
txn = LocalStorage().begin_write(sys.argv[1], overwrite=False)
txn.create_file("data/r0-0.bin", 3).write_at([b"abc"], 0)
print("WRITING", flush=True)
time.sleep(600)
"""


def _child(code: str, arg: str, ready: str) -> subprocess.Popen[str]:
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(code), arg],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline().strip()
    if line != ready:
        proc.kill()
        pytest.fail(f"child did not start: {line!r} {proc.communicate()[1]}")
    return proc


def test_a_killed_managers_local_lease_ends_with_it(tmp_path: Path) -> None:
    proc = _child(_HOLDER, str(tmp_path), "HOLDING")
    try:
        with pytest.raises(ss.ManagerLockedError, match=f"pid {proc.pid}"):
            ss.CheckpointManager(tmp_path)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.communicate()
    with ss.CheckpointManager(tmp_path) as mgr:  # at once: no ttl to wait out
        assert not mgr.read_only
        mgr.save(1, {"w": np.arange(3)})


def test_a_local_lock_refusal_does_not_say_to_wait_for_an_expiry(tmp_path: Path) -> None:
    """An flock has no expiry to wait for: it ended with its holder's process if that
    had crashed, so the refusal says the holder is running."""
    with ss.CheckpointManager(tmp_path):
        with pytest.raises(ss.ManagerLockedError) as ei:
            ss.CheckpointManager(tmp_path)
    msg = str(ei.value)
    assert "expire" not in msg
    assert f"pid {os.getpid()}" in msg and "still running" in msg


@pytest.mark.parametrize("before", ["a fresh lock file", "a released lock"])
def test_a_refusal_names_a_winner_that_has_not_written_its_name_yet(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, before: str) -> None:
    """Of two managers opening at once, the loser may read the lock file after the
    winner locked it and before it wrote its name there: it reads again, and names
    the winner, not "an unknown process" (an empty file) or the holder before it."""
    if before == "a released lock":
        ss.CheckpointManager(tmp_path).close()
    fd = os.open(tmp_path / ".statestream.lock", os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # the winner; its name comes next

        def winner_writes_its_name() -> None:
            os.pwrite(fd, b"pid 7 on winner", 0)

        monkeypatch.setattr(_local_lease, "_pause", winner_writes_its_name)
        with pytest.raises(ss.ManagerLockedError, match="held by pid 7 on winner "):
            ss.CheckpointManager(tmp_path)
    finally:
        os.close(fd)


_FORKING_HOLDER = """
import sys, time, multiprocessing as mp
import numpy as np
import statestream as ss

ctx = mp.get_context("fork")
ready = ctx.Event()

def child():
    ready.set()
    time.sleep(600)

mgr = ss.CheckpointManager(sys.argv[1], async_save=False)
mgr.save(1, {"w": np.arange(3)})
if sys.argv[2] == "rawclose":  # a fork in C, which runs no at-fork handler
    import ctypes, os, signal
    pid = ctypes.PyDLL(None).fork()
    if pid == 0:
        time.sleep(600)
        os._exit(0)
    kill = lambda: os.kill(pid, signal.SIGKILL)
else:
    p = ctx.Process(target=child, daemon=True)  # a DataLoader worker, say
    p.start()
    ready.wait()  # the child runs
    kill = p.kill
if sys.argv[2].endswith("close"):
    mgr.close()
    try:
        ss.CheckpointManager(sys.argv[1]).close()
        print("REOPENED", flush=True)
    except ss.ManagerLockedError as exc:
        print("LOCKED", exc, flush=True)
    kill()
else:
    print("HOLDING", p.pid, flush=True)
    time.sleep(600)
"""


def _forking_holder(tmp_path: Path, mode: str) -> tuple[subprocess.Popen[str], str]:
    """Run :data:`_FORKING_HOLDER` in ``mode``; its first line."""
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(_FORKING_HOLDER),
                             str(tmp_path), mode],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline().strip()
    if not line:
        proc.kill()
        pytest.fail(f"the holder failed: {proc.communicate()[1]}")
    return proc, line


@pytest.mark.parametrize("mode", ["close", "rawclose"])
def test_close_frees_the_directory_while_a_forked_child_lives(tmp_path: Path,
                                                               mode: str) -> None:
    """A child forked while the manager is open (fork copies the lock's fd, which
    shares the lock) does not keep the directory locked after close(): a Python fork
    closes its copy, and close() unlocks even where a copy lives on (``rawclose``: a
    fork by C code, which runs no at-fork handler)."""
    proc, line = _forking_holder(tmp_path, mode)
    proc.communicate()
    assert line == "REOPENED"


def test_a_forked_child_does_not_keep_a_killed_managers_lock(tmp_path: Path) -> None:
    """The lock ends with the manager's process even while a child it forked lives on."""
    proc, line = _forking_holder(tmp_path, "kill")
    child = int(line.split()[1])
    try:
        proc.send_signal(signal.SIGKILL)
        proc.wait()  # not communicate(): the child holds the pipes open
        assert os.path.exists(f"/proc/{child}")  # the forked child is alive
        with ss.CheckpointManager(tmp_path) as mgr:
            assert mgr.steps() == [1]
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(child, signal.SIGKILL)
        proc.communicate()


def test_opening_spares_a_live_writers_staging(tmp_path: Path) -> None:
    step = tmp_path / f"step_{5:010d}"
    proc = _child(_WRITER, str(step), "WRITING")
    try:
        (live,) = [n for n in os.listdir(tmp_path) if ".tmp-" in n]
        with ss.CheckpointManager(tmp_path) as mgr:
            assert live in os.listdir(tmp_path)
            assert mgr.steps() == []
    finally:
        proc.kill()
        proc.wait()
    with ss.CheckpointManager(tmp_path):  # its writer is dead now
        assert live not in os.listdir(tmp_path)


class _Remap:
    """A new backend for ``remap://`` URLs: another directory tree, through LocalStorage."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.inner = LocalStorage()
        self.capabilities = self.inner.capabilities
        self.calls: list[str] = []

    def _p(self, url: str) -> str:
        assert url.startswith("remap://"), url
        return str(self.root / url[len("remap://"):])

    def __getattr__(self, op: str) -> Any:
        fn = getattr(self.inner, op)

        def call(path: Any, *args: Any, **kw: Any) -> Any:
            self.calls.append(op)
            return fn(path if op == "remove_leftover" else self._p(path), *args, **kw)

        return call


def test_the_manager_works_on_a_new_backend(tmp_path: Path) -> None:
    """The manager uses the storage protocol only: a backend for a new scheme is enough."""
    backend = _Remap(tmp_path)
    set_backend("remap", backend)  # type: ignore[arg-type]
    try:
        with ss.CheckpointManager("remap://runs/a", keep_policy=ss.KeepLatest(2)) as mgr:
            for step in range(4):
                mgr.save(step, {"w": np.full(3, step)})
            mgr.wait()
            assert mgr.steps() == [2, 3]
            assert int(mgr.load()["w"][0]) == 3
            with pytest.raises(ss.ManagerLockedError):
                ss.CheckpointManager("remap://runs/a")
    finally:
        set_backend("remap", None)
    assert sorted(os.listdir(tmp_path / "runs" / "a")) == [
        ".statestream.lock", f"step_{2:010d}", f"step_{3:010d}"]
    assert {"acquire_lease", "leftovers", "list", "is_committed", "delete",
            "begin_write"} <= set(backend.calls)


_SAVER_HOLDER = """
import sys, time
import numpy as np
import statestream as ss
mgr = ss.CheckpointManager(sys.argv[1], async_save=False)
mgr.save(5, {"w": np.arange(3)})
print("HOLDING", flush=True)
time.sleep(600)
"""


@pytest.mark.parametrize("remove", ["directory", "lock file"])
def test_a_manager_whose_lock_was_removed_stops_saving_and_deleting(tmp_path: Path,
                                                                     remove: str) -> None:
    run = tmp_path / "run"
    mgr = ss.CheckpointManager(run, keep_policy=ss.KeepLatest(1), async_save=False)
    mgr.save(1, {"w": np.arange(3)})
    if remove == "directory":
        shutil.rmtree(run)
    else:
        os.unlink(run / ".statestream.lock")
    # another job's manager (a real process) now holds a new lock there and saves
    holder = _child(_SAVER_HOLDER, str(run), "HOLDING")
    try:
        with pytest.raises(ss.ManagerLockedError, match="removed or moved"):
            mgr.save(2, {"w": np.arange(3)})
        with pytest.raises(ss.ManagerLockedError):
            mgr.wait()  # the keep policy deletes nothing of the other manager's
        kept = [5] if remove == "directory" else [1, 5]
        assert [s for s in kept if LocalStorage().is_committed(str(run / f"step_{s:010d}"))
                ] == kept
    finally:
        holder.kill()
        holder.communicate()
        with pytest.raises(ss.ManagerLockedError):
            mgr.close()
    assert not (run / "step_0000000002").exists()
    assert not _open_fds_to(run / ".statestream.lock")  # close() let go of the old lock


@pytest.mark.parametrize("async_save", [False, True])
def test_a_save_whose_lock_was_taken_meanwhile_does_not_commit(tmp_path: Path,
                                                               async_save: bool) -> None:
    """The lease is checked again as the save commits: a manager whose lock file was
    removed while it saved, and another manager opened the directory meanwhile, must
    not commit its step there (until 2026-12-08 it did, in a directory it no longer
    held, and raised ManagerLockedError only after)."""
    run = tmp_path / "run"
    mgr = ss.CheckpointManager(run, async_save=async_save)
    other: list[ss.CheckpointManager] = []

    def taken_over() -> None:
        _hooks.clear()
        os.unlink(run / ".statestream.lock")
        other.append(ss.CheckpointManager(run))  # locks a new file there

    try:
        mgr.save(1, {"w": np.arange(3)})
        mgr.wait()
        _hooks.register("commit.marker_written", taken_over)
        with pytest.raises(ss.ManagerLockedError, match="removed or moved"):
            mgr.save(2, {"w": np.arange(4)})
            mgr.wait()
    finally:
        _hooks.clear()
        with contextlib.suppress(ss.ManagerLockedError):
            mgr.close()
    (new,) = other
    with new:
        assert new.steps() == [1]
        assert [n for n in os.listdir(run) if n != ".statestream.lock"] == [f"step_{1:010d}"]
        assert new.load()["w"].tolist() == [0, 1, 2]
        new.save(2, {"w": np.arange(2)})
        new.wait()
        assert new.load(2)["w"].tolist() == [0, 1]


def _open_fds_to(path: Path) -> list[str]:
    """This process's open file descriptors on ``path`` (even once it is unlinked)."""
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.removesuffix(" (deleted)") == str(path):
            out.append(fd)
    return out
