"""A synchronous ``ss.save`` queues behind the ``save_async`` in flight, and its own
buffers share one memory budget with the staging buffers kept between saves.

Before, ``ss.save`` ran beside a save in flight: the two held two budgets at once
(1 GiB state, 256 MiB budget, a sync save of a transposed view: peak RSS +501 MiB,
benchmarks/sync_behind_async.py), and a sync save to the path of the save in flight
committed over it. Queued but with the async save's idle staging kept, it still took
+493 MiB: its copies came on top of a budget of idle buffers. The hold at the commit
point only makes "in flight" certain; timeouts guard against hangs.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import statestream as ss
from statestream import _hooks

_WAIT_S = 120
MiB = 1 << 20


class _Held:
    """Holds the first async save at its commit until a later save shows up: a sync
    save queued behind it (which marks it superseded) or one walking beside it."""

    def __init__(self) -> None:
        self.handle: list[ss.SaveHandle] = []
        self.walked = threading.Event()
        self.held_once = False

    def hold(self) -> None:
        if threading.current_thread().name != "statestream-save" or self.held_once:
            return  # the sync save's own commit, or a later one
        self.held_once = True
        deadline = time.monotonic() + _WAIT_S
        while not self.walked.wait(0.01) and time.monotonic() < deadline:
            if self.handle and self.handle[0]._superseded.is_set():
                return

    def __enter__(self) -> _Held:
        _hooks.register("commit.manifest_written", self.hold)
        return self

    def __exit__(self, *exc: object) -> None:
        _hooks.clear()
        self.walked.set()


class _Recorder:
    """A stateful value: records, when a save walks it, whether ``handle`` was done."""

    def __init__(self, held: _Held) -> None:
        self.held = held
        self.seen: list[bool] = []

    def state_dict(self) -> dict[str, Any]:
        self.seen.append(self.held.handle[0].done())
        self.held.walked.set()
        return {"x": np.ones(3)}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        pass


def test_a_sync_save_starts_after_the_async_save_in_flight(tmp_path: Path) -> None:
    with _Held() as held:
        h = ss.save_async(tmp_path / "a", {"w": np.arange(1 << 16, dtype=np.float64)})
        held.handle.append(h)
        rec = _Recorder(held)
        ss.save(tmp_path / "b", {"r": rec})
    assert rec.seen == [True]  # walked beside the async save before: [False]
    h.result(timeout=_WAIT_S)
    assert ss.verify(tmp_path / "a").ok and ss.verify(tmp_path / "b").ok


@pytest.mark.parametrize("overwrite", [False, True])
def test_a_sync_save_to_the_path_in_flight_follows_the_rules_of_a_later_save(
        tmp_path: Path, overwrite: bool) -> None:
    # as a second save_async to the same path: after the first has committed, so
    # refused without overwrite, the later state with it (before, the sync save
    # committed first and the async save's commit then failed or replaced it)
    p = tmp_path / "ck"
    with _Held() as held:
        h = ss.save_async(p, {"w": np.zeros(4)})
        held.handle.append(h)
        if overwrite:
            ss.save(p, {"w": np.ones(4)}, overwrite=True)
        else:
            with pytest.raises(ss.CheckpointExistsError):
                ss.save(p, {"w": np.ones(4)})
    h.result(timeout=_WAIT_S)
    assert ss.load(p)["w"].tolist() == [float(overwrite)] * 4


def test_save_async_from_a_sync_saves_progress_callback_is_refused_not_a_deadlock(
        tmp_path: Path) -> None:
    # a sync save holds the start lock while it runs: a save_async on its writer
    # thread would wait for it, which waits for that thread
    seen: list[BaseException] = []

    def progress(done: int, total: int) -> None:
        if not seen:
            try:
                ss.save_async(tmp_path / "inner", {"x": np.ones(2)}).result()
                seen.append(AssertionError("save_async ran inside a sync save"))
            except ss.CheckpointError as exc:
                seen.append(exc)
            ss.save(tmp_path / "sync", {"x": np.ones(2)})  # a sync save there is fine

    ss.save(tmp_path / "outer", {"w": np.arange(1 << 16, dtype=np.float64)},
            progress=progress)
    assert seen and "thread of the save in flight" in str(seen[0]), seen
    assert ss.load(tmp_path / "sync")["x"].tolist() == [1.0, 1.0]
    assert not (tmp_path / "inner").exists()


_CHILD = r"""
import json, os, sys
import numpy as np
import statestream as ss
d, budget = sys.argv[1], int(sys.argv[2])
def hwm():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
n = 64 << 20  # 256 MiB of float32, twice
state = {f"w{i}": np.full(n // 8, i, np.float32) for i in range(8)}
big = np.arange(n, dtype=np.float32).reshape(8192, 8192)
io, mem = ss.IOOptions(num_threads=2), ss.MemoryOptions(memory_budget_bytes=budget)
ss.save(os.path.join(d, "warm"), {"x": np.ones(8)})
before = hwm()
h = ss.save_async(os.path.join(d, "a"), state, io=io, memory=mem)
ss.save(os.path.join(d, "b"), {"t": big.T}, io=io, memory=mem)  # every chunk a copy
h.result()
growth = hwm() - before
assert np.array_equal(ss.load(os.path.join(d, "b"))["t"], big.T)
print(json.dumps({"growth": growth}))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_a_sync_save_right_after_save_async_stays_within_one_budget(tmp_path: Path) -> None:
    # Measured in a fresh process (VmHWM). The sync save's copies (a transposed view)
    # are charged to its budget; they came on top of the async save's staged
    # copies (beside it) or of its idle staging (queued): two budgets
    budget = 96 * MiB
    r = subprocess.run([sys.executable, "-c", _CHILD, str(tmp_path), str(budget)],
                       capture_output=True, text=True, timeout=600, check=False)
    assert r.returncode == 0, r.stderr[-3000:]
    growth = json.loads(r.stdout.strip().splitlines()[-1])["growth"]
    # the budget, one 8 MiB bounce buffer per data file, slack for the interpreter
    bound = budget + 2 * 8 * MiB + 16 * MiB
    assert growth < bound, f"peak RSS grew by {growth / MiB:.0f} MiB"


class _SavesInside:
    """A stateful value whose state_dict() saves (walked on the caller's thread)."""

    def __init__(self, path: Path, use_async: bool) -> None:
        self.path, self.use_async = path, use_async
        self.seen: list[BaseException] = []

    def state_dict(self) -> dict[str, Any]:
        try:
            if self.use_async:
                ss.save_async(self.path, {"x": np.ones(2)}).result()
            else:
                ss.save(self.path, {"x": np.ones(2)})
        except ss.CheckpointError as exc:
            self.seen.append(exc)
        return {"x": np.zeros(3)}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        pass


def _save_then_wait(path: Path, state: Any, outer_async: bool) -> None:
    if outer_async:
        ss.save_async(path, state).result()
    else:
        ss.save(path, state)


@pytest.mark.parametrize("outer_async", [False, True], ids=["in-save", "in-save_async"])
@pytest.mark.parametrize("use_async", [False, True], ids=["save", "save_async"])
def test_a_save_from_a_state_dict_that_a_save_walks_is_not_a_deadlock(
        tmp_path: Path, use_async: bool, outer_async: bool) -> None:
    # ss.save and save_async's start hold the start lock on the caller's thread, which
    # also walks the state: a save there waited for that lock forever (save_async in
    # save_async's walk did before too). ss.save runs at once (as on a save's own
    # thread); save_async is refused. The thread and its timeout only guard a hang.
    inner = _SavesInside(tmp_path / "inner", use_async)
    t = threading.Thread(target=_save_then_wait,
                         args=(tmp_path / "outer", {"s": inner}, outer_async), daemon=True)
    t.start()
    t.join(_WAIT_S)
    assert not t.is_alive(), "ss.save hung"
    assert ss.verify(tmp_path / "outer").ok
    if use_async:
        assert inner.seen and "thread of the save in flight" in str(inner.seen[0])
        assert not (tmp_path / "inner").exists()
    else:
        assert not inner.seen and ss.load(tmp_path / "inner")["x"].tolist() == [1.0, 1.0]
