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


# --------------------------------------------------------------------------- keep policies


def _manifest(directory, step: int) -> str:
    return os.path.join(str(directory), f"step_{step:010d}", "manifest.json")


@pytest.mark.parametrize("keep", [None, ss.KeepLatest(3), ss.KeepEvery(1),
                                  ss.KeepBest(3, "loss")], ids=repr)
def test_a_step_whose_manifest_cannot_be_read_is_never_deleted(tmp_path, keep):
    # The policy sees only the readable steps; it used to drop the unreadable one
    # even under KeepAll (and KeepLatest(3) then kept step 0 in its place).
    with ss.CheckpointManager(tmp_path, async_save=False, keep_policy=keep) as mgr:
        for s in range(3):
            mgr.save(s, state_at(s), metrics={"loss": 1.0 / (s + 1)})
    _flip(_manifest(tmp_path, 1), at=20)
    with pytest.warns(RuntimeWarning, match=r"cannot read step 1 in .*it stays, and so do "
                                            r"the steps before it \(\[0\]\)"):
        with ss.CheckpointManager(tmp_path, async_save=False, keep_policy=keep) as mgr:
            mgr.save(3, state_at(3), metrics={"loss": 0.1})
            assert mgr.steps() == [0, 1, 2, 3]
    assert sorted(os.listdir(tmp_path / "step_0000000001"))  # untouched
    for s in (0, 2, 3):
        assert ss.load(str(tmp_path / f"step_{s:010d}"))["step"] == s


def test_a_manifest_read_that_fails_once_costs_no_step(tmp_path, monkeypatch):
    from statestream.manager import _retention

    _saved(str(tmp_path), [0, 1, 2], keep_policy=ss.KeepLatest(3))
    real, fails = _retention.step_info, [1]

    def flaky(path: str, step: int):
        if step == 1 and fails:
            fails.pop()
            raise ss.StorageError(f"reading {path}/manifest.json failed: [Errno 5] EIO")
        return real(path, step)

    monkeypatch.setattr(_retention, "step_info", flaky)
    with pytest.warns(RuntimeWarning, match="cannot read step 1 .*Errno 5"):
        with ss.CheckpointManager(tmp_path, async_save=False,
                                  keep_policy=ss.KeepLatest(3)) as mgr:
            mgr.save(3, state_at(3))  # applies the policy before and after the save
            assert not fails
            assert mgr.steps() == [1, 2, 3]  # read again after the error: the policy's
            assert ss.load(mgr.step_path(1))["step"] == 1


@pytest.mark.parametrize("async_save", [False, True])
def test_the_step_a_resume_went_back_to_is_kept_until_a_newer_one_commits(tmp_path,
                                                                         async_save):
    # KeepLatest(1) keeps the newest step; its manifest reads fine though its data is
    # damaged, so the step the resume loaded was the one deleted: nothing loadable.
    _saved(str(tmp_path), [1, 2])
    _flip(glob.glob(str(tmp_path / "step_0000000002" / "data" / "*"))[0])
    for _ in range(2):  # a resume that saves nothing, twice
        with ss.CheckpointManager(tmp_path, keep_policy=ss.KeepLatest(1),
                                  async_save=async_save) as mgr:
            with pytest.warns(RuntimeWarning, match="step 2 .* is damaged, loading step 1"):
                assert mgr.load()["step"] == 1
            mgr.wait()
            assert mgr.steps() == [1, 2]
    with ss.CheckpointManager(tmp_path, keep_policy=ss.KeepLatest(1),
                              async_save=async_save) as mgr:
        with pytest.warns(RuntimeWarning, match="is damaged"):
            mgr.load()
        mgr.save(2, state_at(2), force=True)  # saved again under the damaged number
        mgr.wait()
        assert mgr.steps() == [2]  # a good newer step: the policy decides again
        assert mgr.load()["step"] == 2


@pytest.mark.parametrize("async_save", [False, True])
def test_a_step_a_resume_found_damaged_is_not_the_next_incremental_base(tmp_path,
                                                                       async_save):
    # The damaged step's manifest reads fine, so the next incremental save took it as
    # its base: a chunk that did not change since referred to its damaged bytes, and
    # the new step, reported saved, failed its checksum (and the resume after it went
    # back past it too).
    def state(s: int) -> dict:
        return {"frozen": np.arange(4096, dtype=np.float32), "w": np.full(64, s % 3, np.int64)}

    with ss.CheckpointManager(tmp_path, async_save=False, incremental=True) as mgr:
        for s in (1, 2):
            mgr.save(s, state(s))
    with ss.CheckpointManager(tmp_path, async_save=async_save, incremental=True,
                              keep_policy=ss.KeepLatest(2)) as mgr:
        _flip(_data_file(mgr, 2), at=8)  # step 2 holds w alone; frozen is step 1's
        with pytest.warns(RuntimeWarning, match="step 2 .* is damaged, loading step 1"):
            assert mgr.load()["w"][0] == 1
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            mgr.save(3, state(2))  # w as in step 2 (a deterministic run redoing it)
            mgr.wait()
        report = ss.verify(mgr.step_path(3))
        assert report.ok, report.problems
        assert ss.metadata(mgr.step_path(3)).bases == ["step_0000000001"]
        assert any("step 2" in str(w.message) and "cannot be the base of step 3: a load "
                   "found it damaged" in str(w.message) for w in caught)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert mgr.load()["w"][0] == 2


