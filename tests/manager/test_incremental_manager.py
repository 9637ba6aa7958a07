"""CheckpointManager(incremental=True): retention with references, kills included.

Each step refers to the chunks of older steps that did not change. A step the
keep policy drops stays on storage (not listed) while a kept step refers to
it, and goes once none does. The kill cases run a real child process that is
SIGKILLed in the middle of a save or of a deletion; a new manager on the
directory must then list only intact steps, and every committed step on
storage must have every checkpoint it refers to.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import statestream as ss

STATE_SRC = """
import numpy as np

def state_at(step):
    # 'frozen' changes at step 4 only; 'lora' at every step
    g = np.random.default_rng(1000 + (0 if step < 4 else 4))
    return {"frozen": g.standard_normal((256, 256)).astype(np.float32),
            "lora": np.full((16, 64), float(step), np.float32), "step": step}
"""
_ns: dict[str, Any] = {}
exec(STATE_SRC, _ns)
state_at = _ns["state_at"]

_CHILD = STATE_SRC + """
import sys
import statestream as ss
from statestream.testing import faults

directory, point, nth = sys.argv[1], sys.argv[2], int(sys.argv[3])
if nth:
    faults.kill_at(point, nth=nth)
with ss.CheckpointManager(directory, incremental=True, async_save=False,
                          keep_policy=ss.KeepLatest(2)) as mgr:
    for step in range(1, 7):
        mgr.save(step, state_at(step))
