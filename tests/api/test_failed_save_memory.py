"""A failed ``save_async`` keeps nothing of the state, and ``result()`` pins no caller.

The save fails for real where its data is written (the storage's first ``write_at``
fails with ENOSPC, ``faults.faulty_backend``). Until 2026-12-07 the engine kept the
last handle in a module global until the next ``save_async``: its error's traceback
held the frames the error went through, and their locals held the state; and each
``result()`` re-raised the same error object, whose traceback grew by the frames of
every caller (kept alive with their locals).
"""

from __future__ import annotations

import gc
import traceback
import weakref
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

import statestream as ss
from statestream.testing import faults


@pytest.fixture
def full_disk(tmp_path: Path) -> Iterator[Path]:
    """A directory whose first data write fails with ENOSPC."""
    fault = faults.StorageFault("enospc", at=1, ops=frozenset({"write_at"}))
    with faults.faulty_backend(str(tmp_path), fault):
        yield tmp_path


def _state() -> dict[str, np.ndarray]:
    # 8 MiB: a lazy save's writers write chunks of it straight from its memory
    return {"w": np.ones(1 << 20)}


def _ended(h: ss.SaveHandle) -> None:
    """Wait until the save's background thread has returned: it lets go of the job as
    it returns, a moment after the outcome is reported (a CI run under load checked in
    that moment once and found the state alive)."""
    if h._thread is not None:
        h._thread.join(60)
        assert not h._thread.is_alive()


def _save_and_fail(path: Path, state: dict[str, np.ndarray], lazy: bool) -> None:
    # eager: the snapshot's write fails in save_async; lazy: result() raises it
    h = None
    with pytest.raises(ss.StorageError):
        h = ss.save_async(path, state, lazy=lazy)
        h.result()
    if h is not None:
        _ended(h)


@pytest.mark.parametrize("lazy", [False, True], ids=["eager", "lazy"])
def test_a_failed_save_keeps_nothing_of_the_state(full_disk, lazy):
    state = _state()
    gone = weakref.ref(state["w"])
    _save_and_fail(full_disk / "c", state, lazy)
    del state
    gc.collect()
    assert gone() is None


def test_a_failed_save_kept_by_its_caller_keeps_nothing_of_the_state(full_disk):
    state = _state()
    gone = weakref.ref(state["w"])
    # a budget smaller than the array: no copy is made, the writers read the state
    h = ss.save_async(full_disk / "c", state, lazy=True,
                      memory=ss.MemoryOptions(memory_budget_bytes=1 << 20))
    del state
    assert h._finished.wait(60) and h.failed()  # nobody asked yet: pending, reported at exit
    _ended(h)
    gc.collect()
    assert gone() is None
    with pytest.raises(ss.StorageError):
        h.result()
    gc.collect()
    assert gone() is None


def _frames_of_result(h: ss.SaveHandle, local: object) -> tuple[type, str, object, int]:
    try:
        h.result()
    except ss.StorageError as exc:
        return type(exc), str(exc), exc.__cause__, len(list(traceback.walk_tb(exc.__traceback__)))
    raise AssertionError("result() did not raise")


def test_result_raises_the_error_again_without_the_earlier_callers_frames(full_disk):
    h = ss.save_async(full_disk / "c", _state(), lazy=True)
    first = _frames_of_result(h, None)
    # the same type, message and cause each time, and as many frames
    assert all(_frames_of_result(h, None) == first for _ in range(20))
    big = np.ones(1 << 16)
    gone = weakref.ref(big)
    _frames_of_result(h, big)
    del big
    _frames_of_result(h, None)  # a later caller: the earlier one's frame is let go of
    gc.collect()
    assert gone() is None
