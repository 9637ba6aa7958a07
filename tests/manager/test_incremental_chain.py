"""CheckpointManager(incremental=N): a full save after N incremental ones.

A step's depth is 0 without ``bases``, else its base's depth + 1 (recorded in
its manifest); a save whose base has depth N is a full one. So the rhythm is
read from storage: a restarted manager, a local tier and a new machine keep it,
and a damaged chunk is referred to by no step after the next full save.
"""

from __future__ import annotations

import glob
import os
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import statestream as ss

FROZEN = (128, 128)  # 64 KiB: most of a data file that holds it


def state_at(step: int) -> dict[str, Any]:
    # 'frozen' changes at step 1 only (a frozen embedding after its first update);
    # 'lora' at every step; 'const' never (so no step but the first refers to nothing)
    g = np.random.default_rng(0 if step < 1 else 1)
    return {"frozen": g.standard_normal(FROZEN).astype(np.float32),
            "lora": np.full((4, 4), float(step), np.float32),
            "const": np.arange(16, dtype=np.int32), "step": step}


def _equal(got: dict[str, Any], step: int) -> None:
    want = state_at(step)
    np.testing.assert_array_equal(got["frozen"], want["frozen"])
    np.testing.assert_array_equal(got["lora"], want["lora"])
    np.testing.assert_array_equal(got["const"], want["const"])
    assert got["step"] == step


def _path(d: Path, step: int) -> str:
    return str(d / f"step_{step:010d}")


def _full(d: Path, steps: list[int]) -> list[int]:
    """Those of ``steps`` in ``d`` whose manifest refers to nothing."""
    return [s for s in steps if not ss.metadata(_path(d, s)).bases]


def _flip_mid_data_byte(step_dir: str) -> None:
    (name,) = glob.glob(os.path.join(step_dir, "data", "*.bin"))
    with open(name, "r+b") as f:
        f.seek(os.path.getsize(name) // 2)  # inside 'frozen', most of the file
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0xFF]))


def test_every_fourth_save_is_full_with_3(tmp_path: Path) -> None:
    d = tmp_path / "run"
    steps = [10 * i for i in range(9)]  # the rhythm counts saves, not step numbers
    with ss.CheckpointManager(d, incremental=3, async_save=False) as mgr:
        for s in steps:
            assert mgr.save(s, state_at(s))
        assert mgr.steps() == steps
        for s in steps:
            _equal(mgr.load(s), s)
    assert _full(d, steps) == [0, 40, 80]
    assert [ss.metadata(_path(d, s)).meta["user"]["chain"] for s in steps] == \
        [0, 1, 2, 3, 0, 1, 2, 3, 0]
    # between full saves, every step refers to the last full one only
    assert ss.metadata(_path(d, 70)).bases == ["step_0000000040"]


def test_with_1_every_other_save_is_full(tmp_path: Path) -> None:
    d = tmp_path / "run"
    with ss.CheckpointManager(d, incremental=1) as mgr:  # async: the same rhythm
        for s in range(6):
            mgr.save(s, state_at(s))
    assert _full(d, list(range(6))) == [0, 2, 4]


def test_a_restarted_manager_keeps_the_rhythm(tmp_path: Path) -> None:
    d = tmp_path / "run"
    with ss.CheckpointManager(d, incremental=3, async_save=False) as mgr:
        for s in range(6):
            mgr.save(s, state_at(s))
    with ss.CheckpointManager(d, incremental=3, async_save=False) as mgr:
        for s in range(6, 13):
            mgr.save(s, state_at(s))
    assert _full(d, list(range(13))) == [0, 4, 8, 12]


def test_a_step_that_refers_to_nothing_starts_a_chain(tmp_path: Path) -> None:
    # every array changes at step 2: an incremental save that refers to nothing (depth 0)
    d = tmp_path / "run"
    with ss.CheckpointManager(d, incremental=3, async_save=False) as mgr:
        for s in range(8):
            mgr.save(s, {"frozen": np.full(FROZEN, 0.0 if s < 2 else 1.0),
                         "lora": np.full(4, float(s))})
    assert _full(d, list(range(8))) == [0, 2, 6]


def test_the_chain_and_the_keep_policy_bound_what_stays_on_storage(tmp_path: Path) -> None:
    # with incremental=True a frozen array keeps its first step on storage forever
    # (retired); with incremental=2 the steps before the last full save go
    d = tmp_path / "run"
    with ss.CheckpointManager(d, incremental=2, async_save=False,
                              keep_policy=ss.KeepLatest(2)) as mgr:
        for s in range(8):
            mgr.save(s, state_at(s))
        assert mgr.steps() == [6, 7]
        for s in (6, 7):
            _equal(mgr.load(s), s)
    on_disk = sorted(int(p.name[5:]) for p in d.glob("step_*") if (p / "COMMITTED").exists())
    assert on_disk == [6, 7]  # 6 is full: nothing older is referred to


