"""A manager's local tier across real processes (torch.distributed gloo, loopback).

Each process gets its own local directory, standing for its node's disk
(``node0``, ``node1``); the persistent directory is shared. Checked:

* saves (sync, async, lazy) commit one node-local copy per node (each with
  the manifest and its own process's files), are persisted as one committed
  checkpoint that loads anywhere, and load back exactly on every rank (the
  nodes complete each other's copies over gloo first);
* incremental steps (``incremental=True``) through one shared local tier and
  through one per node: persisted after the steps they refer to, loaded with
  those completed too, restored from a peer's copies;
* with ``replicate_to_peers=True`` each node also holds its peer's files:
  after deleting one node's directory *and* the persistent directory, a
  restarted job restores exactly from the surviving node's copy, and a stale
  peer copy (another step's bytes under the same names) is never loaded;
* a store outage that one rank learns of before another: every rank saves
  on, ``wait()`` raises on every rank, and catches up once the store is back.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _launch import Context, launch  # noqa: E402
from _workers import assert_tree_equal as _equal  # noqa: E402
from _workers import (
    init_gloo,  # noqa: E402
    kill_all_ranks_at,  # noqa: E402
    require_gloo,  # noqa: E402
)

torch, dist = require_gloo()

import statestream as ss  # noqa: E402

THIS = os.path.abspath(__file__)
WORLD = 2


def state_at(step: int, rank: int) -> dict[str, Any]:
    """Per-rank state next to replicated state (the same on every rank)."""
    return {
        "shared": {"w": np.arange(200_000, dtype=np.float32) * 0.5 + step,
                   "step": step},
        "per_rank": {f"rank{rank}": np.full((300, 100), rank * 1000 + step, dtype=np.int64)},
    }


def expected(step: int) -> dict[str, Any]:
    out = state_at(step, 0)
    for r in range(1, WORLD):
        out["per_rank"].update(state_at(step, r)["per_rank"])
    return out



def _init(ctx: Context) -> None:
    init_gloo(ctx)


def _data_files(step_dir: str) -> list[str]:
    try:
        return sorted(os.listdir(os.path.join(step_dir, "data")))
    except FileNotFoundError:
        return []


def save_worker(ctx: Context) -> dict[str, Any]:
    _init(ctx)
    a = ctx.args
    local = os.path.join(a["root"], f"node{ctx.rank}")
    with ss.CheckpointManager(os.path.join(a["root"], "persist"), local_tier=local,
                              async_save=a["mode"] != "sync", lazy=a["mode"] == "lazy",
                              replicate_to_peers=a["peers"],
                              io=ss.IOOptions(max_chunk_bytes=256 << 10)) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, state_at(step, ctx.rank))
        mgr.wait()
        files = _data_files(os.path.join(local, "step_0000000003"))
        out = {"persisted": mgr.persisted_steps(), "steps": mgr.steps(), "files": files}
        try:  # a target that does not fit, found while choosing what to fetch from peers
            mgr.load(target={"shared": {"w": np.zeros(3, np.float32)}})
        except ss.CheckpointError as exc:
            out["mismatch"] = f"{type(exc).__name__}: {exc}"
        _equal(mgr.load(), expected(3))
        _equal(mgr.load(2), expected(2))
        out["files_after_load"] = _data_files(os.path.join(local, "step_0000000003"))
    return out


def restore_worker(ctx: Context) -> dict[str, Any]:
    _init(ctx)
    a = ctx.args
    local = os.path.join(a["root"], f"node{ctx.rank}")
    with ss.CheckpointManager(os.path.join(a["root"], "persist"), local_tier=local,
                              replicate_to_peers=True) as mgr:
        out = {"steps": mgr.steps(), "persisted": mgr.persisted_steps()}
        _equal(mgr.load(), expected(3))
        out["files"] = _data_files(os.path.join(local, "step_0000000003"))
    return out


@pytest.mark.timeout(240)
@pytest.mark.parametrize("mode", ["sync", "async", "lazy"])
def test_node_local_tiers_persist_one_checkpoint(tmp_path: Path, mode: str) -> None:
    root = str(tmp_path / "job")
    res = launch(THIS, "save_worker", WORLD, tmp_path, args={"root": root, "mode": mode,
                                                             "peers": False}, timeout_s=180)
    for r in res:
        v = r.value
        assert v["persisted"] == [1, 2, 3] and v["steps"] == [1, 2, 3]
        # each node's copy held its own process's files only, until a load completed it
        assert v["files"] and all(f.startswith(f"r{r.rank}-") for f in v["files"]), v
        assert {f[:3] for f in v["files_after_load"]} == {"r0-", "r1-"}
        step3 = os.path.join(root, f"node{r.rank}", "step_0000000003")
        assert (f"TargetMismatchError: loading {step3}: shape mismatch at key path "
                "'shared/w'") in v["mismatch"], v["mismatch"]
    for step in (1, 2, 3):  # one committed checkpoint in the persistent directory
        path = os.path.join(root, "persist", f"step_{step:010d}")
        assert ss.verify(path).ok
        _equal(ss.load(path), expected(step))


@pytest.mark.timeout(240)
def test_a_lost_node_restores_from_its_peer(tmp_path: Path) -> None:
    root = str(tmp_path / "job")
    res = launch(THIS, "save_worker", WORLD, tmp_path, args={"root": root, "mode": "async",
                                                             "peers": True}, timeout_s=180)
    for r in res:  # own files and the peer's, before any load
        assert {f[:3] for f in r.value["files"]} == {"r0-", "r1-"}, r.value
    shutil.rmtree(os.path.join(root, "node1"))  # node 1 lost its disk
    shutil.rmtree(os.path.join(root, "persist"))  # and the persistent tier is gone too
    res = launch(THIS, "restore_worker", WORLD, tmp_path, args={"root": root}, timeout_s=180,
                 tag="restore")
    for r in res:
        assert r.value["persisted"] == []
        assert r.value["steps"] == [2, 3]  # the local keep policy's KeepLatest(2)
        assert {f[:3] for f in r.value["files"]} == {"r0-", "r1-"}
    # node 1's tier was rebuilt from node 0's copy: a whole, verified checkpoint
    assert ss.verify(os.path.join(root, "node1", "step_0000000003")).ok


def killed_worker(ctx: Context) -> None:
    """Save steps 1..3 (sync); SIGKILLed as the persistence of step 2 begins, on every
    rank once both are done saving (``kill_all_ranks_at``: step 3 is committed locally)."""
    _init(ctx)
    a = ctx.args
    saved = kill_all_ranks_at(ctx, "tier.persist", nth=2)
    mgr = ss.CheckpointManager(os.path.join(a["root"], "persist"),
                               local_tier=os.path.join(a["root"], f"node{ctx.rank}"),
                               async_save=False, io=ss.IOOptions(max_chunk_bytes=256 << 10))
    for step in (1, 2, 3):
        mgr.save(step, state_at(step, ctx.rank))
    saved()
    mgr.wait()


def recover_worker(ctx: Context) -> dict[str, Any]:
    _init(ctx)
    a = ctx.args
    with ss.CheckpointManager(os.path.join(a["root"], "persist"),
                              local_tier=os.path.join(a["root"], f"node{ctx.rank}")) as mgr:
        before = mgr.persisted_steps()
        mgr.wait()
        out = {"before": before, "after": mgr.persisted_steps(), "steps": mgr.steps()}
        _equal(mgr.load(), expected(out["steps"][-1]))
    return out


@pytest.mark.timeout(240)
def test_sigkill_before_persistence_loses_nothing_across_processes(tmp_path: Path) -> None:
    root = str(tmp_path / "job")
    res = launch(THIS, "killed_worker", WORLD, tmp_path, args={"root": root}, timeout_s=120,
                 check=False, fail_grace_s=30)
    assert all(r.returncode == -9 for r in res), [(r.returncode, r.error) for r in res]
    res = launch(THIS, "recover_worker", WORLD, tmp_path, args={"root": root}, timeout_s=180,
                 tag="recover")
    for r in res:
        assert r.value["before"] == [1], r.value
        assert 2 in r.value["after"] and r.value["after"] == r.value["steps"], r.value
    for step in res[0].value["after"]:
        path = os.path.join(root, "persist", f"step_{step:010d}")
        assert ss.verify(path).ok
        _equal(ss.load(path), expected(step))


def with_frozen(step: int, rank: int) -> dict[str, Any]:
    """state_at plus an array that never changes (what an incremental save skips)."""
    return {**state_at(step, rank), "frozen": np.arange(300_000, dtype=np.float32)}


def incremental_worker(ctx: Context) -> dict[str, Any]:
    """Incremental steps through local tiers: one node's (shared), or one per process."""
    _init(ctx)
    a = ctx.args
    node = "node" if a["one_node"] else f"node{ctx.rank}"
    with ss.CheckpointManager(os.path.join(a["root"], "persist"),
                              local_tier=os.path.join(a["root"], node), incremental=True,
                              replicate_to_peers=not a["one_node"],
                              keep_policy=ss.KeepLatest(1), local_keep_policy=ss.KeepLatest(1),
                              io=ss.IOOptions(max_chunk_bytes=256 << 10)) as mgr:
        if a["save"]:
            for step in (1, 2, 3):
                mgr.save(step, with_frozen(step, ctx.rank))
            mgr.wait()
        out: dict[str, Any] = {"steps": mgr.steps()}
        got = mgr.load()
        np.testing.assert_array_equal(got.pop("frozen"), with_frozen(3, 0)["frozen"])
        _equal(got, expected(3))
        local = os.path.join(a["root"], node)
        out["local"] = sorted(n for n in os.listdir(local) if n.startswith("step_"))
        out["files"] = {s: _data_files(os.path.join(local, s)) for s in out["local"]
                        if "." not in s}
    return out


