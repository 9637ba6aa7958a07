"""CheckpointManager ergonomics: best_step, steps only go forward, KeepBest's metric."""

from __future__ import annotations

import math
import os
import sys
import time
import warnings

import numpy as np
import pytest

import statestream as ss
from statestream.testing import faults

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(sys.platform == "win32", reason="POSIX flock"),
]


@pytest.fixture(autouse=True)
def _no_faults():
    faults.clear()
    yield
    faults.clear()


def state_at(step: int) -> dict:
    return {"step": step, "w": np.arange(8, dtype=np.float32) + step}


@pytest.mark.parametrize("async_save", [True, False])
def test_best_step(tmp_path, async_save):
    losses = {1: 0.9, 2: 0.3, 3: float("nan"), 4: 0.3, 5: 0.7}
    with ss.CheckpointManager(tmp_path, async_save=async_save) as mgr:
        assert mgr.best_step("loss") is None
        for s, loss in losses.items():
            mgr.save(s, state_at(s), metrics={"loss": loss, "acc": 1 - loss})
        mgr.save(6, state_at(6), metrics={"acc": 0.95})  # no loss: does not count
        mgr.wait()
        assert mgr.best_step("loss") == 2  # the tie with step 4: the earliest
        assert mgr.best_step("loss", mode="max") == 1  # NaN never counts
        assert mgr.best_step("acc", mode="max") == 6
        assert mgr.best_step("missing") is None
        assert math.isnan(mgr.step_info(3)["metrics"]["loss"])  # a NaN loss saves
        with pytest.raises(ValueError, match="'min' or 'max'"):
            mgr.best_step("loss", mode="lowest")
        assert int(mgr.load(mgr.best_step("loss"))["step"]) == 2
    with ss.CheckpointManager(tmp_path) as mgr:  # from what is on disk
        assert mgr.best_step("loss") == 2


def test_best_step_follows_the_keep_policy(tmp_path):
    with ss.CheckpointManager(tmp_path, keep_policy=ss.KeepBest(1, "loss"),
                              async_save=False) as mgr:
        for s, loss in [(1, 0.5), (2, 0.2), (3, 0.4), (4, 0.6)]:
            mgr.save(s, state_at(s), metrics={"loss": loss})
        assert mgr.steps() == [2, 4] and mgr.best_step("loss") == 2


@pytest.mark.parametrize("async_save", [True, False])
def test_an_older_step_raises(tmp_path, async_save):
    with ss.CheckpointManager(tmp_path, async_save=async_save) as mgr:
        for s in (0, 10, 20):
            assert mgr.save(s, state_at(s))
        with pytest.raises(ss.CheckpointError, match=r"cannot save step 5 .*step 20 is already"):
            mgr.save(5, state_at(5))
        with pytest.raises(ss.CheckpointError, match="only go forward"):
            mgr.save(19, state_at(19), force=True)
        assert not mgr.save(20, state_at(99))  # the last step again: not saved twice
        assert mgr.save(21, state_at(21))
        mgr.wait()
        assert mgr.steps() == [0, 10, 20, 21]
        assert int(mgr.load(20)["step"]) == 20

    # a resumed run that forgot to advance its step: refused before anything is written
    with ss.CheckpointManager(tmp_path, save_policy=ss.EveryNSteps(10)) as mgr:
        with pytest.raises(ss.CheckpointError, match="mgr.latest_step"):
            mgr.save(0, state_at(0))
        assert mgr.steps() == [0, 10, 20, 21]
        assert int(mgr.load(0)["step"]) == 0
        assert mgr.save(30, state_at(30))


def test_a_failed_async_save_does_not_block_its_step(tmp_path):
    def boom():
        raise OSError("disk on fire")

    with ss.CheckpointManager(tmp_path) as mgr:
        assert mgr.save(1, state_at(1))
        mgr.wait()
        faults.on("save.data_synced", boom, nth=1)
        assert mgr.save(2, state_at(2))
        with pytest.raises(OSError, match="disk on fire"):
            mgr.wait()
        assert mgr.steps() == [1]
        assert mgr.save(2, state_at(2))  # the failed step may be saved again
        mgr.wait()
        assert mgr.steps() == [1, 2]


