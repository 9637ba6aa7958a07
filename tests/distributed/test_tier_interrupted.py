"""Node-local copies that are not one whole save, across real processes (gloo).

Each node's leader commits its node's copy of a step on its own, so the
nodes' copies can disagree: a save interrupted (SIGKILL) between two nodes'
commits, a save again (``force=True``) that one node committed and another
did not, a node whose copy is damaged. Checked, with two processes, each with
its own local tier (``node0``, ``node1``) and one shared persistent directory:

* a ``force=True`` save again killed between the nodes' commits: the restarted
  job loads the old step on every rank (never one rank's new values next to
  another's old ones), and the persisted copy is never replaced by a mix of
  the two saves (with and without peer copies);
* ``copy_checkpoint`` refuses processes' copies that are different saves;
* a damaged manifest in one node's copy: the persisted copy loads, on every
  rank, and without one the damage is raised naming that node's file, and a
  resume goes back a step;
* a commit that fails on one node: the nodes that committed remove their copy,
  and the step may be saved again; a leader SIGKILLed between the nodes'
  commits: the restarted job removes the step (committed on one node only,
  never persisted) and resumes from the step before;
* a node's copy restored from its peer after the persistent directory lost
  the step is persisted again (the surviving node's record of it being
  persisted no longer leaves it unpersisted on the restored node forever).
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _launch import Context, launch  # noqa: E402
from _workers import assert_tree_equal as _equal  # noqa: E402
from _workers import (
    init_gloo,  # noqa: E402
    require_gloo,  # noqa: E402
)

torch, dist = require_gloo()

import statestream as ss  # noqa: E402

THIS = os.path.abspath(__file__)
WORLD = 2


def state_at(step: int, rank: int, value: int | None = None) -> dict[str, Any]:
    """Step ``step``'s state (``value``: other numbers, as a save again would have)."""
    v = step if value is None else value
    return {"shared": {"w": np.arange(20_000, dtype=np.float32) + v, "step": step},
            "per_rank": {f"rank{rank}": np.full((30, 100), rank * 1000 + v, dtype=np.int64)}}


def expected(step: int, value: int | None = None) -> dict[str, Any]:
    out = state_at(step, 0, value)
    for r in range(1, WORLD):
        out["per_rank"].update(state_at(step, r, value)["per_rank"])
    return out



def _init(ctx: Context) -> None:
    init_gloo(ctx)


def _manager(ctx: Context, **kw: Any) -> ss.CheckpointManager:
    a = ctx.args
    return ss.CheckpointManager(os.path.join(a["root"], "persist"),
                                local_tier=os.path.join(a["root"], f"node{ctx.rank}"),
                                replicate_to_peers=a.get("peers", True), **kw)


def _die_later() -> None:
    time.sleep(3)  # the other node's leader commits its copy meanwhile
    os.kill(os.getpid(), signal.SIGKILL)


def forced_worker(ctx: Context) -> None:
    """Steps 1..3 saved and persisted; step 3 saved again (``force=True``, other
    values); node 1's leader is SIGKILLed while committing its new copy."""
    from statestream.testing import faults

    _init(ctx)
    mgr = _manager(ctx, async_save=False)
    for step in (1, 2, 3):
        mgr.save(step, state_at(step, ctx.rank))
    mgr.wait()
    if ctx.rank == 1:
        faults.on("commit.manifest_written", _die_later)
    mgr.save(3, state_at(3, ctx.rank, 300), force=True)


def resume_worker(ctx: Context) -> dict[str, Any]:
    _init(ctx)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with _manager(ctx) as mgr:
            out = {"steps": mgr.steps(), "value3": int(mgr.load(3)["shared"]["w"][0])}
            _equal(mgr.load(), expected(3, out["value3"]))
            mgr.wait()
    out["warnings"] = [str(w.message) for w in seen]
    return out


@pytest.mark.timeout(300)
@pytest.mark.parametrize("peers", [False, True])
def test_an_interrupted_forced_save_again_keeps_the_persisted_step(tmp_path: Path,
                                                                   peers: bool) -> None:
    root = str(tmp_path / "job")
    res = launch(THIS, "forced_worker", WORLD, tmp_path, args={"root": root, "peers": peers},
                 timeout_s=120, check=False, fail_grace_s=30)
    assert res[1].returncode == -9, [(r.returncode, r.error) for r in res]
    persisted = os.path.join(root, "persist", "step_0000000003")
    _equal(ss.load(persisted), expected(3))
    res = launch(THIS, "resume_worker", WORLD, tmp_path, tag="resume", timeout_s=180,
                 args={"root": root, "peers": peers})
    for r in res:
        # the old step 3 on every rank (node 1 never committed the new one)
        assert r.value["steps"] == [1, 2, 3] and r.value["value3"] == 3, r.value
        assert any("different saves" in w for w in r.value["warnings"]), r.value
    # and the persisted copy is still the old, whole step 3: never a mix of the two
    assert ss.verify(persisted).ok
    _equal(ss.load(persisted), expected(3))
    for node in ("node0", "node1"):  # neither node's copy is left to be persisted
        assert not os.path.exists(os.path.join(root, node, "step_0000000003"))