def _check_persisted(root: str) -> None:
    persist = os.path.join(root, "persist")
    # step 3 refers to step 1 for 'frozen'; step 2 went with the keep policy
    assert sorted(n for n in os.listdir(persist) if n.startswith("step_")) == [
        "step_0000000001", "step_0000000003"]
    assert list(ss.metadata(os.path.join(persist, "step_0000000003")).bases) == [
        "step_0000000001"]
    for step in (1, 3):
        path = os.path.join(persist, f"step_{step:010d}")
        assert ss.verify(path).ok
        got = ss.load(path)
        np.testing.assert_array_equal(got.pop("frozen"), with_frozen(step, 0)["frozen"])
        _equal(got, expected(step))


@pytest.mark.timeout(240)
def test_incremental_steps_through_one_nodes_tier(tmp_path: Path) -> None:
    root = str(tmp_path / "job")
    res = launch(THIS, "incremental_worker", WORLD, tmp_path,
                 args={"root": root, "one_node": True, "save": True}, timeout_s=180)
    for r in res:
        assert r.value["steps"] == [3], r.value
    _check_persisted(root)


@pytest.mark.timeout(300)
def test_incremental_steps_through_node_local_tiers(tmp_path: Path) -> None:
    root = str(tmp_path / "job")
    res = launch(THIS, "incremental_worker", WORLD, tmp_path,
                 args={"root": root, "one_node": False, "save": True}, timeout_s=180)
    for r in res:
        # each node keeps step 3 and step 1, which 3 refers to; a load completed both
        assert r.value["steps"] == [3], r.value
        assert r.value["local"] == ["step_0000000001", "step_0000000001.persisted",
                                    "step_0000000003", "step_0000000003.persisted"], r.value
        for files in r.value["files"].values():
            assert {f[:3] for f in files} == {"r0-", "r1-"}, r.value
    _check_persisted(root)
    # node 1 loses its disk and the persistent copy is gone too: node 0's copies of
    # step 3 and of step 1 (its own files and its peer's) restore it
    shutil.rmtree(os.path.join(root, "node1"))
    shutil.rmtree(os.path.join(root, "persist"))
    res = launch(THIS, "incremental_worker", WORLD, tmp_path, tag="restore",
                 args={"root": root, "one_node": False, "save": False}, timeout_s=180)
    for r in res:
        assert r.value["steps"] == [3], r.value
        assert "step_0000000001" in r.value["local"], r.value