def test_steps_saved_with_true_are_followed_by_a_full_save(tmp_path: Path) -> None:
    # a base whose depth is not recorded (incremental=True) counts as a full chain
    d = tmp_path / "run"
    with ss.CheckpointManager(d, incremental=True, async_save=False) as mgr:
        for s in range(3):
            mgr.save(s, state_at(s))
    assert "chain" not in ss.metadata(_path(d, 2)).meta["user"]  # True: as before
    with ss.CheckpointManager(d, incremental=3, async_save=False) as mgr:
        for s in range(3, 6):
            mgr.save(s, state_at(s))
    assert _full(d, list(range(6))) == [0, 3]


def test_a_damaged_chunk_is_not_referred_to_after_the_next_full_save(tmp_path: Path) -> None:
    d = tmp_path / "run"
    with ss.CheckpointManager(d, incremental=3, async_save=False) as mgr:
        for s in range(2):
            mgr.save(s, state_at(s))
        _flip_mid_data_byte(_path(d, 1))  # a flipped bit in 'frozen', written at step 1
        for s in range(2, 9):
            mgr.save(s, state_at(s))
    assert _full(d, list(range(9))) == [0, 4, 8]
    _equal(ss.load(_path(d, 0)), 0)
    for s in (1, 2, 3):  # step 1 and the steps that refer to its 'frozen'
        with pytest.raises(ss.ChecksumMismatchError):
            ss.load(_path(d, s))
    for s in range(4, 9):  # from the full save at step 4 on
        assert all(b >= "step_0000000004" for b in ss.metadata(_path(d, s)).bases)
        _equal(ss.load(_path(d, s)), s)


def _tiered(tmp_path: Path, **kw: Any) -> ss.CheckpointManager:
    return ss.CheckpointManager(str(tmp_path / "persist"), local_tier=str(tmp_path / "local"),
                                incremental=3, **kw)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_local_tier_same_rhythm_in_both_tiers_and_after_restarts(tmp_path: Path,
                                                                 mode: str) -> None:
    persist, local = tmp_path / "persist", tmp_path / "local"
    with _tiered(tmp_path, async_save=mode == "async", local_keep_policy=ss.KeepAll()) as mgr:
        for s in range(2):
            mgr.save(s, state_at(s))
        mgr.wait()
        # a flipped bit in 'frozen' of step 1, in both tiers
        _flip_mid_data_byte(_path(local, 1))
        _flip_mid_data_byte(_path(persist, 1))
        for s in range(2, 6):
            mgr.save(s, state_at(s))
    with _tiered(tmp_path, local_keep_policy=ss.KeepAll()) as mgr:  # a restart
        for s in range(6, 10):
            mgr.save(s, state_at(s))
        mgr.wait()
        assert mgr.persisted_steps() == list(range(10))
    assert _full(local, list(range(10))) == _full(persist, list(range(10))) == [0, 4, 8]
    for d in (local, persist):
        for s in (1, 2, 3):
            with pytest.raises(ss.ChecksumMismatchError):
                ss.load(_path(d, s))
        for s in range(4, 10):
            _equal(ss.load(_path(d, s)), s)
    # a new machine: the newest step (and what it refers to) is copied into the empty
    # tier with its recorded depth, so the rhythm goes on
    os.rename(local, tmp_path / "old-local")
    with _tiered(tmp_path) as mgr:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            _equal(mgr.load(), 9)
        mgr.wait()
        for s in range(10, 14):
            mgr.save(s, state_at(s))
        mgr.wait()
    assert _full(persist, list(range(4, 14))) == [4, 8, 12]


@pytest.mark.parametrize("bad", [0, -2])
def test_incremental_below_1_is_refused(tmp_path: Path, bad: int) -> None:
    with pytest.raises(ss.InvalidOptionError, match=r"incremental must be .*int >= 1.*not "
                       + str(bad)):
        ss.CheckpointManager(tmp_path / "run", incremental=bad)
    assert not (tmp_path / "run").exists() or not any((tmp_path / "run").iterdir())


@pytest.mark.parametrize("bad", [2.0, "3", None])
def test_incremental_of_another_type_is_refused(tmp_path: Path, bad: Any) -> None:
    with pytest.raises(ss.InvalidOptionTypeError, match="incremental must be True, False or"):
        ss.CheckpointManager(tmp_path / "run", incremental=bad)


def test_incremental_accepts_numpy_ints_and_bools(tmp_path: Path) -> None:
    with ss.CheckpointManager(tmp_path / "a", incremental=np.int64(1), async_save=False) as mgr:
        for s in range(3):
            mgr.save(s, state_at(s))
    assert _full(tmp_path / "a", [0, 1, 2]) == [0, 2]
    with ss.CheckpointManager(tmp_path / "b", incremental=np.bool_(True)) as mgr:
        mgr.save(0, state_at(0))
