"""Incremental steps behind a local tier: references persist with the steps.

A step saved with ``incremental=True`` into the local tier refers to chunks of
older local steps. Persisting it copies only its own files, so every step it
refers to must be committed in the persistent directory first; these tests
check that on real files (a SIGKILLed child for the crash case), with both
keep policies dropping steps as they go. Two processes on one node and on
two nodes are in tests/distributed/test_tier_multiprocess.py; S3 behind the
tier in tests/storage/test_s3_tier.py.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import statestream as ss
from statestream import _hooks
from statestream.engine import copy_checkpoint

STATE_SRC = """
import numpy as np

def state_at(step):
    # 'frozen' (1 MiB) changes at step 4 only; 'lora' at every step
    g = np.random.default_rng(1000 + (0 if step < 4 else 4))
    return {"frozen": g.standard_normal((512, 512)).astype(np.float32),
            "lora": np.full((16, 64), float(step), np.float32), "step": step}
"""
_ns: dict[str, Any] = {}
exec(STATE_SRC, _ns)
state_at = _ns["state_at"]
FROZEN = 512 * 512 * 4


def _equal(got: dict[str, Any], step: int) -> None:
    want = state_at(step)
    assert got.keys() == want.keys()
    for k in ("frozen", "lora"):
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)
    assert got["step"] == step


def _committed(d: Path) -> list[int]:
    return sorted(int(p.name[5:]) for p in d.glob("step_*")
                  if p.is_dir() and (p / "COMMITTED").exists())


def _bases(d: Path, step: int) -> list[int]:
    doc = json.loads((d / f"step_{step:010d}" / "manifest.json").read_bytes())
    return sorted(int(b[5:]) for b in doc.get("bases", []))


def _own_bytes(d: Path, step: int) -> int:
    return sum(f.stat().st_size for f in (d / f"step_{step:010d}" / "data").iterdir())


def _whole(d: Path) -> None:
    """Every committed step in ``d`` has every step it refers to, and loads exactly."""
    for s in _committed(d):
        assert set(_bases(d, s)) <= set(_committed(d)), (s, _bases(d, s), _committed(d))
        assert ss.verify(str(d / f"step_{s:010d}")).ok
        _equal(ss.load(str(d / f"step_{s:010d}")), s)


def _mgr(tmp_path: Path, **kw: Any) -> ss.CheckpointManager:
    return ss.CheckpointManager(str(tmp_path / "persist"), local_tier=str(tmp_path / "local"),
                                incremental=True, **kw)


@pytest.mark.parametrize("mode", ["sync", "async", "lazy"])
def test_incremental_steps_persist_with_what_they_refer_to(tmp_path, mode):
    persist, local = tmp_path / "persist", tmp_path / "local"
    with _mgr(tmp_path, async_save=mode != "sync", lazy=mode == "lazy",
              local_keep_policy=ss.KeepLatest(1), keep_policy=ss.KeepLatest(2)) as mgr:
        for step in range(1, 7):
            assert mgr.save(step, state_at(step))
        mgr.wait()
        assert mgr.persisted_steps() == [5, 6]
        assert mgr.steps() == [5, 6]
        # 4 holds 'frozen' for 5 and 6: retired in both tiers (kept, not listed)
        assert _committed(persist) == [4, 5, 6]
        _equal(mgr.load(), 6)
        _equal(mgr.load(5), 5)  # persisted only: read from the directory
        assert mgr.step_path(6).startswith(str(local))
    # only the changed chunks were written, locally and in the directory
    for d in (persist, local):
        assert _bases(d, 6) == [4] and _own_bytes(d, 6) < FROZEN // 4
        assert _own_bytes(d, 4) >= FROZEN
    assert _committed(local) == [4, 6]
    _whole(persist)
    _whole(local)


def test_a_base_missing_from_the_directory_is_persisted_again(tmp_path):
    persist = tmp_path / "persist"
    with _mgr(tmp_path, async_save=False) as mgr:
        mgr.save(1, state_at(1))
        mgr.wait()
        shutil.rmtree(persist / "step_0000000001")  # deleted behind the manager's back
        mgr.save(2, state_at(2))
        mgr.wait()
        assert mgr.persisted_steps() == [1, 2]
    assert _bases(persist, 2) == [1]
    _whole(persist)


def test_a_step_whose_base_is_nowhere_is_not_persisted(tmp_path):
    persist, local = tmp_path / "persist", tmp_path / "local"
    gate = threading.Event()
    _hooks.register("tier.persist", lambda: gate.wait(30))
    try:
        mgr = _mgr(tmp_path, async_save=False)
        mgr.save(1, state_at(1))
        mgr.save(2, state_at(2))
        # step 1 vanishes from both tiers before anything is persisted
        shutil.rmtree(local / "step_0000000001")
        gate.set()
        # step 1's persistence fails first, then step 2's (retried by wait) for this reason:
        with pytest.raises(ss.CheckpointError, match="refers to chunks of step 1, which "
                           "is committed neither in"):
            mgr.wait()
        assert mgr.persisted_steps() == [] and mgr.unpersisted_steps() == [2]
        with pytest.raises(ss.CheckpointError, match="refers to chunks of step 1"):
            mgr.close()  # still local only: close says so too
    finally:
        gate.set()
        _hooks.clear()
    assert not (persist / "step_0000000002").exists()


def test_bases_of_steps_waiting_to_persist_are_protected(tmp_path):
    gate = threading.Event()
    _hooks.register("tier.persist", lambda: gate.wait(30))
    try:
        with _mgr(tmp_path, async_save=False) as mgr:
            mgr.save(3, state_at(3))
            mgr.save(4, state_at(4))
            mgr.save(5, state_at(5))
            tier = mgr._tier
            assert tier is not None
            # 5 refers to 4 (frozen changed at 4), 4 to nothing; both wait
            assert tier.bases_to_keep() == {4}
            gate.set()
            mgr.wait()
            assert tier.bases_to_keep() == set()
    finally:
        gate.set()
        _hooks.clear()


def test_copy_checkpoint_refuses_to_commit_a_copy_without_its_base(tmp_path):
    a, b = str(tmp_path / "src" / "a"), str(tmp_path / "src" / "b")
    ss.save(a, state_at(1), hashes=True)
    ss.save(b, state_at(2), base=a)
    dst = tmp_path / "dst"
    with pytest.raises(ss.CheckpointError, match="its base a, which is not committed"):
        copy_checkpoint(b, str(dst / "b"))
    assert not (dst / "b").exists()
    copy_checkpoint(a, str(dst / "a"))
    copy_checkpoint(b, str(dst / "b"))
    _equal(ss.load(str(dst / "b")), 2)


_CHILD = STATE_SRC + """
import sys
import statestream as ss
from statestream.testing import faults

