"""A local tier too small for its steps on one node of two (torch.distributed gloo,
loopback; a real 2 MiB tmpfs holds rank 1's tier, rank 0's is on the test's disk).

A save that does not fit in rank 1's tier fails on every rank; the ranks agree to
drop the persisted copies of the full tier and save once more together (a
synchronous save), and when nothing can leave it every rank raises an error that
names rank 1's full local tier.
"""

from __future__ import annotations

import errno
import os
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _launch import Context, launch  # noqa: E402
from _workers import init_gloo, require_gloo  # noqa: E402

torch, dist = require_gloo()

import statestream as ss  # noqa: E402
from statestream import _hooks  # noqa: E402

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="Linux (tmpfs)")

THIS = os.path.abspath(__file__)
WORLD = 2


def state_at(step: int, rank: int) -> dict[str, Any]:
    """Rank 1's part is 0.6 MB, then 1 MB from step 3 (more than the newest step
    the room before the save was made for); rank 0's is small."""
    n = 75_000 if step < 3 else 125_000
    return {"per_rank": {f"rank{rank}": np.arange(n if rank == 1 else 1000,
                                                  dtype=np.float64) + step}}


def expected(step: int) -> dict[str, Any]:
    out: dict[str, Any] = {"per_rank": {}}
    for r in range(WORLD):
        out["per_rank"].update(state_at(step, r)["per_rank"])
    return out


def _manager(ctx: Context, keep: int = 2, **kw: Any) -> ss.CheckpointManager:
    args = ctx.args
    local = args["full"] if ctx.rank == 1 else os.path.join(args["root"], "node0")
    return ss.CheckpointManager(os.path.join(args["root"], "persist"), local_tier=local,
                                collective=ss.TorchCollective(timeout_s=30),
                                local_keep_policy=ss.KeepLatest(keep), **kw)


def retry_worker(ctx: Context) -> dict[str, Any]:
    init_gloo(ctx)
    with _manager(ctx, async_save=False) as mgr:
        for step in (1, 2):
            assert mgr.save(step, state_at(step, ctx.rank))
            mgr.wait()
        with warnings.catch_warnings(record=True) as got:
            warnings.simplefilter("always")
            saved = mgr.save(3, state_at(3, ctx.rank))
        mgr.wait()
        out = {"saved": saved, "steps": mgr.steps(), "local": mgr._tier.steps(),
               "warned": [str(w.message) for w in got if "to make room" in str(w.message)]}
        for s in (1, 2, 3):
            got_state = mgr.load(s)
            for k, v in expected(s)["per_rank"].items():
                np.testing.assert_array_equal(got_state["per_rank"][k], v)
    return out


@pytest.mark.timeout(240)
def test_a_save_that_does_not_fit_one_ranks_tier_is_tried_again_by_every_rank(
        mount_tmpfs: Callable[[str], Path], tmp_path: Path) -> None:
    # Before: step 3 failed on both ranks (a DistributedError naming rank 1's ENOSPC);
    # only one process tried a save again after making room.
    full = mount_tmpfs("2m")
    res = launch(THIS, "retry_worker", WORLD, tmp_path, timeout_s=180,
                 args={"root": str(tmp_path / "job"), "full": str(full)})
    r0, r1 = (r.value for r in res)
    assert r0["saved"] and r1["saved"]
    assert r0["steps"] == r1["steps"] == [1, 2, 3]
    # rank 1's tier made room for step 3 (and may have let it go since, persisted,
    # for the next save: steps grow); rank 0's tier kept its two steps
    assert r1["local"] in ([3], []) and r0["local"] == [2, 3], (r0, r1)
    assert any("save of step 3 did not fit" in w and str(full) in w for w in r1["warned"])
    assert r0["warned"] == []


def nothing_to_drop_worker(ctx: Context) -> dict[str, Any]:
    init_gloo(ctx)

    def down() -> None:
        raise ss.StorageError("the object store is down (injected)")

    _hooks.register("tier.persist", down)
    mgr = _manager(ctx, async_save=ctx.args["async"])
    out: dict[str, Any] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        for step in (1, 2):
            assert mgr.save(step, state_at(step, ctx.rank))
        try:
            mgr.save(3, state_at(3, ctx.rank))
            out["at"] = "wait"  # the failure came after save returned
            mgr._wait_save()
        except ss.CheckpointError as exc:
            out.setdefault("at", "save")
            out["error"] = f"{type(exc).__name__}: {exc}"
            out["errno"] = getattr(exc, "errno", None)
        out["local"] = mgr._tier.steps()
        try:
            mgr.close()
        except ss.CheckpointError:
            pass  # the store is still down: nothing was persisted
    return out


