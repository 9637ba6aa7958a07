"""The cyclic collector is paused while a save runs (statestream._gc).

The objects a save's walk makes live until its commit, and each chunk a snapshot
copies or writes allocates a few more; with the collector on, they set off
collections that traversed them again and again and then the whole heap: a
``save_async`` of 20,000 small tensors blocked 0.9-1.0 s instead of 0.4-0.5, and
its background phase held the interpreter lock for 0.3 s more
(benchmarks/async_small.py). An asynchronous save pauses it from its start until
its outcome is known. These tests record, from inside the save, whether it ran.
"""

from __future__ import annotations

import collections
import gc
import multiprocessing
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

import statestream as ss
from statestream import _hooks
from statestream._gc import gc_paused


@pytest.fixture()
def collector_seen() -> Iterator[dict[str, list[bool]]]:
    """``gc.isenabled()`` at every chunk a snapshot copies or races, and at every
    chunk written."""
    seen: dict[str, list[bool]] = {"snapshot": [], "written": []}
    was = gc.isenabled()
    gc.enable()
    _hooks.register("async.snapshot_chunk", lambda: seen["snapshot"].append(gc.isenabled()))
    _hooks.register("save.chunk_written", lambda: seen["written"].append(gc.isenabled()))
    try:
        yield seen
    finally:
        _hooks.clear()
        if was:
            gc.enable()
        else:
            gc.disable()


def _state(n: int = 64) -> dict[str, np.ndarray]:
    return {f"p{i}": np.full(256, i, dtype=np.float32) for i in range(n)}


@pytest.mark.parametrize("lazy", [False, True])
def test_an_async_save_runs_with_the_collector_paused(
        tmp_path: Path, collector_seen: dict[str, list[bool]], lazy: bool) -> None:
    state = _state()
    # the first save races its writers; the next, with staging warm, copies at once
    for i in range(3):
        for v in collector_seen.values():
            v.clear()
        h = ss.save_async(tmp_path / f"c{i}", state, lazy=lazy)
        h.result()
        assert gc.isenabled(), i  # on again once the outcome is known
        assert collector_seen["snapshot"] and not any(collector_seen["snapshot"]), i
        assert collector_seen["written"] and not any(collector_seen["written"]), i
        time.sleep(0.2)  # let the save warm staging for the next
    np.testing.assert_array_equal(ss.load(tmp_path / "c2")["p63"], state["p63"])


def test_a_sync_save_runs_with_the_collector_paused(
        tmp_path: Path, collector_seen: dict[str, list[bool]]) -> None:
    ss.save(tmp_path / "c", _state())
    assert collector_seen["written"] and not any(collector_seen["written"])
    assert gc.isenabled()


def test_a_failed_snapshot_turns_the_collector_back_on(
        tmp_path: Path, collector_seen: dict[str, list[bool]]) -> None:
    def fail() -> None:
        raise RuntimeError("injected at a snapshot chunk")

    _hooks.register("async.snapshot_chunk", fail)
    with pytest.raises(RuntimeError, match="injected"):
        ss.save_async(tmp_path / "c", _state())
    assert gc.isenabled()
    assert not (tmp_path / "c").exists()


@pytest.mark.parametrize("lazy", [False, True])
def test_a_failed_background_phase_turns_the_collector_back_on(
        tmp_path: Path, collector_seen: dict[str, list[bool]], lazy: bool) -> None:
    def fail() -> None:
        raise OSError("injected after the writes")

    _hooks.register("save.data_synced", fail)
    h = ss.save_async(tmp_path / "c", _state(), lazy=lazy)
    with pytest.raises(OSError, match="injected"):
        h.result()
    assert gc.isenabled()
    assert not (tmp_path / "c").exists()


def test_a_collector_the_caller_turned_off_stays_off(tmp_path: Path,
                                                    collector_seen: dict[str, list[bool]]) -> None:
    gc.disable()
    ss.save_async(tmp_path / "a", _state()).result()
    ss.save(tmp_path / "b", _state())
    assert not gc.isenabled()


@pytest.mark.parametrize("lazy", [False, True])
def test_an_async_save_frees_what_it_built_before_the_collector_resumes(
        tmp_path: Path, collector_seen: dict[str, list[bool]], lazy: bool) -> None:
    # Objects alive when the collector resumes are traversed by its next
    # collections; a save of 20,000 arrays left 360,000 of them (its plan, tree,
    # manifest, chunk records), 0.05-0.1 s on a thread of the save. Counted while
    # the save's thread, its outcome reported, warms staging for the next save.
    state = _state(2000)
    ss.save_async(tmp_path / "warm", state, lazy=lazy).result()  # caches, threads
    warming, counted = threading.Event(), threading.Event()

    def hold() -> None:
        warming.set()
        counted.wait(30)

    _hooks.register("async.warming", hold)
    thresholds = gc.get_threshold()
    gc.collect()
    gc.set_threshold(10**9)  # no collection: everything alive stays young
    try:
        h = ss.save_async(tmp_path / "c", state, lazy=lazy)
        h.result()
        assert warming.wait(30)
        young = collections.Counter(type(o).__qualname__ for o in gc.get_objects(0))
    finally:
        gc.set_threshold(*thresholds)
        counted.set()
    assert sum(young.values()) < 1000, young.most_common(8)
    assert gc.isenabled()


def _report_collector(out: multiprocessing.SimpleQueue) -> None:  # type: ignore[type-arg]
    out.put(gc.isenabled())
    with gc_paused():  # the child's own pauses count from zero
        out.put(gc.isenabled())
    out.put(gc.isenabled())


@pytest.mark.skipif(sys.platform == "win32", reason="fork")
def test_a_child_forked_during_a_save_gets_the_collector_back(
        tmp_path: Path, collector_seen: dict[str, list[bool]]) -> None:
    # a data loader forking its workers while a save runs in the background: the
    # pause belongs to the parent's save, which the child does not have
    gate = threading.Event()
    _hooks.register("save.chunk_written", lambda: gate.wait(60))
    try:
        h = ss.save_async(tmp_path / "c", _state())
        assert not gc.isenabled()
        ctx = multiprocessing.get_context("fork")
        out = ctx.SimpleQueue()
        child = ctx.Process(target=_report_collector, args=(out,))
        child.start()
        child.join(60)
        assert child.exitcode == 0
        assert [out.get() for _ in range(3)] == [True, False, True]
    finally:
        gate.set()
    h.result()
    assert gc.isenabled()