persist, local, mode = sys.argv[1], sys.argv[2], sys.argv[3]
faults.kill_at("tier.persist", nth=3)
mgr = ss.CheckpointManager(persist, local_tier=local, incremental=True,
                           async_save=mode != "sync", keep_policy=ss.KeepLatest(1),
                           local_keep_policy=ss.KeepLatest(1))
for step in range(1, 7):
    mgr.save(step, state_at(step))
    print("saved", step, flush=True)
mgr.wait()
print("DONE", flush=True)
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_sigkill_before_persistence_loses_nothing(tmp_path, mode):
    persist, local = tmp_path / "persist", tmp_path / "local"
    proc = subprocess.run([sys.executable, "-c", _CHILD, str(persist), str(local), mode],
                          capture_output=True, text=True, timeout=90)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    # what was persisted before the kill (at the third persistence): usually some of
    # steps 1-3 (step 2 refers to nothing step 3 needs, so it is dropped unpersisted when
    # step 3 commits first); on a loaded machine the saves run ahead of the persistence
    # and the keep policies drop more steps unpersisted, so later ones can be there
    # (step 4 was, once). Each with every step it refers to.
    before = _committed(persist)
    assert before and set(before) <= set(range(1, 7)), before
    assert all(set(_bases(persist, s)) <= set(before) for s in before), before
    left = _committed(local)
    # the newest step saved before the kill is there (older unpersisted ones the
    # directory's KeepLatest(1) would delete at once may have been dropped unpersisted)
    assert left and max(left) >= 3, left
    with ss.CheckpointManager(str(persist), local_tier=str(local), incremental=True,
                              keep_policy=ss.KeepLatest(1)) as mgr:
        mgr.wait()  # the new manager persisted what the killed one had not
        # The child may have committed more steps locally before the kill (its
        # persistence runs behind the saves); 'frozen' changes at step 4, so the
        # newest refers to step 1 (top 3) or 4 (top 5, 6) or to nothing (top 4).
        top = max(left)
        refs = _bases(local, top)  # flattened: every step it refers to
        assert refs == ([1] if top < 4 else [] if top == 4 else [4])
        assert mgr.persisted_steps() == [top]  # KeepLatest(1); what it refers to is retired
        assert _committed(persist) == sorted({*refs, top}) and _bases(persist, top) == refs
        last = mgr.latest_step()
        _equal(mgr.load(), last)
        assert mgr.save(last + 1, state_at(last + 1))
    _whole(persist)
    _whole(local)
    os.rename(local, str(local) + "-lost")  # a new machine: the directory alone
    with ss.CheckpointManager(str(persist), local_tier=str(local), incremental=True) as mgr:
        _equal(mgr.load(), last + 1)