@pytest.mark.timeout(240)
@pytest.mark.parametrize("async_save", [False, True])
def test_a_full_tier_on_one_rank_is_named_on_every_rank(
        mount_tmpfs: Callable[[str], Path], tmp_path: Path, async_save: bool) -> None:
    """The store is down: nothing can leave rank 1's tier. A synchronous save raises
    on every rank an ENOSPC StorageError naming rank 1's full tier (before: a
    DistributedError on each). An async save is not tried again (a rank's save may
    return before its write fails): every rank raises at the same call (before,
    when rank 1's save_async failed at once, rank 0's save returned and its next
    collective met another: a CollectiveTimeoutError), rank 1 its full tier's
    error, rank 0 a DistributedError naming rank 1's lack of room."""
    full = mount_tmpfs("2m")
    res = launch(THIS, "nothing_to_drop_worker", WORLD, tmp_path, timeout_s=180,
                 args={"root": str(tmp_path / "job"), "full": str(full), "async": async_save})
    says = f"saving step 3 failed: the local tier {full} is full ("
    assert res[0].value["at"] == res[1].value["at"], res  # the same call on every rank
    for r in res:
        v = r.value
        assert "error" in v and v["local"] == [1, 2], (r.rank, v)
        if not async_save:
            assert f"rank 1: {says}" in v["error"] and "saved on no rank" in v["error"], v
            assert v["errno"] == errno.ENOSPC, v
        elif r.rank == 1:
            assert says in v["error"] and v["errno"] == errno.ENOSPC, v
        else:
            assert ("DistributedError: rank 1 failed" in v["error"]
                    and "No space left on device" in v["error"]), v


def store_back_worker(ctx: Context) -> dict[str, Any]:
    """The store is down while rank 1's tier fills, then back; each persistence is
    slower than a save (the next save finds it running)."""
    init_gloo(ctx)
    store = {"down": True}

    def persist() -> None:
        time.sleep(0.3)
        if store["down"]:
            raise ss.StorageError("the object store is down (injected)")

    _hooks.register("tier.persist", persist)
    mgr = _manager(ctx, async_save=False)
    out: dict[str, Any] = {"saved": []}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        for step in (1, 2):
            assert mgr.save(step, state_at(step, ctx.rank))
        try:
            mgr.save(3, state_at(3, ctx.rank))
        except ss.StorageError as exc:
            out["error"], out["errno"] = str(exc), exc.errno
        store["down"] = False
        for step in (3, 4, 5):  # back to back
            out["saved"].append(mgr.save(step, state_at(step, ctx.rank)))
            out.setdefault("unpersisted", mgr.unpersisted_steps())  # after step 3
        mgr.wait()
        out["steps"], out["left"] = mgr.steps(), mgr.unpersisted_steps()
        for s in out["steps"]:
            for k, v in expected(s)["per_rank"].items():
                np.testing.assert_array_equal(mgr.load(s)["per_rank"][k], v)
        mgr.close()
    return out


@pytest.mark.timeout(240)
def test_a_store_back_after_one_ranks_tier_filled_takes_the_waiting_steps_at_the_next_save(
        mount_tmpfs: Callable[[str], Path], tmp_path: Path) -> None:
    """Rank 1's tier fills while the store is down: step 3 fails on every rank, saying
    that persisting the waiting steps failed, and why. Once the store is back, the
    next save persists them first, every rank together, and fits (was: the local
    tier is full at every save, until wait()); so do the saves right after it,
    which wait for the persistence running."""
    full = mount_tmpfs("2m")
    res = launch(THIS, "store_back_worker", WORLD, tmp_path, timeout_s=180,
                 args={"root": str(tmp_path / "job"), "full": str(full)})
    for r in res:
        v = r.value
        assert v["errno"] == errno.ENOSPC and f"rank 1: saving step 3 failed: the local tier " \
            f"{full} is full" in v["error"], (r.rank, v)
        assert ("persisting the local steps that wait to be ([1, 2]) to make room failed"
                in v["error"] and "the object store is down (injected)" in v["error"]), v
        assert v["saved"] == [True, True, True], (r.rank, v)
        assert not {1, 2} & set(v["unpersisted"]), (r.rank, v)
        assert v["steps"] == [1, 2, 3, 4, 5] and v["left"] == [], (r.rank, v)


def _peer_state(step: int, rank: int, big: bool = False) -> dict[str, Any]:
    """Rank 1's part: 0.72 MB; ``big``: 1.4 MB for steps 1-3, 0.4 MB from step 4."""
    n = (175_000 if step < 4 else 50_000) if big else 90_000
    return {"per_rank": {f"rank{rank}": np.arange(n if rank == 1 else 1000,
                                                  dtype=np.float64) + step}}


