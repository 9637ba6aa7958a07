"""A local tier too small for the steps its keep policy keeps plus a new one: a
real full file system (a small tmpfs; the tests skip when one cannot be mounted).

Persisted local copies leave to make room for the next save (with a warning)
and load from the directory; when none can leave, the save's error says the
local tier is full.
"""

from __future__ import annotations

import errno
import logging
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


def _sized(n: int, step: int) -> dict:
    return {"w": np.arange(n, dtype=np.float64) + step}


def _save_sized(mgr: ss.CheckpointManager, steps: range, n: int) -> list[str]:
    """Save each step with ``n`` float64 and wait for it; the room warnings raised."""
    out = []
    for step in steps:
        with warnings.catch_warnings(record=True) as got:
            warnings.simplefilter("always")
            assert mgr.save(step, _sized(n, step))
            mgr.wait()
        out += [str(w.message) for w in got if "to make room" in str(w.message)]
    return out


def test_a_tier_that_holds_its_kept_steps_only_warns_when_that_starts_or_worsens(
        mount_tmpfs: Callable[[str], Path], tmp_path: Path,
        caplog: pytest.LogCaptureFixture) -> None:
    """A 2 MiB tier holds two 0.72 MB steps (KeepLatest(2)) but not a third: every
    save drops one persisted copy. Warned once (was: at every save), then logged at
    debug level; warned again when the tier can no longer hold the two steps its
    keep policy keeps, and when the shortage starts again after it had room."""
    local = mount_tmpfs("2m")
    caplog.set_level(logging.DEBUG, logger="statestream.manager")
    with ss.CheckpointManager(str(tmp_path / "persist"), local_tier=str(local),
                              async_save=False, local_keep_policy=ss.KeepLatest(2)) as mgr:
        first = _save_sized(mgr, range(1, 11), N)
        assert len(first) == 1 and "warned once while this lasts" in first[0], first
        logged = [r.getMessage() for r in caplog.records if "to make room" in r.getMessage()]
        assert len(logged) >= 6, logged  # the saves after the first one that dropped
        # 1.2 MB steps: the tier holds one step with the next save, not two
        worse = _save_sized(mgr, range(11, 14), 150_000)
        assert len(worse) == 1 and "holds 1 step(s), fewer than the 2 it held" in worse[0], worse
        assert _save_sized(mgr, range(14, 18), 150_000) == []
        assert _save_sized(mgr, range(18, 20), 10_000) == []  # small steps: room again
        again = _save_sized(mgr, range(20, 24), N)  # short of room again: said again
        assert again and len(again) <= 2, again
        assert _save_sized(mgr, range(24, 30), N) == []
        assert mgr.steps() == list(range(1, 30)) and mgr.unpersisted_steps() == []
        np.testing.assert_array_equal(mgr.load(12)["w"], _sized(150_000, 12)["w"])
        np.testing.assert_array_equal(mgr.load(29)["w"], _sized(N, 29)["w"])


def test_a_growing_state_does_not_fail_an_async_save_for_room(
        mount_tmpfs: Callable[[str], Path], tmp_path: Path) -> None:
    """Steps that grow by 96 KB each (more than the margin): the room made before a
    save counts the growth of the newest step, so no background save (which is not
    tried again) fails for lack of room. (Sized by the newest step alone, step 9's
    save failed: the tier is full.)"""
    local = mount_tmpfs("2m")
    with ss.CheckpointManager(str(tmp_path / "persist"), local_tier=str(local),
                              async_save=True) as mgr:
        for step in range(1, 16):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)
                assert mgr.save(step, _sized(40_000 + 12_000 * step, step))
                mgr.wait()
        assert mgr.steps() == list(range(1, 16)) and mgr.unpersisted_steps() == []
        np.testing.assert_array_equal(mgr.load(15)["w"], _sized(220_000, 15)["w"])