def test_a_resume_on_a_new_machine_makes_the_next_save_incremental(tmp_path):
    persist = tmp_path / "persist"
    with _mgr(tmp_path, keep_policy=ss.KeepLatest(2)) as mgr:
        for step in range(1, 6):
            mgr.save(step, state_at(step))
    os.rename(tmp_path / "local", tmp_path / "old-local")  # a new machine
    with _mgr(tmp_path, keep_policy=ss.KeepLatest(2)) as mgr:
        _equal(mgr.load(), 5)  # from the directory; then copied into the tier
        mgr.wait()
        local = tmp_path / "local"
        assert _committed(local) == [4, 5]  # 5 refers to 4 (frozen changed at 4)
        assert (local / "step_0000000005.persisted").exists()
        mgr.save(6, state_at(6))
        mgr.wait()
        assert _bases(local, 6) == [4] and _own_bytes(local, 6) < FROZEN // 4
        assert mgr.persisted_steps() == [5, 6]
        _equal(mgr.load(6), 6)
    _whole(persist)
    _whole(local)


def test_loading_an_older_step_copies_nothing(tmp_path):
    with _mgr(tmp_path) as mgr:
        for step in range(1, 4):
            mgr.save(step, state_at(step))
    os.rename(tmp_path / "local", tmp_path / "old-local")
    with _mgr(tmp_path) as mgr:
        _equal(mgr.load(2), 2)  # evaluation of an old step, not a resume
        mgr.wait()
        assert _committed(tmp_path / "local") == []


def test_a_failed_copy_into_the_tier_only_warns(tmp_path, monkeypatch):
    from statestream.manager import _tierops

    with _mgr(tmp_path) as mgr:
        for step in range(1, 3):
            mgr.save(step, state_at(step))
    os.rename(tmp_path / "local", tmp_path / "old-local")

    def down(*a: Any, **k: Any) -> None:
        raise ss.StorageError("the object store is down (injected)")

    monkeypatch.setattr(_tierops, "copy_checkpoint", down)  # the copy into the tier
    with _mgr(tmp_path) as mgr:
        with pytest.warns(RuntimeWarning, match="could not copy step 2.*writes everything"):
            _equal(mgr.load(), 2)  # the copy runs in the background: it warns
            mgr.wait()
        monkeypatch.undo()
        assert _committed(tmp_path / "local") == []
        mgr.save(3, state_at(3))  # a whole save; nothing was raised
        mgr.wait()
        assert mgr.persisted_steps() == [1, 2, 3]
    _whole(tmp_path / "persist")


