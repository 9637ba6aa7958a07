"""A fault that one rank alone sees in a manager's own bookkeeping reaches every rank
at once (2 gloo processes, loopback only).

The lease, the keep policies and a local tier's records are one process's work
(rank 0 holds the lease, each node's leader keeps its tier). A failure there used
to raise on that rank alone, before the save's first collective: the other ranks
waited for it until the collective's timeout and then called it dead, and the
ranks' collective calls no longer matched (``close`` timed out too). Each case
keeps the failing process alive and checks that every rank raises the same
error, naming the rank and what failed, and that the ranks stay in step.

* rank 0 loses the directory's lease (its lock file is removed), before a save or
  as it commits;
* a node's local tier is gone (its directory replaced by a file);
* recording a persisted step fails once on one node: the step is copied again.

A wrong outcome shows as a ``CollectiveTimeoutError`` (the collectives' timeout
here is 60 s) or a rank "died or disconnected" in the results.
"""

from __future__ import annotations

import datetime
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _launch import Context, launch  # noqa: E402
from _workers import require_gloo  # noqa: E402

torch, dist = require_gloo()

THIS = os.path.abspath(__file__)
pytestmark = pytest.mark.timeout(300)


def _state(rank: int, step: int) -> dict[str, Any]:
    return {"own": {f"r{rank}": np.full(50_000, 10 * rank + step, dtype=np.float32)},
            "step": step}


def _outcome(fn: Any) -> str:
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the result is compared in the test
        return f"{type(exc).__name__}: {exc}"
    return "ok"


def worker(ctx: Context) -> dict[str, Any]:
    import statestream as ss
    from statestream.manager import _records

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{ctx.port}", rank=ctx.rank,
                            world_size=ctx.world, timeout=datetime.timedelta(seconds=90))
    case, root = ctx.args["case"], ctx.args["root"]
    local = None if case.startswith("lease") else os.path.join(root, f"node{ctx.rank}")
    mgr = ss.CheckpointManager(os.path.join(root, "persist"), local_tier=local,
                               async_save=ctx.args["async"],
                               collective=ss.TorchCollective(timeout_s=60))
    mgr.save(1, _state(ctx.rank, 1))
    mgr.wait()
    out: dict[str, Any] = {}
    failed: list[int] = []
    lock = os.path.join(root, "persist", ".statestream.lock")
    if case == "lease" and ctx.rank == 0:
        os.unlink(lock)
    elif case == "lease-at-commit" and ctx.rank == 0:
        from statestream import _hooks

        def lose() -> None:
            _hooks.clear()
            os.unlink(lock)

        _hooks.register("commit.marker_written", lose)
    elif case == "tier-gone" and ctx.rank == 1:
        os.rename(local, local + ".gone")
        Path(local).write_text("not a directory any more")
    elif case == "record" and ctx.rank == 1:
        real = _records.StepRecords.record

        def write_record(self: Any, step: int) -> None:
            if step == 2 and not failed:
                failed.append(step)
                raise ss.StorageError(f"recording step {step} failed (injected)")
            real(self, step)

        _records.StepRecords.record = write_record  # type: ignore[method-assign]
    if case == "record":
        for step in (2, 3):  # wait() copies step 2 again, recorded this time
            mgr.save(step, _state(ctx.rank, step))
            mgr.wait()
        out["injected"] = failed
        out["persisted"] = mgr.persisted_steps()
        out["loaded"] = float(mgr.load(2)["own"][f"r{ctx.rank}"][0])
    else:
        out["save"] = _outcome(lambda: mgr.save(2, _state(ctx.rank, 2)))
        out["again"] = _outcome(lambda: mgr.save(2, _state(ctx.rank, 2)))
    out["close"] = _outcome(mgr.close)
    return out