@pytest.mark.parametrize("seen_by", ["wait", "save"])
def test_a_failed_async_save_does_not_delay_a_time_based_policy(tmp_path, seen_by):
    # EveryNSeconds counted from the save that failed: no step was saved for an hour,
    # and its error was not raised either (no save started to raise it).
    def boom():
        raise OSError("disk on fire")

    with ss.CheckpointManager(tmp_path, save_policy=ss.EveryNSeconds(3600)) as mgr:
        faults.on("save.data_synced", boom, nth=1)
        assert mgr.save(1, state_at(1))  # the first call saves; it fails in the background
        handle = mgr.in_flight
        assert handle is not None
        while not handle.done():
            time.sleep(0.01)
        assert handle.failed()
        with pytest.raises(OSError, match="disk on fire"):
            if seen_by == "wait":
                mgr.wait()
            else:  # the policy counts from no save: it saves, and raises the error
                mgr.save(2, state_at(2))
        assert mgr.save(3, state_at(3))  # the last save that committed: none
        mgr.wait()
        assert mgr.steps() == [3]
        assert not mgr.save(4, state_at(4))  # an hour from step 3's save
        assert mgr.steps() == [3]


@pytest.mark.parametrize("lazy", [False, True])
def test_load_waits_for_the_save_in_flight(tmp_path, lazy):
    import time

    faults.on("save.data_synced", lambda: time.sleep(0.5), nth=1)  # a slow commit
    with ss.CheckpointManager(tmp_path, lazy=lazy) as mgr:
        assert mgr.save(1, state_at(1))
        assert int(mgr.load()["step"]) == 1  # not "no committed checkpoint"
        assert mgr.in_flight is None or mgr.in_flight.done()


def test_load_after_a_failed_save_in_flight_reads_what_is_committed(tmp_path):
    def boom():
        raise OSError("disk on fire")

    with ss.CheckpointManager(tmp_path) as mgr:
        assert mgr.save(1, state_at(1))
        mgr.wait()
        faults.on("save.data_synced", boom, nth=1)
        assert mgr.save(2, state_at(2))
        assert int(mgr.load()["step"]) == 1
        with pytest.raises(OSError, match="disk on fire"):  # still reported
            mgr.wait()


def test_keep_best_metric_missing_warns(tmp_path):
    keep = ss.KeepUnion(ss.KeepLatest(1), ss.KeepBest(1, "val_loss"))
    with ss.CheckpointManager(tmp_path, keep_policy=keep, async_save=False) as mgr:
        with pytest.warns(UserWarning, match=r"step 1 .*'val_loss' of the KeepBest .*\['loss'\]"):
            mgr.save(1, state_at(1), metrics={"loss": 0.5})
        with pytest.warns(UserWarning, match="step 2 .*'val_loss'"):
            mgr.save(2, state_at(2), metrics={"val_loss": math.nan})
        with pytest.warns(UserWarning, match="step 3 .*'val_loss'"):
            mgr.save(3, state_at(3))
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            mgr.save(4, state_at(4), metrics={"val_loss": 0.1})
            mgr.save(5, state_at(5), metrics={"val_loss": 0.2})
        assert mgr.steps() == [4, 5]
    with warnings.catch_warnings():  # no KeepBest: metrics are optional
        warnings.simplefilter("error")
        with ss.CheckpointManager(tmp_path / "b", keep_policy=ss.KeepLatest(2)) as mgr:
            mgr.save(1, state_at(1))