print("DONE", flush=True)
"""


def _on_disk(d: Path) -> list[int]:
    return sorted(int(p.name[5:]) for p in d.glob("step_*") if (p / "COMMITTED").exists())


def _bases(d: Path, step: int) -> list[int]:
    doc = json.loads((d / f"step_{step:010d}" / "manifest.json").read_bytes())
    return sorted(int(b[5:]) for b in doc.get("bases", []))


def _check_state(got: dict[str, Any], step: int) -> None:
    want = state_at(step)
    np.testing.assert_array_equal(got["frozen"], want["frozen"])
    np.testing.assert_array_equal(got["lora"], want["lora"])
    assert got["step"] == step


def _no_dangling(d: Path) -> None:
    """Every committed step on storage has what it refers to, and loads."""
    present = set(_on_disk(d))
    for s in present:
        assert set(_bases(d, s)) <= present, (s, _bases(d, s), present)
        _check_state(ss.load(d / f"step_{s:010d}"), s)


def test_dropped_steps_stay_while_referenced(tmp_path: Path) -> None:
    d = tmp_path / "run"
    with ss.CheckpointManager(d, incremental=True, async_save=False,
                              keep_policy=ss.KeepLatest(2)) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, state_at(step))
        # step 1 holds 'frozen' for steps 2 and 3: retired, not listed, not deleted
        assert mgr.steps() == [2, 3] and _on_disk(d) == [1, 2, 3]
        assert _bases(d, 3) == [1] and _bases(d, 2) == [1]
        size = sum(p.stat().st_size for p in (d / "step_0000000003" / "data").iterdir())
        assert size == state_at(3)["lora"].nbytes  # only what changed was written
        mgr.save(4, state_at(4))  # 'frozen' changed: step 4 refers to nothing
        assert mgr.steps() == [3, 4] and _on_disk(d) == [1, 3, 4] and _bases(d, 4) == []
        mgr.save(5, state_at(5))  # nothing kept refers to 1 or 3 any more
        assert mgr.steps() == [4, 5] and _on_disk(d) == [4, 5]
        mgr.save(6, state_at(6))
        assert mgr.steps() == [5, 6] and _on_disk(d) == [4, 5, 6]
        assert mgr.latest_step() == 6 and [si.step for si in mgr._retention.infos()] == [5, 6]
        for step in (5, 6):
            _check_state(mgr.load(step), step)
    # a new manager recomputes the same from the manifests
    with ss.CheckpointManager(d, incremental=True, keep_policy=ss.KeepLatest(2)) as mgr:
        assert mgr.steps() == [5, 6]
        mgr.save(7, state_at(6) | {"step": 7})
        mgr.wait()
        assert mgr.steps() == [6, 7] and _on_disk(d) == [4, 6, 7]
        assert _bases(d, 7) == [4, 6]
        got = mgr.load(7)
        assert got["step"] == 7 and np.array_equal(got["lora"], state_at(6)["lora"])


def test_async_incremental_manager_and_keep_all(tmp_path: Path) -> None:
    d = tmp_path / "run"
    with ss.CheckpointManager(d, incremental=True) as mgr:
        for step in range(1, 5):
            mgr.save(step, state_at(step))
        mgr.wait()
        assert mgr.steps() == [1, 2, 3, 4]
        assert [_bases(d, s) for s in (1, 2, 3, 4)] == [[], [1], [1], []]
    _no_dangling(d)


def test_overwriting_the_latest_step_never_refers_to_itself(tmp_path: Path) -> None:
    d = tmp_path / "run"
    with ss.CheckpointManager(d, incremental=True, async_save=False) as mgr:
        mgr.save(1, state_at(1))
        mgr.save(2, state_at(2))
        mgr.save(2, state_at(3) | {"step": 2}, force=True)
        assert _bases(d, 2) == [1]
        got = mgr.load(2)
        np.testing.assert_array_equal(got["lora"], state_at(3)["lora"])


def test_a_step_deleted_by_hand_is_not_referred_to_by_the_next_steps(tmp_path: Path) -> None:
    """Step 1 holds 'frozen' for steps 2 and 3; deleted outside the manager, the next
    step (based on step 3) writes 'frozen' again instead of referring to step 1, so it
    loads, and so does every step after it."""
    d = tmp_path / "run"
    with ss.CheckpointManager(d, incremental=True, async_save=False) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, state_at(step))
        assert _bases(d, 3) == [1]
        shutil.rmtree(d / "step_0000000001")
        with pytest.warns(RuntimeWarning, match="step_0000000001 .* is missing"):
            mgr.save(4, state_at(3) | {"step": 4})
        mgr.save(5, state_at(3) | {"step": 5})
        assert _bases(d, 4) == [3] and _bases(d, 5) == [3, 4]
        for step in (4, 5):
            got = mgr.load(step)
            np.testing.assert_array_equal(got["frozen"], state_at(3)["frozen"])
            assert got["step"] == step


@pytest.mark.parametrize("reopen", [False, True], ids=["same-manager", "new-manager"])
def test_a_newest_step_with_a_damaged_manifest_is_not_the_next_base(tmp_path: Path,
                                                                     reopen: bool) -> None:
    """The newest step was always the next save's base: with its manifest damaged every
    save raised CheckpointCorruptError (a new manager, and since the engine re-reads a
    kept base manifest, the same one too), so training could no longer checkpoint."""
    mgr = ss.CheckpointManager(tmp_path, incremental=True, async_save=False,
                               keep_policy=ss.KeepLatest(2))
    for step in (1, 2):
        mgr.save(step, state_at(step))
    f = tmp_path / "step_0000000002" / "manifest.json"
    f.write_bytes(f.read_bytes()[:100])
    if reopen:
        mgr.close()
        with pytest.warns(RuntimeWarning, match="cannot read step 2"):
            mgr = ss.CheckpointManager(tmp_path, incremental=True, async_save=False,
                                       keep_policy=ss.KeepLatest(2))
    with mgr, pytest.warns(RuntimeWarning, match=r"step 2 .* cannot be the base of step 3 "
                           r"\(manifest .*step_0000000002/manifest.json"):
        mgr.save(3, state_at(3))
        mgr.save(4, state_at(4))
        assert _bases(tmp_path, 3) == [1]  # the step before the damaged one
        for step in (3, 4):
            _check_state(mgr.load(step), step)
        _check_state(mgr.load(), 4)


def test_load_skips_a_newest_step_whose_base_was_deleted(tmp_path: Path) -> None:
    """A step whose base is gone cannot be read, as if its data files were missing:
    load() warns and resumes from the step before it instead of stopping."""
    d = tmp_path / "run"
    with ss.CheckpointManager(d, incremental=True, async_save=False) as mgr:
        for step in (1, 2, 3, 4):
            mgr.save(step, state_at(step))
        assert _bases(d, 4) == [] and _bases(d, 3) == [1]
        mgr.save(5, state_at(4) | {"step": 5})  # refers to step 4 only
        assert _bases(d, 5) == [4]
        shutil.rmtree(d / "step_0000000004")
        with pytest.warns(RuntimeWarning, match=r"step 5 .* damaged, loading step 3"):
            got = mgr.load()
        _check_state(got, 3)
        with pytest.raises(ss.TruncatedFileError, match="base checkpoint step_0000000004 .* "
                           "is missing"):
            mgr.load(5)  # asked for by number: never replaced


# (point, nth): where the child is killed. Deletions happen after step 4 (step 2)
# and after step 5 (steps 3 then 1).
KILLS = [
    ("save.chunk_written", 3),
    ("commit.manifest_written", 4),
    ("commit.renamed", 5),
    ("manager.step_deleted", 1),
    ("manager.step_deleted", 2),
    ("delete.uncommitted", 1),
    ("delete.uncommitted", 2),
    ("delete.uncommitted", 3),
]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("point,nth", KILLS, ids=[f"{p}-{n}" for p, n in KILLS])
def test_killed_save_or_deletion_leaves_no_dangling_reference(tmp_path: Path, point: str,
                                                              nth: int) -> None:
    d = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.run([sys.executable, "-c", _CHILD, str(d), point, str(nth)], env=env,
                          capture_output=True, text=True, timeout=150)
    assert proc.returncode == -9, proc.stderr[-2000:]
    _no_dangling(d)
    with ss.CheckpointManager(d, incremental=True, async_save=False,
                              keep_policy=ss.KeepLatest(2)) as mgr:
        listed = mgr.steps()
        assert listed and set(listed) <= set(_on_disk(d))
        for s in listed:
            _check_state(mgr.load(s), s)
        # the next saves go on from there and clean up as usual
        last = listed[-1]
        for step in range(last + 1, 8):
            mgr.save(step, state_at(step))
        assert mgr.steps() == [6, 7]
    _no_dangling(d)
    assert _on_disk(d) == [4, 6, 7]


def test_uninterrupted_child_run(tmp_path: Path) -> None:
    """The kill cases' baseline: the same child without a kill."""
    d = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.run([sys.executable, "-c", _CHILD, str(d), "none", "0"], env=env,
                          capture_output=True, text=True, timeout=150)
    assert proc.returncode == 0 and "DONE" in proc.stdout, proc.stderr[-2000:]
    assert _on_disk(d) == [4, 5, 6]
    _no_dangling(d)


