"""Heartbeats, stalled-rank detection and the post-commit agreement, in one process."""

from __future__ import annotations

import threading
import warnings
from typing import Any

import pytest

from statestream.distributed import agree
from statestream.distributed._liveness import (
    Heartbeat,
    StoreLost,
    Watch,
    describe_ranks,
    find_stalled,
)
from statestream.errors import CollectiveTimeoutError, DistributedError


def test_heartbeat_beats_until_told_to_stop() -> None:
    beats = threading.Semaphore(0)
    going = threading.Event()
    going.set()
    hb = Heartbeat(beats.release, going.is_set, interval_s=0.01)
    for _ in range(3):  # the first beat on the caller's thread, then the thread's
        assert beats.acquire(timeout=30)
    going.clear()
    hb._thread.join(timeout=30)
    assert not hb.alive() and hb.error is None


def test_heartbeat_stops_when_the_store_fails() -> None:
    calls = [0]

    def beat() -> None:
        calls[0] += 1
        if calls[0] > 2:
            raise ConnectionResetError("store gone")

    hb = Heartbeat(beat, lambda: True, interval_s=0.01)
    hb._thread.join(timeout=30)
    assert not hb.alive() and isinstance(hb.error, ConnectionResetError)


def test_a_broken_store_fails_at_once() -> None:
    def beat() -> None:
        raise OSError("no store")

    with pytest.raises(OSError):
        Heartbeat(beat, lambda: True)


class _Counters:
    """Counters that move on every read for the ranks in ``moving``."""

    def __init__(self, moving: set[int], start: dict[int, int]) -> None:
        self.moving, self.values = moving, dict(start)

    def read(self, r: int) -> int | None:
        if r in self.moving:
            self.values[r] += 1
        return self.values.get(r)


def test_find_stalled_names_the_ranks_that_stopped() -> None:
    c = _Counters({1, 3}, {1: 5, 2: 9, 3: 1, 4: 0})  # 4 never beat: not named
    assert find_stalled(c.read, [1, 2, 3, 4], window_s=0.3, poll_s=0.01) == [2]


def test_find_stalled_returns_early_when_everyone_beats() -> None:
    c = _Counters({1, 2}, {1: 1, 2: 1})
    assert find_stalled(c.read, [1, 2], window_s=3600, poll_s=0.01) == []


class _VanishingStore(_Counters):
    """Counters whose store goes away after ``reads`` reads (its host process exited)."""

    def __init__(self, moving: set[int], start: dict[int, int], reads: int) -> None:
        super().__init__(moving, start)
        self.left = reads

    def read(self, r: int) -> int | None:
        self.left -= 1
        if self.left < 0:
            raise ConnectionResetError("Connection closed by peer")
        return super().read(r)


def test_find_stalled_names_the_stopped_ranks_seen_before_the_store_went_away() -> None:
    # rank 0 (the store's host) beat while watched, rank 1 did not, then the store left
    c = _VanishingStore({0}, {0: 4, 1: 7}, reads=20)
    with pytest.raises(StoreLost) as ei:
        find_stalled(c.read, [0, 1], window_s=3600, poll_s=0.01, min_seen_s=0.05)
    assert ei.value.ranks == [1]
    # watched too briefly for a live rank to have beaten: nobody can be named
    c = _VanishingStore({0}, {0: 4, 1: 7}, reads=4)
    with pytest.raises(ConnectionResetError):
        find_stalled(c.read, [0, 1], window_s=3600, poll_s=0.01, min_seen_s=3600)


def test_watch_stalled_only_after_dead_after_s() -> None:
    c = _Counters(set(), {1: 3})
    w = Watch(c.read, [1])
    w.update()
    assert w.stalled(3600) == [] and w.stalled(0) == [1] and w.unmoved() == [1]


def test_describe_ranks() -> None:
    assert describe_ranks([1]) == "rank 1"
    assert describe_ranks([1, 3]) == "ranks 1, 3"
    assert describe_ranks([0, 2], "process") == "processes 0, 2"


class _Broken:
    """A 2-rank collective whose all-gather fails the way a dead peer makes it fail."""

    def __init__(self, exc: BaseException, statuses: list[Any] | None = None) -> None:
        self.exc, self.statuses = exc, statuses

    rank = 1
    world_size = 2

    def all_gather_object(self, obj: Any) -> list[Any]:
        if self.statuses is not None:  # every rank in this rank's phase
            return [[obj[0], s, None] for s in self.statuses]
        raise self.exc