def copy_worker(ctx: Context) -> dict[str, Any]:
    """Each process's 'node' copy is another save of the same checkpoint."""
    from statestream.distributed import SingleProcess, default_collective
    from statestream.engine import copy_checkpoint

    _init(ctx)
    a = ctx.args
    src = os.path.join(a["root"], f"node{ctx.rank}", "ckpt")
    # the same file names, another save: rank 1's copy holds other values
    ss.save(src, state_at(1, 0, ctx.rank), collective=SingleProcess())
    try:
        copy_checkpoint(src, os.path.join(a["root"], "dst"), collective=default_collective(),
                        files=lambda n: n.startswith(f"data/r{ctx.rank}-"))
    except ss.CheckpointError as exc:
        return {"error": type(exc).__name__, "message": str(exc)}
    return {"error": None}


@pytest.mark.timeout(120)
def test_copy_checkpoint_refuses_copies_of_different_saves(tmp_path: Path) -> None:
    root = str(tmp_path / "job")
    res = launch(THIS, "copy_worker", WORLD, tmp_path, args={"root": root}, timeout_s=90)
    for r in res:
        assert r.value["error"] == "CheckpointCorruptError", r.value
        assert "different saves" in r.value["message"], r.value
    assert not os.path.exists(os.path.join(root, "dst"))


def save_worker(ctx: Context) -> str:
    _init(ctx)
    with _manager(ctx) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, state_at(step, ctx.rank))
    return "ok"


def damaged_worker(ctx: Context) -> dict[str, Any]:
    _init(ctx)
    out: dict[str, Any] = {}
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with _manager(ctx) as mgr:
            got = mgr.load()
            out["loaded"] = int(got["shared"]["step"])
            _equal(got, expected(out["loaded"]))
            try:
                mgr.load(3)
                out["load3"] = None
            except ss.CheckpointError as exc:
                out["load3"] = str(exc)
    out["warnings"] = [str(w.message) for w in seen]
    return out


def _flip(path: str) -> None:
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 1]))


@pytest.mark.timeout(300)
def test_a_damaged_manifest_on_one_node_is_never_the_source(tmp_path: Path) -> None:
    root = str(tmp_path / "job")
    launch(THIS, "save_worker", WORLD, tmp_path, args={"root": root}, timeout_s=120)
    manifest = os.path.join(root, "node0", "step_0000000003", "manifest.json")
    _flip(manifest)
    res = launch(THIS, "damaged_worker", WORLD, tmp_path, args={"root": root},
                 timeout_s=150, tag="kept")
    for r in res:  # the persisted copy, with a warning naming node 0's manifest
        assert r.value["loaded"] == 3 and r.value["load3"] is None, r.value
        assert any(manifest in w for w in r.value["warnings"]), r.value
    shutil.rmtree(os.path.join(root, "persist", "step_0000000003"))
    res = launch(THIS, "damaged_worker", WORLD, tmp_path, args={"root": root},
                 timeout_s=150, tag="lost")
    for r in res:  # no persisted copy: damage, on every rank; a resume goes back a step
        assert r.value["loaded"] == 2, r.value
        assert manifest in r.value["load3"], r.value


def commit_fails_worker(ctx: Context) -> dict[str, Any]:
    """Async saves; node 1's leader fails to commit step 3 (its disk is full) after
    node 0's leader committed its copy."""
    from statestream.testing import faults

    _init(ctx)
    if ctx.rank == 1:
        def fail() -> None:
            time.sleep(2)  # node 0's leader commits its copy meanwhile
            raise OSError(28, "No space left on device (injected)")

        faults.on("commit.manifest_written", fail, nth=3)
    out: dict[str, Any] = {}
    with _manager(ctx, async_save=True) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, state_at(step, ctx.rank))
        try:
            mgr.wait()
        except ss.CheckpointError as exc:
            out["error"] = str(exc)
        out["steps"] = mgr.steps()
        out["local"] = sorted(os.listdir(os.path.join(ctx.args["root"], f"node{ctx.rank}")))
        out["again"] = mgr.save(3, state_at(3, ctx.rank))  # a failed save frees its step
        mgr.wait()
        _equal(mgr.load(), expected(3))
        out["persisted"] = mgr.persisted_steps()
    return out