@pytest.mark.timeout(240)
@pytest.mark.parametrize("async_save", [False, True])
def test_a_store_that_hangs_through_100_saves_uploads_only_what_the_directory_keeps(
        tmp_path, monkeypatch, async_save):
    """The store hangs while step 2 is being persisted and steps 3..101 are saved (their
    persistences queue up behind it): with KeepLatest(2) on the directory, the local tier
    holds only the steps that policy keeps, step 1 (which holds 'frozen' for all of them),
    the step being copied and the new one, and once the store is back only those are
    uploaded, not 98 steps (docs/manager.md). Each queued step's save-time base (the step
    before it) was protected until the step was persisted, even after the step had
    committed and its manifest showed it referred to step 1 only: nothing was dropped,
    the tier held every step and all of them were uploaded once the store was back."""
    from statestream.manager import _tier

    hangs, back = threading.Event(), threading.Event()
    _hooks.register("tier.persist", lambda: back.wait(120) if hangs.is_set() else None)
    uploads: list[int] = []
    copy = _tier.LocalTier._copy
    monkeypatch.setattr(_tier.LocalTier, "_copy",
                        lambda self, step: (uploads.append(step), copy(self, step))[1])

    def small(step: int) -> dict[str, Any]:  # 'frozen' never changes, 'lora' always
        return {"frozen": np.arange(16_384, dtype=np.float32),
                "lora": np.full(64, float(step), np.float32)}

    try:
        mgr = _mgr(tmp_path, async_save=async_save, keep_policy=ss.KeepLatest(2),
                   local_keep_policy=ss.KeepLatest(1))
        mgr.save(1, small(1))
        mgr.wait()
        hangs.set()
        most = 0
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # the steps not persisted
            for step in range(2, 102):
                assert mgr.save(step, small(step))
                if mgr.in_flight is not None:
                    mgr.in_flight.result()  # committed locally (async saves)
                most = max(most, len(_committed(tmp_path / "local")))
        # 1 (referred to), 2 (being copied), the two the policy keeps and the new one
        assert most <= 5, most
        assert _bases(tmp_path / "local", 101) == [1]
        uploads.clear()
        back.set()  # the store is back
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            mgr.wait()
        assert set(uploads) <= {2, 100, 101} and {100, 101} <= set(uploads), uploads
        assert mgr.persisted_steps() == [100, 101] and mgr.unpersisted_steps() == []
        for step in (100, 101):
            got = mgr.load(step)
            np.testing.assert_array_equal(got["lora"], small(step)["lora"])
            np.testing.assert_array_equal(got["frozen"], small(step)["frozen"])
        mgr.close()
    finally:
        back.set()
        _hooks.clear()


def test_a_local_copy_a_load_found_damaged_is_not_the_next_base(tmp_path):
    # The load fell back to the persisted copy, but the damaged local copy stayed the
    # newest local step and the next save's base: its unchanged chunk referred to the
    # damaged bytes, so its own local copy (loaded first) was damaged too, and so was
    # every later one while that array did not change.
    persist, local = tmp_path / "persist", tmp_path / "local"

    def state(s: int) -> dict:
        return {"frozen": np.arange(4096, dtype=np.float32), "w": np.full(64, s % 3, np.int64)}

    def manager() -> ss.CheckpointManager:
        return ss.CheckpointManager(persist, local_tier=local, async_save=False,
                                    incremental=True)

    with manager() as mgr:
        for s in (1, 2):
            mgr.save(s, state(s))
    (f,) = (local / "step_0000000002" / "data").iterdir()  # w alone; frozen is step 1's
    with open(f, "r+b") as fh:
        fh.seek(8)
        b = fh.read(1)
        fh.seek(8)
        fh.write(bytes([b[0] ^ 1]))
    with manager() as mgr:
        with pytest.warns(RuntimeWarning, match="local copy of step 2 .* is damaged"):
            assert mgr.load()["w"][0] == 2
        with warnings.catch_warnings(record=True):
            warnings.simplefilter("always")
            mgr.save(3, state(2))  # w as in step 2
        report = ss.verify(str(local / "step_0000000003"))
        assert report.ok, report.problems
        assert _bases(local, 3) == [1]
        mgr.wait()
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # read from the local copy, which verifies
            assert mgr.load(3)["w"][0] == 2