def outage_worker(ctx: Context) -> dict[str, Any]:
    """The store is down for steps 1 and 2 on every process, and rank 0 learns it
    only after rank 1 has finished saving step 2 (its persistence waits for a
    file rank 1 writes then): rank 1 already knows, rank 0 does not yet."""
    import threading
    import time
    import warnings

    from statestream import _hooks

    _init(ctx)
    a = ctx.args
    gate = os.path.join(a["root"], "rank1-saved-2")
    down = threading.Event()
    down.set()

    def store() -> None:
        if not down.is_set():
            return
        for _ in range(6000):
            if ctx.rank != 0 or os.path.exists(gate):
                break
            time.sleep(0.01)
        raise ss.StorageError("the object store is down (injected)")

    _hooks.register("tier.persist", store)
    out: dict[str, Any] = {}
    with ss.CheckpointManager(os.path.join(a["root"], "persist"),
                              local_tier=os.path.join(a["root"], f"node{ctx.rank}"),
                              async_save=False, io=ss.IOOptions(max_chunk_bytes=256 << 10)) as mgr:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            for step in (1, 2):  # rank 1 may see step 1's failure here, rank 0 cannot
                out[f"saved{step}"] = mgr.save(step, state_at(step, ctx.rank))
        if ctx.rank == 1:
            with open(gate, "w"):
                pass
        try:
            mgr.wait()
        except ss.DistributedError as exc:
            out["wait"] = sorted(set(exc.failed_types))
        out["unpersisted"] = mgr.unpersisted_steps()
        dist.barrier()
        down.clear()  # the store is back
        mgr.wait()
        out["persisted"] = mgr.persisted_steps()
        _equal(mgr.load(1), expected(1))
    return out