@pytest.mark.parametrize("tier", [False, True])
def test_loading_a_step_the_keep_policy_deleted_lists_the_steps(tmp_path, tier):
    """It said 'no checkpoint at .../step_0000000001: the directory does not exist' (with
    a local tier until 2026-12-08: every step counted as there)."""
    kw = {"local_tier": str(tmp_path / "local")} if tier else {}
    with ss.CheckpointManager(tmp_path / "run", async_save=False,
                              keep_policy=ss.KeepLatest(2), **kw) as mgr:
        for step in range(1, 5):
            mgr.save(step, {"w": np.full(3, step)})
        mgr.wait()
        with pytest.raises(ss.CheckpointNotFoundError,
                           match=r"step 1 is not a committed step of .*run \(its steps: 3, 4\); "
                                 "a keep policy may have deleted it"):
            mgr.load(step=1)
        assert mgr.load(step=np.int64(3))["w"][0] == 3


def test_a_string_metric_that_spells_a_number_stays_a_string(tmp_path):
    # "inf" came back as the float inf (non-finite floats are stored as such strings),
    # so a note of "-inf" would have counted as the best loss.
    with ss.CheckpointManager(tmp_path, async_save=False) as mgr:
        mgr.save(1, state_at(1), metrics={"loss": "-inf", "note": "nan", "x": float("-inf")})
        mgr.save(2, state_at(2), metrics={"loss": 0.5})
        got = mgr.step_info(1)["metrics"]
        assert got["loss"] == "-inf" and got["note"] == "nan" and got["x"] == -math.inf
        assert mgr.best_step("loss") == 2
    with ss.CheckpointManager(tmp_path) as mgr:  # from what is on disk
        assert mgr.step_info(1)["metrics"]["loss"] == "-inf"


@pytest.mark.parametrize(("kw", "where"), [
    ({"metadata": {"tags": {"a"}}}, r"meta\['metadata'\]\['tags'\] is a set"),
    ({"metadata": {"lr": np.float32(0.1)}}, r"meta\['metadata'\]\['lr'\] is a numpy.float32"),
    ({"metadata": {"x": [1, float("nan")]}}, r"meta\['metadata'\]\['x'\]\[1\] is nan"),
    ({"metrics": {("a", 1): 0.5}}, r"meta\['metrics'\] has the key \('a', 1\) \(tuple"),
])
def test_metadata_that_is_not_json_is_named(tmp_path, kw, where):
    # the error said "meta must be a JSON-able mapping" whatever was wrong, and where
    with ss.CheckpointManager(tmp_path, async_save=False) as mgr:
        with pytest.raises(ss.UnsupportedTypeError, match=where):
            mgr.save(1, state_at(1), **kw)
        assert mgr.steps() == []


class _KeepThatRaises:
    def keep(self, steps):
        raise ValueError("a keep policy with a bug")


@pytest.mark.parametrize("tier", [False, True], ids=["directory", "local tier"])
def test_a_manager_whose_open_failed_holds_neither_directory(tmp_path, tier):
    # Listing the steps (which runs the keep policy) came after the lease was taken and
    # failed without giving it up: while the error was held (a retry loop, pytest.raises)
    # the same process could not open the directory again: ManagerLockedError naming
    # its own pid. Now the failed open releases the directory and the local tier.
    d, local = tmp_path / "ckpt", tmp_path / "local"
    with ss.CheckpointManager(d, async_save=False) as mgr:
        mgr.save(1, {"w": np.zeros(4)})
    kw = {"local_tier": local} if tier else {}
    with pytest.raises(ValueError, match="a keep policy with a bug") as failed:
        ss.CheckpointManager(d, keep_policy=_KeepThatRaises(), **kw)
    with ss.CheckpointManager(d, **kw) as mgr:  # the error (and its frames) still held
        assert mgr.load()["w"].shape == (4,)
    assert failed.value is not None


class _KeepNames:
    def keep(self, steps):
        return {f"step_{info.step:010d}" for info in steps}  # names, not step numbers


class _KeepInfos:
    def keep(self, steps):
        return [info for info in steps if info.step % 2 == 0]  # StepInfos, not numbers