def _run(tmp_path: Path, case: str, async_save: bool) -> list[dict[str, Any]]:
    results = launch(THIS, "worker", 2, tmp_path,
                     args={"case": case, "root": str(tmp_path), "async": async_save},
                     timeout_s=240)
    return [r.value for r in results]


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_a_lost_lease_on_rank_0_raises_on_every_rank(tmp_path: Path, async_save: bool) -> None:
    for rank, got in enumerate(_run(tmp_path, "lease", async_save)):
        for what in ("save", "again"):
            assert got[what].startswith("DistributedError: rank 0 failed during preparing "
                                        "to save step 2: ManagerLockedError"), (rank, got)
            assert "lost its lease" in got[what], (rank, got)
        assert got["close"].startswith("DistributedError: rank 0 failed"), (rank, got)
    import statestream as ss

    assert ss.load(str(tmp_path / "persist" / "step_0000000001"))["step"] == 1
    assert not (tmp_path / "persist" / "step_0000000002").exists()


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_a_lease_lost_as_rank_0_commits_raises_on_every_rank(tmp_path: Path,
                                                             async_save: bool) -> None:
    """Rank 0 checks the lease again last before it commits: its failure there is
    agreed as any failed commit (an async save's by its result, which the next save
    raises), and nothing is committed."""
    committing = "DistributedError: rank 0 failed during committing: ManagerLockedError"
    for rank, got in enumerate(_run(tmp_path, "lease-at-commit", async_save)):
        failed = got["again"] if async_save else got["save"]
        assert failed.startswith(committing), (rank, got)
        assert "removed or moved" in failed and "nothing was committed" in failed, (rank, got)
        if not async_save:
            assert got["again"].startswith("DistributedError: rank 0 failed during "
                                           "preparing to save step 2: ManagerLockedError")
        assert got["close"].startswith("DistributedError: rank 0 failed"), (rank, got)
    import statestream as ss

    assert ss.load(str(tmp_path / "persist" / "step_0000000001"))["step"] == 1
    assert sorted(os.listdir(tmp_path / "persist")) == ["step_0000000001"]


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_a_nodes_lost_local_tier_raises_on_every_rank(tmp_path: Path, async_save: bool) -> None:
    for rank, got in enumerate(_run(tmp_path, "tier-gone", async_save)):
        for what in ("save", "again"):
            assert got[what].startswith("DistributedError: rank 1 failed during preparing "
                                        "to save step 2: ManagerLockedError"), (rank, got)
            assert "node1" in got[what], (rank, got)
        # close tries once more to persist; rank 1 cannot even list its steps
        assert got["close"].startswith("DistributedError:"), (rank, got)
        assert "rank 1 failed during listing the unpersisted steps" in got["close"], (rank, got)
        assert "CollectiveTimeout" not in got["close"], (rank, got)
    import statestream as ss

    assert ss.load(str(tmp_path / "persist" / "step_0000000001"))["step"] == 1


def test_a_record_that_one_node_cannot_write_is_copied_again(tmp_path: Path) -> None:
    for rank, got in enumerate(_run(tmp_path, "record", async_save=True)):
        assert got["injected"] == ([2] if rank == 1 else []), (rank, got)
        assert got["persisted"] == [1, 2, 3], (rank, got)
        assert got["loaded"] == 10 * rank + 2, (rank, got)
        assert got["close"] == "ok", (rank, got)


# ----------------------------------------------------------------------------------------
# One rank's own fault right before a collective (found by an audit of every collective
# path): each case fails on one rank only, then every rank checks that the collective
# calls still line up (an all_gather that must return [0, 1] at once).

def _injected(msg: str) -> Any:
    import statestream as ss

    def fail(*args: Any, **kwargs: Any) -> Any:
        raise ss.StorageError(f"{msg} (injected)")
    return fail


class _Patch:
    """Set attributes on one rank for one case; undone after it."""

    def __init__(self) -> None:
        self._undo: list[tuple[Any, str, Any]] = []

    def set(self, obj: Any, name: str, value: Any) -> None:
        self._undo.append((obj, name, getattr(obj, name)))
        setattr(obj, name, value)

    def undo(self) -> None:
        for obj, name, value in reversed(self._undo):
            setattr(obj, name, value)