@pytest.mark.timeout(240)
def test_a_store_outage_is_decided_alike_on_every_rank(tmp_path: Path) -> None:
    root = str(tmp_path / "job")
    res = launch(THIS, "outage_worker", WORLD, tmp_path, args={"root": root}, timeout_s=180)
    for r in res:
        assert r.value == {"saved1": True, "saved2": True, "wait": ["StorageError"],
                           "unpersisted": [1, 2], "persisted": [1, 2]}, r.value
    for step in (1, 2):
        _equal(ss.load(os.path.join(root, "persist", f"step_{step:010d}")), expected(step))


def stale_peer_worker(ctx: Context) -> dict[str, Any]:
    """Open after node 1 lost its tier; load the newest step, recording warnings."""
    import warnings

    _init(ctx)
    a = ctx.args
    with ss.CheckpointManager(os.path.join(a["root"], "persist"),
                              local_tier=os.path.join(a["root"], f"node{ctx.rank}"),
                              replicate_to_peers=True) as mgr:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            got = mgr.load()
        step = int(got["shared"]["step"])
        _equal(got, expected(step))  # never another step's bytes, never a mix
    return {"step": step, "warnings": [str(w.message) for w in seen]}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("persistent", ["kept", "lost"])
def test_a_stale_peer_copy_is_never_loaded(tmp_path: Path, persistent: str) -> None:
    """Node 1 lost its tier, and node 0's copy of node 1's files of step 3 is stale:
    step 2's bytes under step 3's names (same sizes, so the copy looks whole).
    Completing node 1's copy from it must not load wrong or mixed data: the
    checksums catch it on every rank, and the load falls back to the persisted
    step 3, or (the persistent directory lost too) to step 2, with a warning."""
    root = str(tmp_path / "job")
    launch(THIS, "save_worker", WORLD, tmp_path, args={"root": root, "mode": "async",
                                                       "peers": True}, timeout_s=180)
    node0 = os.path.join(root, "node0")
    stale = [f for f in _data_files(os.path.join(node0, "step_0000000003"))
             if f.startswith("r1-")]
    assert stale and stale == [f for f in _data_files(os.path.join(node0, "step_0000000002"))
                               if f.startswith("r1-")]
    for f in stale:
        shutil.copyfile(os.path.join(node0, "step_0000000002", "data", f),
                        os.path.join(node0, "step_0000000003", "data", f))
    shutil.rmtree(os.path.join(root, "node1"))  # node 1 lost its disk
    if persistent == "lost":
        shutil.rmtree(os.path.join(root, "persist"))
    res = launch(THIS, "stale_peer_worker", WORLD, tmp_path, args={"root": root},
                 timeout_s=180, tag="stale")
    want = 3 if persistent == "kept" else 2
    for r in res:
        assert r.value["step"] == want, r.value
        assert any("damaged" in w for w in r.value["warnings"]), r.value