def test_a_damaged_local_copy_of_a_base_is_not_the_next_base_nor_what_refers_to_it(
        tmp_path):
    # Steps 2 and 3 refer to step 1's 'frozen' chunk, whose local copy is damaged. The
    # resume's load of step 3 failed on step 1's file and fell back to the persisted
    # copy, but only step 3 was recorded damaged: the next save took step 2 as its base
    # and referred to step 1's damaged bytes, so every later local copy was damaged
    # from birth. Step 1 is recorded damaged too, and step 2, which refers to it, is no
    # base either: step 4 is a full save, and its local copy verifies.
    persist, local = tmp_path / "persist", tmp_path / "local"

    def state(s: int) -> dict:
        return {"frozen": np.arange(4096, dtype=np.float32), "w": np.full(64, s, np.int64)}

    def manager() -> ss.CheckpointManager:
        return ss.CheckpointManager(persist, local_tier=local, async_save=False,
                                    incremental=True)

    with manager() as mgr:
        for s in (1, 2, 3):
            mgr.save(s, state(s))
    assert _bases(local, 2) == [1] and _bases(local, 3) == [1]
    doc = json.loads((local / "step_0000000001" / "manifest.json").read_bytes())
    (frozen,) = [a for a in doc["arrays"] if a["dtype"] == "float32"]
    file, offset = frozen["chunks"][0][:2]
    with open(local / "step_0000000001" / doc["files"][file][0], "r+b") as fh:
        fh.seek(offset + 8)
        b = fh.read(1)
        fh.seek(offset + 8)
        fh.write(bytes([b[0] ^ 1]))
    with manager() as mgr:
        with pytest.warns(RuntimeWarning, match="local copy of step 3 .* is damaged"):
            assert mgr.load()["w"][0] == 3
        with pytest.warns(RuntimeWarning, match="step 2 .* cannot be the base of step 4: a "
                          "load found a step it refers to damaged"):
            mgr.save(4, state(4))
        assert _bases(local, 4) == []
        mgr.save(5, state(5))
        assert _bases(local, 5) == [4]
        for s in (4, 5):
            report = ss.verify(str(local / f"step_{s:010d}"))
            assert report.ok, report.problems


def test_a_step_saved_again_in_the_tier_can_be_persisted(tmp_path):
    # Saved again (force=True) against the step before it, step 4 referred to steps 3
    # and 2, which the directory had deleted (the old step 4 was a full save); step 2's
    # own base, step 1, was gone everywhere, so step 2 could not be committed there again
    # and the new step 4 never could: every wait() and close() raised, and the directory
    # kept the old copy. A step saved again in the tier is a full save.
    persist, local = tmp_path / "persist", tmp_path / "local"
    a = {k: np.full(1000, k, np.float32) for k in (1, 2, 3)}
    b = {k: np.full(1000, 10 + k, np.float32) for k in (1, 2, 3)}
    with ss.CheckpointManager(persist, local_tier=local, async_save=False, incremental=True,
                              keep_policy=ss.KeepLatest(1)) as mgr:
        for s, (i, j) in [(1, (1, 1)), (2, (1, 2)), (3, (2, 2)), (4, (3, 3))]:
            mgr.save(s, {"A": a[i], "B": b[j]})
            mgr.wait()
        assert _bases(local, 2) == [1] and _bases(local, 3) == [2] and _committed(persist) == [4]
        mgr.save(4, {"A": a[2], "B": b[2]}, force=True)  # as step 3
        mgr.wait()
        assert mgr.persisted_steps() == [4]
    got = ss.load(str(persist / "step_0000000004"))
    np.testing.assert_array_equal(got["A"], a[2])
    np.testing.assert_array_equal(got["B"], b[2])
    assert ss.verify(str(persist / "step_0000000004")).ok