@pytest.mark.timeout(240)
def test_a_commit_failing_on_one_node_leaves_no_copy_on_the_others(tmp_path: Path) -> None:
    root = str(tmp_path / "job")
    res = launch(THIS, "commit_fails_worker", WORLD, tmp_path, args={"root": root},
                 timeout_s=180)
    for r in res:
        v = r.value
        assert "No space left" in v["error"] and "nothing was committed" in v["error"], v
        assert v["steps"] == [1, 2] and "step_0000000003" not in v["local"], v
        assert v["again"] is True and v["persisted"] == [1, 2, 3], v


def partial_worker(ctx: Context) -> None:
    """Steps 1, 2 saved and persisted; node 1's leader is SIGKILLed while committing
    its copy of step 3, after node 0's leader committed its own."""
    from statestream.testing import faults

    _init(ctx)
    mgr = _manager(ctx, async_save=False)
    for step in (1, 2):
        mgr.save(step, state_at(step, ctx.rank))
    mgr.wait()
    if ctx.rank == 1:
        faults.on("commit.manifest_written", _die_later)
    mgr.save(3, state_at(3, ctx.rank))


def resume_partial_worker(ctx: Context) -> dict[str, Any]:
    _init(ctx)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with _manager(ctx) as mgr:
            out: dict[str, Any] = {"steps": mgr.steps()}
            got = mgr.load()
            out["loaded"] = int(got["shared"]["step"])
            _equal(got, expected(out["loaded"]))
            out["again"] = mgr.save(3, state_at(3, ctx.rank))
            mgr.wait()
            out["persisted"] = mgr.persisted_steps()
    out["warnings"] = [str(w.message) for w in seen]
    return out


@pytest.mark.timeout(300)
@pytest.mark.parametrize("peers", [False, True])
def test_a_save_killed_between_the_nodes_commits_was_never_saved(tmp_path: Path,
                                                                 peers: bool) -> None:
    root = str(tmp_path / "job")
    res = launch(THIS, "partial_worker", WORLD, tmp_path, args={"root": root, "peers": peers},
                 timeout_s=120, check=False, fail_grace_s=30)
    assert res[1].returncode == -9, [(r.returncode, r.error) for r in res]
    assert os.path.exists(os.path.join(root, "node0", "step_0000000003", "COMMITTED"))
    res = launch(THIS, "resume_partial_worker", WORLD, tmp_path, tag="resume",
                 timeout_s=180, args={"root": root, "peers": peers})
    for r in res:  # step 3 is gone (on node 0 too): resume from 2, save 3 again
        v = r.value
        assert v["steps"] == [1, 2] and v["loaded"] == 2, v
        assert any("removed as never saved" in w for w in v["warnings"]), v
        assert v["again"] is True and v["persisted"] == [1, 2, 3], v
    _equal(ss.load(os.path.join(root, "persist", "step_0000000003")), expected(3))


def restored_worker(ctx: Context) -> dict[str, Any]:
    """After a node lost its tier and the directory lost everything: load (the lost
    node's copy of step 3 is restored from its peer), save on, wait."""
    _init(ctx)
    with _manager(ctx) as mgr:
        got = mgr.load()
        out: dict[str, Any] = {"loaded": int(got["shared"]["step"])}
        for step in (4, 5, 6):
            mgr.save(step, state_at(step, ctx.rank))
        mgr.wait()
        out["persisted"] = mgr.persisted_steps()
        out["unpersisted"] = mgr.unpersisted_steps()
    return out


@pytest.mark.timeout(300)
@pytest.mark.parametrize("node", [0, 1])
def test_a_step_restored_from_a_peer_is_persisted_again(tmp_path: Path, node: int) -> None:
    """The surviving node records step 3 as persisted, the restored copy has no
    record: the step is persisted again (the directory lost it), never left on
    one node, unpersisted, forever."""
    root = str(tmp_path / "job")
    launch(THIS, "save_worker", WORLD, tmp_path, args={"root": root}, timeout_s=120)
    shutil.rmtree(os.path.join(root, f"node{node}"))
    shutil.rmtree(os.path.join(root, "persist"))
    res = launch(THIS, "restored_worker", WORLD, tmp_path, args={"root": root},
                 timeout_s=180, tag="restored")
    for r in res:
        v = r.value
        assert v["loaded"] == 3 and v["persisted"] == [3, 4, 5, 6], v
        assert v["unpersisted"] == [], v
    step3 = os.path.join(root, "persist", "step_0000000003")
    assert ss.verify(step3).ok
    _equal(ss.load(step3), expected(3))
