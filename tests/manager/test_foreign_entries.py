"""What a manager finds in its directory that no save of its made.

A file named like a step, or a step that is a symbolic link to a checkpoint
kept elsewhere: the manager opens, lists, saves and cleans up around them, and
never deletes or damages what is not its own (docs/manager.md: "everything else
in the directory is left alone").
"""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest

import statestream as ss
from statestream.storage import storage_for

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="POSIX links")


def test_a_file_named_like_a_step_is_left_alone(tmp_path):
    with ss.CheckpointManager(tmp_path, async_save=False) as mgr:
        mgr.save(1, {"w": np.ones(3)})
    stray = tmp_path / "step_0000000002"
    stray.write_text("not a checkpoint")
    # it used to stop the manager from opening: "deleting ... failed: Not a directory"
    with ss.CheckpointManager(tmp_path, async_save=False) as mgr:
        assert mgr.steps() == [1]
        with pytest.raises(ss.CheckpointExistsError, match="step_0000000002 exists and is a "
                                                           "file"):
            mgr.save(2, {"w": np.full(3, 2.0)})
        mgr.save(3, {"w": np.full(3, 3.0)})
        assert mgr.steps() == [1, 3]
    assert stray.read_text() == "not a checkpoint"


def test_a_linked_step_is_unlinked_never_emptied(tmp_path):
    elsewhere = tmp_path / "pretrained"
    ss.save(elsewhere, {"w": np.arange(3.0)})
    run = tmp_path / "run"
    with ss.CheckpointManager(run, async_save=False, keep_policy=ss.KeepLatest(1)) as mgr:
        mgr.save(5, {"w": np.zeros(3)})
    os.symlink(elsewhere, run / "step_0000000000")  # linked in by hand, as step 0
    with ss.CheckpointManager(run, async_save=False, keep_policy=ss.KeepLatest(1)) as mgr:
        assert mgr.load(0)["w"].tolist() == [0.0, 1.0, 2.0]
        mgr.save(6, {"w": np.zeros(3)})
        assert mgr.steps() == [6]
    assert sorted(os.listdir(run)) == [".statestream.lock", "step_0000000006"]
    # the policy deleted the link; it used to delete the linked checkpoint's marker
    assert ss.load(elsewhere)["w"].tolist() == [0.0, 1.0, 2.0]


def test_deleting_a_file_is_refused(tmp_path):
    f = tmp_path / "ckpt"
    f.write_bytes(b"x")
    storage, path = storage_for(str(f))
    with pytest.raises(ss.StorageError) as info:
        storage.delete(path)
    assert isinstance(info.value, NotADirectoryError) and "not a checkpoint directory" in str(
        info.value)
    assert f.read_bytes() == b"x"
    storage.delete(str(tmp_path / "missing"))  # a missing path is fine


def test_a_directory_named_like_a_local_record_is_left_alone(tmp_path):
    local = tmp_path / "local"
    with ss.CheckpointManager(tmp_path / "persist", local_tier=local, async_save=False) as mgr:
        mgr.save(1, {"w": np.ones(3)})
    for name in ("step_0000000005.persisted", "step_0000000006.unpersisted"):
        (local / name).mkdir()
        (local / name / "notes").write_text("mine")
    # it used to stop the manager from opening: a raw IsADirectoryError
    with ss.CheckpointManager(tmp_path / "persist", local_tier=local, async_save=False) as mgr:
        assert mgr.steps() == [1]
        mgr.save(2, {"w": np.full(3, 2.0)})
        mgr.wait()
        assert mgr.persisted_steps() == [1, 2] and mgr.unpersisted_steps() == []
    for name in ("step_0000000005.persisted", "step_0000000006.unpersisted"):
        assert (local / name / "notes").read_text() == "mine"
    # nor does it count as a record: step 5 saved here is persisted, not taken as done
    mgr = ss.CheckpointManager(tmp_path / "persist", local_tier=local, async_save=False)
    mgr.save(5, {"w": np.full(3, 5.0)})
    assert 5 in mgr.unpersisted_steps()
    for done in (mgr.wait, mgr.close):  # the copy went through; its record cannot be
        with pytest.raises(ss.StorageError, match="cannot record that step 5 is persisted"):
            done()
    assert ss.load(str(tmp_path / "persist" / "step_0000000005"))["w"].tolist() == [5.0] * 3


@pytest.mark.parametrize("meta", [{"time": "yesterday"}, {"metrics": ["loss", 0.1]},
                                  {"metrics": {"loss": 0.1}, "time": [1]}, {"time": True}])
@pytest.mark.parametrize("keep", [ss.KeepAll(), ss.KeepLatest(2), ss.KeepBest(2, "loss")])
def test_a_step_saved_by_hand_with_other_metadata_is_still_a_step(tmp_path, meta, keep):
    # ss.save's meta may hold a "time" or "metrics" no manager's save writes: they are
    # ignored (creation time, no metrics) with a warning naming the step; they used to
    # raise a bare ValueError/TypeError/AttributeError from every save, or the open
    ss.save(tmp_path / "step_0000000005", {"w": np.ones(3)}, meta=meta)
    created = ss.metadata(tmp_path / "step_0000000005").meta["created_unix"]
    metrics = meta["metrics"] if isinstance(meta.get("metrics"), dict) else {}
    with pytest.warns(RuntimeWarning, match=r"step 5 \(.*step_0000000005\) records .*ss.save"):
        with ss.CheckpointManager(tmp_path, keep_policy=keep, async_save=False) as mgr:
            assert mgr.step_info(5)["time"] == created
            assert mgr.step_info(5)["metrics"] == metrics
            assert mgr.save(6, {"w": np.zeros(3)}, metrics={"loss": 0.5})
            assert mgr.best_step("loss") == (5 if metrics else 6)
            assert mgr.save(7, {"w": np.zeros(3)}, metrics={"loss": 0.7})
            assert mgr.steps()[-2:] == [6, 7]