def test_past_a_damaged_local_copy_the_base_is_one_that_can_be_persisted(tmp_path):
    # As in the test above, but the base comes after a damaged newest local copy: step 4's
    # local copy damaged, the next save took step 3 as its base, and step 3 refers to step
    # 2, whose own base (step 1) is gone from both tiers; step 5 could never be persisted
    # (every wait() and close() raised). Now the steps whose chain is gone are passed over
    # with a warning, and step 5 is a full save.
    persist, local = tmp_path / "persist", tmp_path / "local"
    a = {k: np.full(1000, k, np.float32) for k in (1, 2, 3)}
    b = {k: np.full(1000, 10 + k, np.float32) for k in (1, 2, 3)}

    def manager() -> ss.CheckpointManager:
        return ss.CheckpointManager(persist, local_tier=local, async_save=False,
                                    incremental=True, keep_policy=ss.KeepLatest(1))

    with manager() as mgr:
        for s, (i, j) in [(1, (1, 1)), (2, (1, 2)), (3, (2, 2)), (4, (3, 3))]:
            mgr.save(s, {"A": a[i], "B": b[j]})
            mgr.wait()
        assert _bases(local, 3) == [2] and _committed(persist) == [4]
    (f,) = (local / "step_0000000004" / "data").iterdir()
    f.write_bytes(bytes([f.read_bytes()[0] ^ 1]) + f.read_bytes()[1:])
    with manager() as mgr:
        with pytest.warns(RuntimeWarning, match="local copy of step 4 .* is damaged"):
            assert mgr.load()["A"][0] == 3
        with pytest.warns(RuntimeWarning, match=r"step 3 .* cannot be the base of step 5 "
                          r"\(cannot persist step 3: it refers to chunks of step 1"):
            mgr.save(5, {"A": a[2], "B": b[2]})
        mgr.wait()
        assert mgr.persisted_steps() == [5] and mgr.unpersisted_steps() == []
    assert _bases(persist, 5) == []
    got = ss.load(str(persist / "step_0000000005"))
    np.testing.assert_array_equal(got["A"], a[2])
    np.testing.assert_array_equal(got["B"], b[2])


def test_with_several_nodes_past_a_damaged_copy_the_base_can_be_persisted_too():
    # The several-node choice (the newest step every node's tier holds) passed over a
    # damaged local copy but not a step whose chain is gone: as in the test above, step
    # 3 refers to step 2, whose base (step 1) is in neither tier. Stubs stand for a
    # leader's tier (one process: its candidates are every node's).
    from types import SimpleNamespace

    from statestream.distributed import SingleProcess
    from statestream.manager._tierbase import base_for

    bases = {2: [1], 3: [2], 4: [3]}
    tier = SimpleNamespace(
        groups=SimpleNamespace(leaders=lambda: [0, 1], is_leader=True),
        steps=lambda: [2, 3, 4], damaged_copies={4}, root="/local",
        is_committed=lambda s: s in bases, path=lambda s: f"/local/step_{s:010d}",
        current_in_persistent=lambda s: False,
        persistent=SimpleNamespace(directory="/persist"),
        retention=SimpleNamespace(bases_of=lambda s: bases.get(s)))
    assert base_for(5, SingleProcess(), tier, list, str) is None  # a full save
    bases[2] = []  # step 2 a full save: 3 can be persisted (2 copied there first)
    assert base_for(5, SingleProcess(), tier, list, str) == 3
    tier.damaged_copies = set()  # nothing passed over: the newest, unchecked
    assert base_for(5, SingleProcess(), tier, list, str) == 4