def peers_worker(ctx: Context) -> dict[str, Any]:
    """Rank 0's tier holds three steps, with rank 1's files too (``replicate_to_peers``);
    rank 1's 2 MiB tier holds fewer. Saves 1-5, loads 4 and 3, saves 6-8."""
    init_gloo(ctx)
    big = ctx.args["big"]
    mgr = _manager(ctx, keep=3, async_save=False, replicate_to_peers=True)
    out: dict[str, Any] = {"loads": {}}
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        for step in range(1, 6):
            assert mgr.save(step, _peer_state(step, ctx.rank, big))
            mgr.wait()
        out["before"] = mgr._tier.steps()
        for s in (4, 3):  # rank 1's tier dropped them; rank 0's holds rank 1's files
            loaded = mgr.load(s)["per_rank"]
            for r in range(WORLD):
                np.testing.assert_array_equal(loaded[f"rank{r}"],
                                              _peer_state(s, r, big)["per_rank"][f"rank{r}"])
            out["loads"][s] = mgr._tier.steps()
        out["entries"] = sorted(os.listdir(mgr._tier.root))
        for step in range(6, 9):
            assert mgr.save(step, _peer_state(step, ctx.rank, big))
            mgr.wait()
        out["after"] = mgr.steps()
        out["unpersisted"] = mgr.unpersisted_steps()
        mgr.close()
    out["warned"] = [str(w.message) for w in got if "was not copied into" in str(w.message)]
    return out


@pytest.mark.timeout(240)
def test_a_peer_copy_that_would_fill_a_full_tier_is_not_made_on_load(
        mount_tmpfs: Callable[[str], Path], tmp_path: Path) -> None:
    """Loading steps 4 and 3, which rank 1's full tier dropped for room, used to copy
    them back there from rank 0's peer copy before the load: step 4 filled the tier
    (the next save had to drop its newest step), step 3 did not fit and the load
    failed on every rank (a DistributedError naming ENOSPC), although the directory
    held it. Now the copy is not made: both load from the directory, with a warning
    on every rank naming rank 1's tier."""
    full = mount_tmpfs("2m")
    res = launch(THIS, "peers_worker", WORLD, tmp_path, timeout_s=180,
                 args={"root": str(tmp_path / "job"), "full": str(full), "big": False})
    r0, r1 = (r.value for r in res)
    assert r0["before"] == [3, 4, 5] and r1["before"] == [5], (r0, r1)
    assert r1["loads"] == {"4": [5], "3": [5]}, r1  # nothing copied back into it
    assert r0["loads"] == {"4": [3, 4, 5], "3": [3, 4, 5]}, r0
    for v in (r0, r1):
        assert v["after"] == list(range(1, 9)) and v["unpersisted"] == [], v
        assert len(v["warned"]) == 2 and all(f"local tier {full} (rank 1" in w
                                             for w in v["warned"]), v


@pytest.mark.timeout(240)
def test_a_peer_copy_that_does_not_fit_a_tier_loads_from_the_directory(
        mount_tmpfs: Callable[[str], Path], tmp_path: Path) -> None:
    """Rank 1's tier holds two 0.4 MB steps and has room for two more, but step 3 is
    1.4 MB: its copy from rank 0's peer copy fails for room (ENOSPC). The load used
    to fail on every rank; now it loads from the directory on every rank, with a
    warning naming rank 1's full tier, and step 4 (held there) from the tiers."""
    full = mount_tmpfs("2m")
    res = launch(THIS, "peers_worker", WORLD, tmp_path, timeout_s=180,
                 args={"root": str(tmp_path / "job"), "full": str(full), "big": True})
    r0, r1 = (r.value for r in res)
    assert r0["before"] == [3, 4, 5] and r1["before"] == [4, 5], (r0, r1)
    assert r1["loads"] == {"4": [4, 5], "3": [4, 5]}, r1
    assert not [e for e in r1["entries"] if "step_0000000003" in e], r1  # nothing left
    for v in (r0, r1):
        assert v["after"] == list(range(1, 9)) and v["unpersisted"] == [], v
        assert len(v["warned"]) == 1 and f"local tier {full} (rank 1)" in v["warned"][0], v
        assert "the tier is full" in v["warned"][0], v


def peer_files_worker(ctx: Context) -> list[str]:
    """Rank 0's 0.72 MB part goes to rank 1's 2 MiB tier as peer files, after each
    save commits there; rank 1's own part is small."""
    init_gloo(ctx)
    mgr = _manager(ctx, async_save=False, replicate_to_peers=True)
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        for step in range(1, 11):
            assert mgr.save(step, _peer_state(step, 1 - ctx.rank))  # the big part on rank 0
            mgr.wait()
        assert mgr.unpersisted_steps() == []
        mgr.close()
    return [str(w.message) for w in got if "to make room" in str(w.message)]


@pytest.mark.timeout(240)
def test_peer_files_landing_after_a_save_do_not_make_the_full_tier_warn_at_every_save(
        mount_tmpfs: Callable[[str], Path], tmp_path: Path) -> None:
    """Right after a save, the new step lacks its peer files (they land with its
    persistence), so the tier looked as if it had room again, and the next drop
    warned as a new shortage: at every save. It warns once."""
    full = mount_tmpfs("2m")
    res = launch(THIS, "peer_files_worker", WORLD, tmp_path, timeout_s=180,
                 args={"root": str(tmp_path / "job"), "full": str(full)})
    assert res[0].value == [], res[0].value
    assert len(res[1].value) == 1 and str(full) in res[1].value[0], res[1].value