def _one_rank_case(case: str, rank: int, root: str, coll: Any, patch: _Patch) -> str:
    import statestream as ss
    from statestream.engine import _transfer
    from statestream.manager import _steps, _tier

    persist, node = os.path.join(root, "persist"), os.path.join(root, f"node{rank}")
    Mgr = ss.CheckpointManager
    if case == "meta-nan":  # a per-rank value in the metadata is NaN on one rank
        meta = {"loss": float("nan") if rank == 1 else 0.5}
        return _outcome(lambda: ss.save(os.path.join(root, "ck"), _state(rank, 1), meta=meta,
                                        collective=coll))
    if case in ("step-back", "step-back-forced"):  # one rank's step goes backwards
        mgr = Mgr(persist, async_save=False, collective=coll)
        mgr.save(2, _state(rank, 2))
        step = 1 if rank == 1 else 3
        return _outcome(lambda: mgr.save(step, _state(rank, step),
                                         force=case == "step-back-forced"))
    if case == "policy-raises":  # a user's save policy runs on rank 0 only
        class Flaky:
            def should_save(self, c: Any) -> bool:
                raise RuntimeError("the policy failed (injected)")
        mgr = Mgr(persist, async_save=False, collective=coll, save_policy=Flaky())
        return _outcome(lambda: mgr.save(1, _state(rank, 1)))
    tier = case in ("tier-steps", "open-tier", "persist-head", "replicate", "complete")
    mgr = Mgr(persist, async_save=False, collective=coll, incremental=case == "base-list",
              local_tier=node if tier else None, replicate_to_peers=case == "replicate")
    mgr.save(1, _state(rank, 1))
    mgr.wait()
    if case == "base-list" and rank == 0:  # rank 0 lists the base of an incremental step
        patch.set(_steps.StepDirectory, "steps", _injected("listing the directory failed"))
    elif case == "head" and rank == 1:  # whether the step is there: every rank asks
        patch.set(_steps.StepDirectory, "is_committed", _injected("a HEAD failed"))
    elif case == "resume-list" and rank == 0:  # rank 0 lists for every rank
        patch.set(_steps.StepDirectory, "steps", _injected("listing the directory failed"))
    elif case == "tier-steps" and rank == 1:
        patch.set(_tier.LocalTier, "unpersisted", _injected("listing the local tier failed"))
    elif case == "open-tier":
        mgr.close()
        if rank == 1:
            patch.set(_tier.LocalTier, "unpersisted", _injected("listing the local tier failed"))
        return _outcome(lambda: Mgr(persist, local_tier=node, async_save=False,
                                    collective=coll))
    elif case == "persist-head" and rank == 1:  # the store, on the persistence worker
        real = _steps.StepDirectory.is_committed

        def is_committed(self: Any, step: int) -> bool:
            if step == 2 and self.directory == persist:
                raise ss.StorageError("a HEAD of step 2 failed (injected)")
            return bool(real(self, step))
        patch.set(_steps.StepDirectory, "is_committed", is_committed)
    elif case in ("replicate", "complete") and rank == 1:
        patch.set(_transfer, "_held", _injected("listing the node's files failed"))
    if case in ("base-list", "head", "persist-head", "replicate"):
        return _outcome(lambda: (mgr.save(2, _state(rank, 2)), mgr.wait()))
    if case == "resume-list":
        return _outcome(mgr.load)
    if case == "tier-steps":
        return _outcome(mgr.steps)
    assert case == "complete"
    return _outcome(lambda: mgr.load(1))


ONE_RANK_CASES = ["meta-nan", "step-back", "step-back-forced", "policy-raises", "base-list",
                  "head", "resume-list", "tier-steps", "open-tier", "persist-head", "replicate",
                  "complete"]


def one_rank_worker(ctx: Context) -> dict[str, Any]:
    import statestream as ss

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{ctx.port}", rank=ctx.rank,
                            world_size=ctx.world, timeout=datetime.timedelta(seconds=90))
    coll = ss.TorchCollective(timeout_s=20)
    out: dict[str, Any] = {}
    for case in ctx.args["cases"]:
        root = os.path.join(ctx.args["root"], case)
        patch = _Patch()
        try:
            got = _one_rank_case(case, ctx.rank, root, coll, patch)
        finally:
            patch.undo()
        key = f"{case}-in-step"
        out[case] = [got, _outcome(lambda k=key: out.setdefault(  # type: ignore[misc]
            k, coll.all_gather_object(ctx.rank)))]
    return out


def test_one_ranks_fault_before_a_collective_raises_on_every_rank(tmp_path: Path) -> None:
    results = launch(THIS, "one_rank_worker", 2, tmp_path,
                     args={"cases": ONE_RANK_CASES, "root": str(tmp_path)}, timeout_s=240)
    # the rank whose fault every rank reports; None: the fault no longer reaches the
    # outcome (rank 0 alone asks the store whether the copy overwrites; a persistence
    # that failed to replicate is persisted again by wait()), and every rank goes on
    failing = {"meta-nan": 1, "step-back": 1, "step-back-forced": 1, "policy-raises": 0,
               "base-list": 0, "head": 1, "resume-list": 0, "tier-steps": 1, "open-tier": 1,
               "persist-head": None, "replicate": None, "complete": 1}
    for r in results:
        for case in ONE_RANK_CASES:
            got, in_step = r.value[case]
            assert in_step == "ok" and r.value[f"{case}-in-step"] == [0, 1], (case, r.rank, got)
            if failing[case] is None:
                assert got == "ok", (case, r.rank, got)
                continue
            assert got.startswith("DistributedError: "), (case, r.rank, got)
            assert f"rank {failing[case]} failed during" in got, (case, r.rank, got)
            assert any(w in got for w in ("(injected)", "JSON", "only go forward")), (
                case, r.rank, got)
            assert "CollectiveTimeout" not in got and "died" not in got, (case, r.rank, got)