class _Flags:
    """A 3-rank collective whose peers failed as ``others`` say (None: they did not);
    it counts the calls agree makes."""

    rank = 0
    world_size = 3

    def __init__(self, others: list[str | None], fail: BaseException | None = None) -> None:
        self.others, self.fail, self.calls = others, fail, []  # type: list[str]

    def any_true(self, flag: bool) -> bool:
        self.calls.append("any_true")
        if self.fail is not None:
            raise self.fail
        return flag or any(o is not None for o in self.others)

    def all_gather_object(self, obj: Any) -> list[Any]:
        self.calls.append("all_gather_object")
        return [obj, *([obj[0], o, None] for o in self.others)]


def test_agree_gathers_statuses_only_when_some_rank_failed() -> None:
    ok = _Flags([None, None])
    agree(ok, "planning", None)  # type: ignore[arg-type]
    assert ok.calls == ["any_true"]
    peer = _Flags([None, "ValueError: bad leaf"])
    with pytest.raises(DistributedError, match="rank 2 failed during planning: ValueError"):
        agree(peer, "planning", None)  # type: ignore[arg-type]
    assert peer.calls == ["any_true", "all_gather_object"]
    mine = _Flags([None, None])
    with pytest.raises(DistributedError, match="rank 0 failed during planning") as ei:
        agree(mine, "planning", KeyError("x"))  # type: ignore[arg-type]
    assert isinstance(ei.value.__cause__, KeyError)
    dead = DistributedError("rank 1 died or disconnected during all_reduce (seen from rank 0)")
    broken = _Flags([None, None], fail=dead)
    with pytest.raises(DistributedError, match="rank 1 died.*while agreeing on planning"):
        agree(broken, "planning", None)  # type: ignore[arg-type]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        agree(_Flags([None, None], fail=dead), "committing", None,  # type: ignore[arg-type]
              committed=lambda: True)
    assert any("rank 1 died" in str(w.message) for w in caught)


def test_agree_adds_phase_and_outcome_to_a_collective_failure() -> None:
    dead = DistributedError("rank 0 died or disconnected during all_gather (seen from rank 1)")
    with pytest.raises(DistributedError) as ei:
        agree(_Broken(dead), "writing data", None)  # type: ignore[arg-type]
    msg = str(ei.value)
    assert msg.startswith("rank 0 died") and "writing data" in msg
    assert msg.endswith("nothing was committed")
    late = CollectiveTimeoutError("rank 1 waited more than 3s")
    with pytest.raises(CollectiveTimeoutError):
        agree(_Broken(late), "committing", None)  # type: ignore[arg-type]


def test_agree_after_commit_is_success_when_the_checkpoint_is_committed() -> None:
    dead = DistributedError("rank 0 died or disconnected during all_gather (seen from rank 1)")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        agree(_Broken(dead), "committing", None,  # type: ignore[arg-type]
              committed=lambda: True)
    assert any("rank 0 died" in str(w.message) and issubclass(w.category, RuntimeWarning)
               for w in caught)
    # not committed, cannot tell, or this rank failed itself: the save failed
    for committed in (lambda: False, lambda: 1 / 0):
        with pytest.raises(DistributedError):
            agree(_Broken(dead), "committing", None,  # type: ignore[arg-type]
                  committed=committed)
    with pytest.raises(DistributedError):
        agree(_Broken(dead), "committing", ValueError("mine"),  # type: ignore[arg-type]
              committed=lambda: True)
    # a rank that reported a failure is a failed save, whatever storage says
    with pytest.raises(DistributedError) as ei:
        agree(_Broken(dead, [None, "StorageError: disk full"]), "committing",  # type: ignore[arg-type]
              None, committed=lambda: True)
    assert "disk full" in str(ei.value)


def test_interpreter_exit_stops_and_joins_the_heartbeat(tmp_path) -> None:
    """A beat that comes back from the store's C++ client while the interpreter
    finalizes aborts the process ("terminate called without an active exception",
    exit 134), after a job that succeeded; found with a 2-process doc example whose
    rank 1 returned right after a save. Exit stops every heartbeat and waits for it."""
    import subprocess
    import sys
    import textwrap
    from pathlib import Path

    pytest.importorskip("torch")
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent("""
        import atexit, threading

        def _check():  # registered before statestream's, so it runs after it
            alive = [t.name for t in threading.enumerate() if "heartbeat" in t.name]
            print("ALIVE" if alive else "ENDED", flush=True)

        atexit.register(_check)
        import datetime
        import torch.distributed as dist
        from statestream.distributed._liveness import Heartbeat

        store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=30))
        # beats back to back: one is nearly always in flight in the C++ client
        hb = Heartbeat(lambda: store.add("beat", 1), lambda: True, interval_s=0.0001)
    """))
    src = str(Path(__file__).resolve().parents[2] / "src")
    for _ in range(3):
        r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                           timeout=120, env={"PYTHONPATH": src, "PATH": "/usr/bin:/bin"})
        assert r.returncode == 0, r.stderr[-2000:]
        assert r.stdout.strip() == "ENDED", (r.stdout, r.stderr[-2000:])