@pytest.mark.parametrize("policy", [_KeepNames(), _KeepInfos()], ids=lambda p: type(p).__name__)
def test_a_keep_policy_that_returns_no_step_numbers_is_named_and_deletes_nothing(tmp_path,
                                                                               policy):
    # Names kept nothing: every step but the latest was deleted, silently. StepInfos
    # raised a TypeError about an unhashable dict from inside the manager.
    mgr = ss.CheckpointManager(tmp_path, async_save=False, keep_policy=policy)
    mgr.save(0, {"w": np.full(4, 0)})  # one step: nothing to decide
    for s in (1, 2):  # 1 commits, then its policy is refused; 2 is refused before
        with pytest.raises(ss.InvalidOptionTypeError,
                           match=rf"{type(policy).__name__}\.keep\(\) must return the "
                                 "step numbers to keep"):
            mgr.save(s, {"w": np.full(4, s)})
    assert sorted(os.listdir(tmp_path / "step_0000000000"))
    assert [ss.load(mgr.step_path(s))["w"][0] for s in (0, 1)] == [0, 1]
    with pytest.raises(ss.InvalidOptionTypeError):
        mgr.close()  # applies the policy once more; the directory is released all the same
    with ss.CheckpointManager(tmp_path) as mgr:
        assert mgr.steps() == [0, 1]


@pytest.mark.parametrize("async_save", [False, True])
def test_a_step_saved_again_is_ranked_by_its_new_metrics(tmp_path, async_save):
    # The keep policy read step 2 before it was saved again (force=True) and kept what it
    # read: best_step ranked the old loss, and KeepBest(1) deleted the new best step.
    with ss.CheckpointManager(tmp_path, async_save=async_save,
                              keep_policy=ss.KeepBest(1, "loss")) as mgr:
        mgr.save(1, state_at(1), metrics={"loss": 0.5})
        mgr.save(2, state_at(2), metrics={"loss": 0.9})
        mgr.save(2, state_at(20), metrics={"loss": 0.1}, force=True)
        mgr.wait()
        assert mgr.best_step("loss") == 2
        assert mgr.steps() == [2]
        mgr.save(3, state_at(3), metrics={"loss": 0.7})
        mgr.wait()
        assert mgr.steps() == [2, 3]
        assert mgr.load(2)["step"] == 20


def test_a_step_saved_again_no_longer_keeps_what_its_old_copy_referred_to(tmp_path):
    # The bases read of step 2's old copy stayed: step 1, retired for it, stayed on
    # disk (a whole step) for as long as step 2 was the newest.
    with ss.CheckpointManager(tmp_path, async_save=False, incremental=True,
                              keep_policy=ss.KeepLatest(1)) as mgr:
        mgr.save(1, {"frozen": np.zeros(1024), "w": np.full(8, 1.0)})
        mgr.save(2, {"frozen": np.zeros(1024), "w": np.full(8, 2.0)})  # refers to step 1
        assert sorted(os.listdir(tmp_path / "step_0000000001"))
        mgr.save(2, {"frozen": np.ones(1024), "w": np.full(8, 3.0)}, force=True)  # a full save
        assert ss.metadata(mgr.step_path(2)).bases == []
        mgr.wait()
        assert not (tmp_path / "step_0000000001").exists()


def test_a_retry_of_a_step_whose_async_save_failed_raises_its_error(tmp_path):
    """save(N) again after step N's background save failed returned False and raised
    nothing (the step counted as saved): a retry loop never learned that it failed."""
    def boom():
        raise OSError("disk on fire")

    with ss.CheckpointManager(tmp_path) as mgr:
        faults.on("save.data_synced", boom, nth=1)
        assert mgr.save(1, state_at(1))
        with pytest.raises(OSError, match="disk on fire"):
            mgr.save(1, state_at(1))
        assert mgr.steps() == []
        assert mgr.save(1, state_at(1))  # now it may be saved again
        assert not mgr.save(1, state_at(1))  # in flight and fine: waits, not saved twice
        assert mgr.steps() == [1]
