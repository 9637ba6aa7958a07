"""A resume on a new machine copies the step it loaded into the local tier
(fetch_into_tier) so the next incremental save can refer to it: in a tier too
small for that copy beside the next save, nothing is copied (the next save would
have to drop it again, or fail), and a copy that fails for room anyway leaves
nothing behind. Real full file systems (a small tmpfs; skipped where one cannot
be mounted)."""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import statestream as ss
from statestream.manager import _tierops

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="Linux (tmpfs)")


def _state(n: int, step: int) -> dict:
    return {"w": np.arange(n, dtype=np.float64) + step}


def _persist(directory: Path, n: int, steps: range) -> None:
    """Save ``steps`` of ``n`` float64 each, straight to the directory (no local tier)."""
    with ss.CheckpointManager(str(directory), incremental=True) as mgr:
        for s in steps:
            assert mgr.save(s, _state(n, s))


def _resume_and_save(persist: Path, local: Path, n: int) -> tuple[Any, list[str], list[str]]:
    """A fresh manager on ``local`` resumes step 3, then saves step 4: the tier's steps
    after the resume and after the save, and the RuntimeWarnings of each."""
    with ss.CheckpointManager(str(persist), local_tier=str(local), incremental=True) as mgr:
        with warnings.catch_warnings(record=True) as resumed:
            warnings.simplefilter("always")
            got = mgr.load()
            mgr.wait()  # the copy into the tier runs in the background
        np.testing.assert_array_equal(got["w"], _state(n, 3)["w"])
        after_resume = mgr._tier.steps()
        with warnings.catch_warnings(record=True) as saved:
            warnings.simplefilter("always")
            assert mgr.save(4, _state(n, 4))
            mgr.wait()
        assert mgr.persisted_steps() == [1, 2, 3, 4]
        for s in (3, 4):
            np.testing.assert_array_equal(mgr.load(s)["w"], _state(n, s)["w"])
        return ((after_resume, mgr._tier.steps()),
                [str(w.message) for w in resumed if issubclass(w.category, RuntimeWarning)],
                [str(w.message) for w in saved if issubclass(w.category, RuntimeWarning)])


def test_a_step_that_fits_beside_the_next_save_is_copied(
        mount_tmpfs: Callable[[str], Path], tmp_path: Path) -> None:
    """0.72 MB steps, a 3 MiB tier: the copy, the next save and room for the one
    after it (which the tier keeps after each save) fit together."""
    persist, local = tmp_path / "persist", mount_tmpfs("3m")
    _persist(persist, 90_000, range(1, 4))
    (resumed, saved), on_resume, on_save = _resume_and_save(persist, local, 90_000)
    assert on_resume == [] and on_save == []
    assert resumed == [3] and saved == [3, 4]


def test_a_step_with_no_room_beside_the_next_save_is_not_copied(
        mount_tmpfs: Callable[[str], Path], tmp_path: Path) -> None:
    """1.2 MB steps, a 2 MiB tier: a copy of step 3 would leave no room for step 4,
    so the tier's keep pass removed it again as soon as it was made (a copy for
    nothing, and a warning that the tier is too small). The copy is not made, with
    one warning naming the tier, its free space and the step, and step 4 is saved
    removing nothing. (A tier this small holds no step beside the room it keeps for
    the next save: once persisted, step 4 leaves it too, as it did before.)"""
    persist, local = tmp_path / "persist", mount_tmpfs("2m")
    _persist(persist, 150_000, range(1, 4))
    (resumed, _), on_resume, on_save = _resume_and_save(persist, local, 150_000)
    assert resumed == []
    assert len(on_resume) == 1, on_resume
    assert (f"step 3 was not copied from {persist} into the local tier {local}: the local "
            f"tier {local} has " in on_resume[0] and "bytes free" in on_resume[0])
    assert not [w for w in on_save if "[3]" in w or "did not fit" in w], on_save
    assert not [x for x in os.listdir(local) if "0000000003" in x], os.listdir(local)


def test_a_copy_that_fails_for_room_leaves_the_tier_as_it_was(
        mount_tmpfs: Callable[[str], Path], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The tier's room is checked before the copy; here it is not (the disk filled up
    meanwhile): step 2 refers to step 1's 'a' (1.2 MB), so step 1 is copied (1.8 MB)
    and step 2's own 0.6 MB does not fit in the 2 MiB tier. Step 1, copied for it, is
    removed again, nothing of step 2 stays, and one warning says the tier is full."""
    persist, local = tmp_path / "persist", mount_tmpfs("2m")
    a = np.arange(150_000, dtype=np.float64)

    def state(step: int) -> dict:
        return {"a": a, "b": np.full(75_000, step, dtype=np.float64)}

    with ss.CheckpointManager(str(persist), incremental=True) as mgr:
        for s in (1, 2):
            assert mgr.save(s, state(s))
    assert ss.metadata(str(persist / "step_0000000002")).bases == ["step_0000000001"]
    monkeypatch.setattr(_tierops, "fetch_shortage", lambda *_: None)
    with ss.CheckpointManager(str(persist), local_tier=str(local), incremental=True) as mgr:
        with warnings.catch_warnings(record=True) as got:
            warnings.simplefilter("always")
            loaded = mgr.load()
            mgr.wait()
        assert mgr._tier.steps() == []
        assert not [x for x in os.listdir(local) if "step_" in x], os.listdir(local)
        warned = [str(w.message) for w in got if issubclass(w.category, RuntimeWarning)]
        assert len(warned) == 1, warned
        assert (f"could not copy step 2 from {persist} into the local tier {local} (the "
                "local tier is full)" in warned[0])
        for k in ("a", "b"):
            np.testing.assert_array_equal(loaded[k], state(2)[k])
        monkeypatch.undo()
        assert mgr.save(3, state(3))
        mgr.wait()
        np.testing.assert_array_equal(mgr.load(3)["b"], state(3)["b"])