def _in_turn(step: int) -> dict[str, Any]:
    """'a' changes at odd steps, 'b' at even ones: each step refers to the one before."""
    return {"a": np.full(4096, (step + 1) // 2, np.float32),
            "b": np.full(4096, -1 - step // 2, np.float32)}


def test_a_retired_step_keeps_nothing_it_refers_to(tmp_path: Path) -> None:
    """KeepLatest(1) with arrays changing in turn: step 10 refers to step 9, which
    refers to step 8, and so on. References are flattened (10 reads only 9's chunks),
    so 9 is retired and what 9 refers to is deleted; the whole chain was kept
    (retention followed the bases of bases), so storage grew with every step. A retired
    step whose bases are gone is never listed, offered to a policy or used as a base,
    even by a manager with a policy that would keep it."""
    d = tmp_path / "run"
    with ss.CheckpointManager(d, incremental=True, async_save=False,
                              keep_policy=ss.KeepLatest(1)) as mgr:
        for step in range(1, 11):
            mgr.save(step, _in_turn(step))
            assert len(_on_disk(d)) <= 2, _on_disk(d)
        assert mgr.steps() == [10] and _on_disk(d) == [9, 10]
        assert _bases(d, 10) == [9] and _bases(d, 9) == [8]  # 8 is gone: 9 is retired
    with ss.CheckpointManager(d, incremental=True, async_save=False,
                              keep_policy=ss.KeepLatest(3)) as mgr:
        assert mgr.steps() == [10]  # 9 cannot be loaded: not listed, though 3 are kept
        mgr.save(11, _in_turn(11))
        assert _bases(d, 11) == [10]  # not 9
        mgr.save(12, _in_turn(12))
        assert mgr.steps() == [10, 11, 12] and _on_disk(d) == [9, 10, 11, 12]
        for step in mgr.steps():
            got = mgr.load(step)
            for k, v in _in_turn(step).items():
                np.testing.assert_array_equal(got[k], v)
        mgr.save(13, _in_turn(13))
        assert mgr.steps() == [11, 12, 13] and _on_disk(d) == [10, 11, 12, 13]


@pytest.mark.parametrize("keep", [None, ss.KeepLatest(5)], ids=["KeepAll", "KeepLatest(5)"])
def test_a_step_whose_base_was_deleted_by_hand_is_kept_with_a_warning(tmp_path: Path,
                                                                       keep: Any) -> None:
    """Steps 2 and 3 refer to step 1, removed by hand (rm -rf): the keep policy, even
    KeepAll, deleted them at the next save without a word. They are damaged, not
    unwanted: kept while the policy would keep them, and a RuntimeWarning names each and
    the step it lacks (restoring step 1 makes them load again)."""
    d = tmp_path / "run"
    with ss.CheckpointManager(d, incremental=True, async_save=False, keep_policy=keep) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, state_at(step))
        assert _bases(d, 2) == [1] and _bases(d, 3) == [1]
        shutil.move(d / "step_0000000001", tmp_path / "moved")
        with pytest.warns(RuntimeWarning) as caught:
            mgr.save(4, state_at(4))
        said = [str(w.message) for w in caught.list]
        for step in (2, 3):
            assert any(m.startswith(f"step {step} in {d} refers to step 1, which is not "
                                    "committed") for m in said), said
        assert _on_disk(d) == [2, 3, 4]
        shutil.move(tmp_path / "moved", d / "step_0000000001")
        for step in (2, 3):
            _check_state(mgr.load(step), step)


def test_a_step_a_checkpoint_of_the_users_refers_to_is_kept_until_it_no_longer_does(
        tmp_path: Path) -> None:
    """ss.save(d / "export", base=mgr.step_path(1)) (a base must be a sibling) refers to
    step 1's chunks: KeepLatest(1) deleted step 1 at the next save, without a word, and
    the export no longer loaded. Step 1 is retired instead (kept, not listed), with one
    RuntimeWarning naming the export, and deleted once nothing refers to it."""
    d = tmp_path / "run"
    with ss.CheckpointManager(d, incremental=True, async_save=False,
                              keep_policy=ss.KeepLatest(1)) as mgr:
        mgr.save(1, state_at(1))
        ss.save(d / "export", state_at(1) | {"step": 99}, base=mgr.step_path(1))
        assert list(ss.metadata(d / "export").bases) == ["step_0000000001"]
        with pytest.warns(RuntimeWarning, match=r"keeps step 1 .* export in .* refers to"):
            mgr.save(4, state_at(4))  # 'frozen' changed: step 4 refers to nothing
        assert mgr.steps() == [4] and _on_disk(d) == [1, 4]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            mgr.save(5, state_at(5))
        assert not caught, [str(w.message) for w in caught]  # warned once
        assert mgr.steps() == [5] and _on_disk(d) == [1, 4, 5]
        got = ss.load(d / "export")
        assert got["step"] == 99 and np.array_equal(got["frozen"], state_at(1)["frozen"])
        shutil.rmtree(d / "export")
        mgr.save(6, state_at(6))
        assert mgr.steps() == [6] and _on_disk(d) == [4, 6]  # 6 refers to 4
