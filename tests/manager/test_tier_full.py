"""A local tier too small for the steps its keep policy keeps plus a new one: a
real full file system (a small tmpfs; the tests skip when one cannot be mounted).

Persisted local copies leave to make room for the next save (with a warning)
and load from the directory; when none can leave, the save's error says the
local tier is full.
"""

from __future__ import annotations

import errno
import sys
import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

import statestream as ss
from statestream import _hooks

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="Linux (tmpfs)")

N = 90_000  # 0.72 MB of float64: a 2 MiB tier holds two steps, not three


def state_at(step: int) -> dict:
    return {"w": np.arange(N, dtype=np.float64) + step}


def _saves(mgr: ss.CheckpointManager, steps: range) -> list[str]:
    """Save each step and wait for its persistence; the RuntimeWarnings raised."""
    out = []
    for step in steps:
        with warnings.catch_warnings(record=True) as got:
            warnings.simplefilter("always")
            assert mgr.save(step, state_at(step))
            mgr.wait()
        out += [str(w.message) for w in got if issubclass(w.category, RuntimeWarning)]
    return out


@pytest.mark.parametrize("async_save", [False, True])
@pytest.mark.parametrize("keep", [ss.KeepLatest(2), None])
def test_a_full_local_tier_drops_persisted_copies_to_make_room(
        mount_tmpfs: Callable[[str], Path], tmp_path: Path, async_save: bool,
        keep: ss.KeepPolicy | None) -> None:
    local = mount_tmpfs("2m")
    with ss.CheckpointManager(str(tmp_path / "persist"), local_tier=str(local),
                              async_save=async_save, local_keep_policy=keep) as mgr:
        warned = _saves(mgr, range(1, 6))  # every save went through (was: ENOSPC from 3 on)
        assert any("removed from it to make room" in w and str(local) in w for w in warned)
        assert mgr.steps() == [1, 2, 3, 4, 5] and mgr.persisted_steps() == [1, 2, 3, 4, 5]
        assert 1 not in mgr._tier.steps()  # dropped locally, held by the directory
        for s in range(1, 6):
            np.testing.assert_array_equal(mgr.load(s)["w"], state_at(s)["w"])


def test_an_incremental_base_a_kept_step_refers_to_stays(
        mount_tmpfs: Callable[[str], Path], tmp_path: Path) -> None:
    """Step 2 refers to step 1's chunks: step 1 never leaves while step 2 is there."""
    local = mount_tmpfs("2m")
    fixed = np.arange(N // 2, dtype=np.float64)

    def state(step: int) -> dict:
        return {"a": fixed, "b": np.full(N // 2, step, dtype=np.float64)}

    with ss.CheckpointManager(str(tmp_path / "persist"), local_tier=str(local),
                              incremental=True, local_keep_policy=ss.KeepLatest(3)) as mgr:
        for step in range(1, 6):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)
                assert mgr.save(step, state(step))
                mgr.wait()
            for s in mgr._tier.steps():  # every step a local step refers to is local
                assert set(mgr._tier.retention.bases_of(s) or []) <= set(mgr._tier.steps())
        assert mgr.steps() == [1, 2, 3, 4, 5]
        for s in range(1, 6):
            got = mgr.load(s)
            np.testing.assert_array_equal(got["a"], fixed)
            np.testing.assert_array_equal(got["b"], state(s)["b"])


@pytest.mark.parametrize("async_save", [False, True])
def test_a_full_tier_with_nothing_persisted_says_it_is_full(
        mount_tmpfs: Callable[[str], Path], tmp_path: Path, async_save: bool) -> None:
    """The store is down: no local step may leave, and the save that does not fit
    fails naming the full local tier, its free space and the step."""
    local = mount_tmpfs("2m")

    def down() -> None:
        raise ss.StorageError("the object store is down (injected)")

    _hooks.register("tier.persist", down)
    try:
        mgr = ss.CheckpointManager(str(tmp_path / "persist"), local_tier=str(local),
                                   async_save=async_save, local_keep_policy=ss.KeepLatest(1))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            for step in (1, 2):
                assert mgr.save(step, state_at(step))
            with pytest.raises(ss.StorageError) as got:
                mgr.save(3, state_at(3))
                mgr._wait_save()  # async: the background save's error
        assert got.value.errno == errno.ENOSPC
        assert (f"saving step 3 failed: the local tier {local} is full (" in str(got.value)
                and "bytes free" in str(got.value))
        assert mgr.unpersisted_steps() == [1, 2]  # nothing unpersisted left
        with pytest.raises(ss.StorageError), warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            mgr.close()
    finally:
        _hooks.clear()


def _grown(step: int) -> dict:
    """A state larger than the steps before it (0.6 MB, then 1 MB from step 3)."""
    return {"w": np.arange(75_000 if step < 3 else 125_000, dtype=np.float64) + step}


def test_a_save_larger_than_the_newest_step_is_tried_again_after_making_room(
        mount_tmpfs: Callable[[str], Path], tmp_path: Path) -> None:
    """The room made before a save is the newest step's size; a larger save that
    does not fit drops every persisted step that can leave and is tried once more."""
    local = mount_tmpfs("2m")
    with ss.CheckpointManager(str(tmp_path / "persist"), local_tier=str(local),
                              async_save=False, local_keep_policy=ss.KeepLatest(2)) as mgr:
        for step in (1, 2):
            assert mgr.save(step, _grown(step))
            mgr.wait()
        with pytest.warns(RuntimeWarning, match=r"save of step 3 did not fit: the persisted "
                          r"local steps \[1, 2\] were removed"):
            assert mgr.save(3, _grown(3))
        mgr.wait()
        assert mgr._tier.steps() == [3] and mgr.persisted_steps() == [1, 2, 3]
        for s in (1, 2, 3):
            np.testing.assert_array_equal(mgr.load(s)["w"], _grown(s)["w"])


def test_an_async_save_larger_than_the_newest_step_names_what_could_leave(
        mount_tmpfs: Callable[[str], Path], tmp_path: Path) -> None:
    """A background save that fails for room is not tried again: its error says the
    tier is full and which persisted steps could leave it. (Whether the write fails
    before ``save`` returns, and is tried again, or in the background is up to the
    writer threads: either way the outcome is one of these two.)"""
    local = mount_tmpfs("2m")
    with ss.CheckpointManager(str(tmp_path / "persist"), local_tier=str(local),
                              async_save=True, local_keep_policy=ss.KeepLatest(2)) as mgr:
        for step in (1, 2):
            assert mgr.save(step, _grown(step))
            mgr.wait()
        with warnings.catch_warnings(record=True) as got:
            warnings.simplefilter("always")
            assert mgr.save(3, _grown(3))
        if any("save of step 3 did not fit" in str(w.message) for w in got):
            mgr.wait()  # failed before save returned: tried again, after making room
            assert mgr.steps() == [1, 2, 3]
            np.testing.assert_array_equal(mgr.load(3)["w"], _grown(3)["w"])
            return
        with pytest.raises(ss.StorageError, match=r"local tier .* is full \(\d+ bytes free\); "
                           r"this save needed more room .* steps \[1, 2\] could leave it"):
            mgr.wait()
        assert mgr.steps() == [1, 2]