def test_steps_a_resume_found_all_damaged_are_not_the_next_incremental_base(tmp_path):
    # Every listed step damaged: load() raises, and a run that starts over (a frozen
    # array as it was) saved against the damaged step anyway, referring to its bytes.
    def state(s: int) -> dict:
        return {"frozen": np.arange(4096, dtype=np.float32), "w": np.full(64, s, np.int64)}

    with ss.CheckpointManager(tmp_path, async_save=False, incremental=True,
                              keep_policy=ss.KeepLatest(1)) as mgr:
        for s in (1, 2):
            mgr.save(s, state(s))
        _flip(_data_file(mgr, 1), at=8)  # the frozen chunk, which step 2 refers to
    with ss.CheckpointManager(tmp_path, async_save=False, incremental=True,
                              keep_policy=ss.KeepLatest(1)) as mgr:
        with pytest.raises(ss.ChecksumMismatchError):
            mgr.load()  # step 1, retired, is tried last: damaged too
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            mgr.save(3, state(0))  # starting over
        report = ss.verify(mgr.step_path(3))
        assert report.ok, report.problems
        assert ss.metadata(mgr.step_path(3)).bases == []


def _layered(s: int) -> dict:
    """'frozen' never changes, 'a' changes at step 2, 'b' at every step: step 2 refers
    to step 1, step 3 to steps 1 and 2."""
    return {"frozen": np.arange(4096, dtype=np.float32),
            "a": np.full(1024, min(s, 2), np.float32), "b": np.full(1024, s, np.float32)}


def test_every_listed_step_damaged_falls_back_to_a_retired_step(tmp_path):
    # KeepLatest(1) lists step 3 alone; steps 1 and 2 stay (step 3 refers to them), full
    # committed checkpoints. A damaged step 3 made the resume raise, though step 2 loads.
    with ss.CheckpointManager(tmp_path, async_save=False, incremental=True,
                              keep_policy=ss.KeepLatest(1)) as mgr:
        for s in (1, 2, 3):
            mgr.save(s, _layered(s))
        assert mgr.steps() == [3]
        assert ss.metadata(mgr.step_path(3)).bases == ["step_0000000001", "step_0000000002"]
        _flip(_data_file(mgr, 3), at=8)  # step 3 holds 'b' alone
    with ss.CheckpointManager(tmp_path, async_save=False, incremental=True,
                              keep_policy=ss.KeepLatest(1)) as mgr:
        with pytest.warns(RuntimeWarning, match=r"step 3 in .* is damaged, loading step 2, "
                          r"which the keep policy dropped .*every listed step is damaged"):
            out = mgr.load()
        for k, v in _layered(2).items():
            np.testing.assert_array_equal(out[k], v)
        mgr.wait()  # the step the resume went back to is kept, with what it refers to
        assert sorted(os.listdir(tmp_path)) == [".statestream.lock", "step_0000000001",
                                                "step_0000000002", "step_0000000003"]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            mgr.save(4, _layered(4))  # not against damaged step 3
        assert ss.verify(mgr.step_path(4)).ok
        np.testing.assert_array_equal(mgr.load()["b"], _layered(4)["b"])


def test_a_retired_step_that_refers_to_a_damaged_step_is_not_loaded(tmp_path):
    # KeepBest(1) keeps step 1 (the best) and the newest, 3; step 2 is retired (3 refers
    # to it) and refers to step 1's 'frozen', which is damaged: 2 is damaged too.
    with ss.CheckpointManager(tmp_path, async_save=False, incremental=True,
                              keep_policy=ss.KeepBest(1, "loss")) as mgr:
        for s in (1, 2, 3):
            mgr.save(s, _layered(s), metrics={"loss": 0.1 if s == 1 else 0.9})
        assert mgr.steps() == [1, 3]
        _flip(_data_file(mgr, 1), at=8)  # 'frozen'
        with pytest.warns(RuntimeWarning) as caught:
            with pytest.raises(ss.ChecksumMismatchError, match="step_0000000001"):
                mgr.load()
    said = [str(w.message) for w in caught.list]
    assert any(m.startswith("step 2 in ") and "refers to step 1, found damaged" in m
               for m in said), said
    assert not any("loading step 2" in m for m in said), said


