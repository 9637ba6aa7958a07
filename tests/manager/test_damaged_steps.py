"""A damaged newest step does not stop a resume: ``load()`` goes back to the last good one.

``mgr.load()`` without a step skips a newest step whose bytes are damaged
(checksum mismatch, truncated file) with a warning naming it; ``load(step)``
never replaces the step asked for; errors that are not damage are raised as
they are. With several processes, see
tests/distributed/test_manager_damaged_multiprocess.py.
"""

from __future__ import annotations

import glob
import os
import sys
import warnings

import numpy as np
import pytest

import statestream as ss

pytestmark = pytest.mark.timeout(120)


def state_at(step: int) -> dict:
    return {"step": step, "w": np.arange(4096, dtype=np.float32) + step}


def _saved(directory: str, steps: list[int], **kw) -> None:
    with ss.CheckpointManager(directory, async_save=False, **kw) as mgr:
        for s in steps:
            mgr.save(s, state_at(s))


def _data_file(mgr: ss.CheckpointManager, step: int) -> str:
    (f,) = glob.glob(os.path.join(mgr.step_path(step), "data", "*"))
    return f


def _flip(path: str, at: int = 100) -> None:
    with open(path, "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 1]))


@pytest.mark.parametrize("damage", ["flipped byte", "truncated file"])
def test_a_damaged_newest_step_falls_back_to_the_one_before(tmp_path, damage):
    _saved(str(tmp_path), [1, 2, 3])
    with ss.CheckpointManager(tmp_path) as mgr:
        f = _data_file(mgr, 3)
        if damage == "flipped byte":
            _flip(f)
        else:
            os.truncate(f, 1000)
        with pytest.warns(RuntimeWarning, match=r"step 3 in .* is damaged, loading step 2 "
                                                r"instead: .*step_0000000003"):
            out = mgr.load()
        assert out["step"] == 2
        np.testing.assert_array_equal(out["w"], state_at(2)["w"])
        with pytest.raises(ss.CheckpointCorruptError):  # asked for by number: no other
            mgr.load(3)
        assert mgr.latest_step() == 3  # still listed: the damage is the caller's to see


def test_into_a_target_the_older_step_is_what_remains(tmp_path):
    torch = pytest.importorskip("torch")
    _saved(str(tmp_path), [1, 2])
    with ss.CheckpointManager(tmp_path) as mgr:
        _flip(_data_file(mgr, 2))
        target = {"step": 0, "w": torch.zeros(4096)}
        with pytest.warns(RuntimeWarning, match="step 2"):
            out = mgr.load(target=target)
        assert out["step"] == 1
        assert torch.equal(out["w"], torch.from_numpy(state_at(1)["w"]))


def test_every_step_damaged_raises_the_newest_steps_error(tmp_path):
    _saved(str(tmp_path), [1, 2])
    with ss.CheckpointManager(tmp_path) as mgr:
        for s in (1, 2):
            _flip(_data_file(mgr, s))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with pytest.raises(ss.ChecksumMismatchError, match="step_0000000002"):
                mgr.load()
        assert [str(w.message).split(" in ")[0] for w in caught
                if issubclass(w.category, RuntimeWarning)] == ["step 2"]


def test_an_error_that_is_not_damage_is_raised_as_it_is(tmp_path):
    _saved(str(tmp_path), [1, 2])
    with ss.CheckpointManager(tmp_path) as mgr:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no fallback warning either
            with pytest.raises(ss.MissingKeyError):
                mgr.load(target={"step": 0, "w": np.zeros(4096, np.float32), "extra": 1})


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX")
def test_an_incremental_step_whose_base_is_damaged_falls_back_past_both(tmp_path):
    with ss.CheckpointManager(tmp_path, async_save=False, incremental=True) as mgr:
        for s in (1, 2, 3):
            mgr.save(s, {"frozen": np.arange(4096, dtype=np.float32), "step": s,
                         "w": np.full(8, float(s), np.float32)})
        # step 2 refers to step 1's frozen chunk, as does step 3: damage it in step 1
        _flip(_data_file(mgr, 1))
        with pytest.warns(RuntimeWarning) as caught:
            with pytest.raises(ss.ChecksumMismatchError):
                mgr.load()
        damaged = [str(w.message).split(" in ")[0] for w in caught.list
                   if "is damaged" in str(w.message)]
        assert damaged == ["step 3", "step 2"]
