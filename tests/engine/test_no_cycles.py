"""Saves and loads free what they built by reference counting, not by the cyclic collector.

Walking a state of many arrays builds a few objects per array. When the job is
part of a reference cycle (a recursive closure, a callback bound to the job
that holds it), all of them wait for the next collection, and that collection
then runs on the caller's thread after the save has returned: 0.2-0.3 s for a
20,000-array state, a third of the whole save. These tests fail if any path
leaves a cycle behind again.
"""

from __future__ import annotations

import collections
import gc
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

import statestream as ss

N_ARRAYS = 300


@pytest.fixture()
def state() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {f"layer{i:03d}": rng.standard_normal(int(n), dtype=np.float32)
            for i, n in enumerate(rng.integers(16, 4096, size=N_ARRAYS))}


@pytest.fixture()
def saved_garbage() -> Iterator[Callable[[Callable[[], object]], collections.Counter[str]]]:
    """Run a call with the collector off; return the types of the cycles it left."""
    was = gc.isenabled()

    def run(call: Callable[[], object]) -> collections.Counter[str]:
        call()  # first use: imports, caches and thread pools are not garbage
        gc.collect()
        gc.disable()
        gc.set_debug(gc.DEBUG_SAVEALL)
        try:
            call()
            gc.collect()
            return collections.Counter(
                f"{type(o).__module__}.{type(o).__qualname__}" for o in gc.garbage)
        finally:
            gc.set_debug(0)
            gc.garbage.clear()
            gc.enable()

    yield run
    if not was:
        gc.disable()


def _ours(garbage: collections.Counter[str]) -> dict[str, int]:
    return {k: v for k, v in garbage.items() if k.startswith("statestream.")}


def _assert_clean(garbage: collections.Counter[str]) -> None:
    # Nothing of ours, and nothing that grows with the number of arrays.
    assert _ours(garbage) == {}, garbage.most_common(10)
    assert sum(garbage.values()) < N_ARRAYS, garbage.most_common(10)


def _fresh(tmp_path: Path, name: str) -> Callable[[], str]:
    count = [0]

    def path() -> str:
        count[0] += 1
        return str(tmp_path / f"{name}-{count[0]}")

    return path


def test_sync_save_leaves_no_cycles(tmp_path: Path, state, saved_garbage) -> None:
    nxt = _fresh(tmp_path, "s")
    _assert_clean(saved_garbage(lambda: ss.save(nxt(), state)))


@pytest.mark.parametrize("lazy", [False, True])
def test_async_save_leaves_no_cycles(tmp_path: Path, state, saved_garbage, lazy: bool) -> None:
    nxt = _fresh(tmp_path, "a")

    def call() -> None:
        h = ss.save_async(nxt(), state, lazy=lazy)
        h.result()

    _assert_clean(saved_garbage(call))


def test_compressed_and_incremental_saves_leave_no_cycles(tmp_path: Path, state,
                                                          saved_garbage) -> None:
    ss.save(tmp_path / "base", state)
    nxt = _fresh(tmp_path, "i")
    _assert_clean(saved_garbage(
        lambda: ss.save(nxt(), state, compression="zstd", base=tmp_path / "base")))


def test_loads_leave_no_cycles(tmp_path: Path, state, saved_garbage) -> None:
    ss.save(tmp_path / "ck", state)
    _assert_clean(saved_garbage(lambda: ss.load(tmp_path / "ck")))
    target = {k: np.zeros_like(v) for k, v in state.items()}
    _assert_clean(saved_garbage(lambda: ss.load(tmp_path / "ck", target=target)))
    _assert_clean(saved_garbage(lambda: ss.metadata(tmp_path / "ck")))


def test_the_check_sees_a_cycle(saved_garbage) -> None:
    """The fixture does catch a cycle (so the tests above can fail)."""

    class Loop:
        def __init__(self) -> None:
            self.me = self

    garbage = saved_garbage(lambda: [Loop() for _ in range(5)])
    assert sum(v for k, v in garbage.items() if k.endswith(".<locals>.Loop")) == 5