@pytest.mark.parametrize("async_save", [False, True])
def test_a_run_resumed_past_a_damaged_step_saves_the_steps_in_between(tmp_path, async_save):
    # The resumed run goes on from step 100, but the manager counted damaged step 200 as
    # its last save: every save (step 101 on) raised 'steps only go forward', and the
    # run could not checkpoint until it passed step 200, whose own save was skipped.
    _saved(str(tmp_path), [100, 200])
    _flip(glob.glob(str(tmp_path / "step_0000000200" / "data" / "*"))[0])
    with ss.CheckpointManager(tmp_path, async_save=async_save, save_policy=ss.EveryNSteps(50),
                              keep_policy=ss.KeepLatest(1)) as mgr:
        with pytest.warns(RuntimeWarning, match="step 200 .* is damaged, loading step 100"):
            start = mgr.load()["step"]
        assert start == 100
        saved = [s for s in range(start + 1, 201) if mgr.save(s, state_at(s))]
        assert saved == [150, 200]
        mgr.wait()
        assert mgr.steps() == [200]  # saved again: the damaged copy is replaced
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert mgr.load()["step"] == 200


@pytest.mark.parametrize("async_save", [False, True])
def test_a_run_that_starts_over_after_every_step_was_damaged_saves_from_its_first_step(
        tmp_path, async_save):
    # load() raises (every step damaged) and the run starts over from step 1: every save
    # raised 'steps only go forward' (step 200 counted as saved), for ever, unless the run
    # moved to another directory; a failed save counted damaged step 200 again.
    from statestream.testing import faults

    _saved(str(tmp_path), [100, 200])
    for s in (100, 200):
        _flip(glob.glob(str(tmp_path / f"step_{s:010d}" / "data" / "*"))[0])
    with ss.CheckpointManager(tmp_path, async_save=async_save,
                              keep_policy=ss.KeepLatest(1)) as mgr:
        with pytest.warns(RuntimeWarning, match="step 200 .* is damaged, loading step 100"):
            with pytest.raises(ss.ChecksumMismatchError, match="step_0000000200"):
                mgr.load()
        assert mgr.save(1, state_at(1))
        faults.on("save.data_synced", lambda: (_ for _ in ()).throw(OSError("full")), nth=1)
        try:
            with pytest.raises(OSError, match="full"):
                mgr.save(2, state_at(2))
                mgr.wait()
        finally:
            faults.clear()
        assert mgr.save(2, state_at(2))
        mgr.wait()
        # KeepLatest(1) keeps damaged step 200 (the newest); the newest good one stays too
        assert mgr.steps() == [2, 200]
    with ss.CheckpointManager(tmp_path, async_save=False, keep_policy=ss.KeepLatest(1)) as mgr:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            assert mgr.load()["step"] == 2
        assert mgr.save(3, state_at(3))
        assert mgr.steps() == [3, 200]


def test_the_newest_good_step_is_kept_while_a_damaged_step_is_newer(tmp_path):
    # KeepLatest(1) keeps damaged step 200 (the newest): the step the run saved since it
    # resumed from 100 must stay, or nothing loadable is left.
    _saved(str(tmp_path), [100, 200])
    _flip(glob.glob(str(tmp_path / "step_0000000200" / "data" / "*"))[0])
    with ss.CheckpointManager(tmp_path, async_save=False, keep_policy=ss.KeepLatest(1)) as mgr:
        with pytest.warns(RuntimeWarning, match="step 200 .* is damaged"):
            mgr.load()
        mgr.save(150, state_at(150))
        assert mgr.steps() == [150, 200]
        with pytest.warns(RuntimeWarning, match="step 200 .* is damaged, loading step 150"):
            assert mgr.load()["step"] == 150
        mgr.save(201, state_at(201))
        assert mgr.steps() == [201]


def test_after_a_failed_save_a_resumed_run_still_saves_below_the_damaged_step(tmp_path):
    # A background save that failed set the last step saved to the newest committed
    # one again: damaged step 200, so the resumed run's next saves were refused again.
    from statestream.testing import faults

    def boom():
        raise OSError("disk on fire")

    _saved(str(tmp_path), [100, 200])
    _flip(glob.glob(str(tmp_path / "step_0000000200" / "data" / "*"))[0])
    with ss.CheckpointManager(tmp_path) as mgr:
        with pytest.warns(RuntimeWarning, match="step 200 .* is damaged"):
            assert mgr.load()["step"] == 100
        faults.on("save.data_synced", boom, nth=1)
        try:
            assert mgr.save(150, state_at(150))
            with pytest.raises(OSError, match="disk on fire"):
                mgr.wait()
        finally:
            faults.clear()
        assert mgr.save(160, state_at(160))
        mgr.wait()
        assert mgr.steps() == [100, 160, 200]