def resume_worker(ctx: Context) -> dict[str, Any]:
    """Incremental steps on node-local tiers; then (``resume``) a job on new machines
    (empty tiers) loads the newest step, waits for its background copy, saves one more."""
    _init(ctx)
    a = ctx.args
    local = os.path.join(a["root"], f"node{ctx.rank}")
    out: dict[str, Any] = {}
    with ss.CheckpointManager(os.path.join(a["root"], "persist"), local_tier=local,
                              incremental=True, io=ss.IOOptions(max_chunk_bytes=256 << 10)
                              ) as mgr:
        if not a["resume"]:
            for step in (1, 2):
                mgr.save(step, with_frozen(step, ctx.rank))
            mgr.wait()
            return out
        got = mgr.load()  # from the persistent directory: the tiers are empty
        np.testing.assert_array_equal(got.pop("frozen"), with_frozen(2, 0)["frozen"])
        _equal(got, expected(2))
        mgr.wait()  # the background copy of step 2 (and what it refers to) into each tier
        out["fetched"] = {s: _data_files(os.path.join(local, s))
                          for s in sorted(os.listdir(local)) if s.startswith("step_")
                          and "." not in s}
        out["verify_fetched"] = ss.verify(os.path.join(local, "step_0000000002")).ok
        mgr.save(3, with_frozen(3, ctx.rank))
        mgr.wait()
        got = mgr.load()  # from the tiers: the nodes complete step 3 and what it refers to
        np.testing.assert_array_equal(got.pop("frozen"), with_frozen(3, 0)["frozen"])
        _equal(got, expected(3))
    return out


def _data_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(path, "data", n)) for n in _data_files(path))


@pytest.mark.timeout(300)
def test_first_save_after_a_multi_node_resume_is_incremental(tmp_path: Path) -> None:
    root = str(tmp_path / "job")
    launch(THIS, "resume_worker", WORLD, tmp_path, args={"root": root, "resume": False},
           timeout_s=180)
    for r in range(WORLD):  # new machines: every node's tier is empty
        shutil.rmtree(os.path.join(root, f"node{r}"))
    res = launch(THIS, "resume_worker", WORLD, tmp_path, tag="resume",
                 args={"root": root, "resume": True}, timeout_s=180)
    for r in res:
        v = r.value
        # each node's copy holds its own process's files, as a node-local save leaves it
        assert v["fetched"] and "step_0000000002" in v["fetched"], v
        for files in v["fetched"].values():
            assert files and all(f.startswith(f"r{r.rank}-") for f in files), v
        assert v["verify_fetched"] is False  # not whole on its own, and not taken for it
    persist = os.path.join(root, "persist")
    step3 = os.path.join(persist, "step_0000000003")
    # step 3 refers to the chunks it shares with the loaded step's chain ('frozen')
    assert ss.metadata(step3).bases, ss.metadata(step3).bases
    frozen = with_frozen(3, 0)["frozen"].nbytes  # not written again
    assert _data_bytes(step3) <= _data_bytes(os.path.join(persist, "step_0000000001")) - frozen
    assert ss.verify(step3).ok
    got = ss.load(step3)
    np.testing.assert_array_equal(got.pop("frozen"), with_frozen(3, 0)["frozen"])
    _equal(got, expected(3))
